"""The clipped surrogate of PPO, with DAPO's asymmetric bounds, dual clip and the δ cap.

Per token (minimisation form, Schulman et al. 2017, https://arxiv.org/abs/1707.06347):

    L_clip = max( -A·r, -A·clip(r, 1-ε_low, 1+ε_high) )

- Clip-higher (DAPO, https://arxiv.org/abs/2503.14476): ε_high > ε_low.
- Dual clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729), for A < 0 only, c > 1:

      L = min( L_clip, -c·A )

  which bounds the loss of a bad action whose ratio has exploded (verl's `clip_ratio_c`).
- δ cap (two-sided clipping of INTELLECT-2, TRL's `delta`): the unclipped ratio is capped,
  r → min(r, δ) in the first branch only, δ > 1 + ε_high. For A < 0 it equals dual clip with
  c = δ; for A > 0 it changes nothing, since the clipped branch already wins there.

The ratio can be a token ratio `[B, T]` or a sequence ratio `[B, 1]` (GSPO): the formula is the same.
In the clipped zones the gradient with respect to the ratio is exactly zero.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.clip import clipped_surrogate
from ..core.metrics import clip_metrics, ratio_metrics
from ..core.output import PolicyTerms, check
from ..core.ratios import RATIO_LEVELS, importance_ratio, log_ratio, sequence_log_ratio
from ..core.sequence_parallel import row_lengths
from ..core.slope import with_slope
from .closed_form import GradientFactor


def clip_factor(
    ratio: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    delta: float | None = None,
) -> Tensor:
    """b(r) = ∂ℓ_clip/∂r ÷ (-Â) of the clipped surrogate (`clipped_surrogate`), `[B, T]`: 1 on the
    active unclipped branch, 0 on an active clip, dual clip or δ cap, ½ where autograd splits a tie
    of max(-Â·r, -Â·clip(r)) (the two-branch form's gradient, which the tests check it against)."""
    ratio = ratio.expand_as(advantages)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    d_unclipped = torch.ones_like(ratio) if delta is None else (ratio <= delta).to(ratio.dtype)
    low, high = 1.0 - clip_low, 1.0 + clip_high
    d_clipped = ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
    loss_unclipped, loss_clipped = -advantages * unclipped, -advantages * ratio.clamp(low, high)
    b = torch.where(
        loss_unclipped > loss_clipped,
        d_unclipped,
        torch.where(loss_clipped > loss_unclipped, d_clipped, 0.5 * (d_unclipped + d_clipped)),
    )
    if dual_clip is not None:
        loss = torch.maximum(loss_unclipped, loss_clipped)
        bound = -advantages * dual_clip
        keep = torch.where(loss < bound, 1.0, torch.where(loss > bound, 0.0, 0.5)).to(ratio.dtype)
        b = torch.where(advantages < 0, b * keep, b)
    return b


@dataclass(frozen=True, kw_only=True)
class ClippedPolicy(Algorithm):
    """PPO's clipped surrogate on a token or sequence importance ratio (losses/ppo.py, ratios.py).

        ℓ_{i,t} = max( -Â·r, -Â·clip(r, 1-ε_low, 1+ε_high) ),  optionally dual-clipped or δ-capped,

    with r the ratio at `ratio_level`. The sequence levels (`sequence`: GSPO, `sequence_product`:
    the sample-level GRPO of "OpenR1 in practice (6)", 2025-06-04) define one loss per sequence, ℓ_i, copied onto its tokens,
    and fix loss_agg_mode to seq-mean-token-mean so that the loss is (1/N_seq) Σ_i ℓ_i.
    """

    clip_low: float = 0.2
    """ε_low: the lower bound of the ratio is 1 - clip_low (verl `clip_ratio_low`, TRL `epsilon`)."""
    clip_high: float = 0.2
    """ε_high: the upper bound is 1 + clip_high (verl `clip_ratio_high`, TRL `epsilon_high`)."""
    dual_clip: float | None = None
    """c > 1: for Â < 0 the loss is at most -c·Â (verl `clip_ratio_c`); None disables it."""
    delta: float | None = None
    """δ > 1 + clip_high: the unclipped ratio is capped at δ (TRL `delta`); None disables it."""
    ratio_level: str = "token"
    """token | sequence | sequence_token | sequence_product (ratios.py)."""

    @property
    def fixed_agg_mode(self) -> str | None:
        return "seq-mean-token-mean" if self.ratio_level in ("sequence", "sequence_product") else None

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.ratio_level in RATIO_LEVELS, f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        check(self.clip_low >= 0, f"clip_low must be >= 0, got {self.clip_low}")
        check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None:
            check(self.dual_clip > 1, f"dual_clip must be > 1, got {self.dual_clip}")
        if self.delta is not None:
            check(
                self.delta > 1 + self.clip_high,
                f"delta must be > 1 + clip_high = {1 + self.clip_high}, got {self.delta}",
            )

    def ratio(self, batch: TokenBatch, token_log_ratio: Tensor | None = None) -> Tensor:
        return importance_ratio(
            batch.log_prob,
            batch.old_log_prob,
            batch.mask,
            level=self.ratio_level,
            max_log_ratio=self.max_log_ratio,
            token_log_ratio=token_log_ratio,
            sequence_parallel=batch.sequence_parallel,
        )

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        token_level = self.ratio_level == "token"
        token_log_ratio = log_ratio(batch.log_prob.detach(), batch.old_log_prob)
        # Token ratios: ℓ_t depends on log π_t alone, so its derivative is attached in closed form
        # (`with_slope`) and the backward pass is one multiply; sequence ratios go through autograd.
        with torch.set_grad_enabled(torch.is_grad_enabled() and not token_level):
            ratio = self.ratio(batch, token_log_ratio if token_level else None)  # no gradient to carry: reused
            surrogate = clipped_surrogate(
                ratio,
                batch.advantages,
                clip_low=self.clip_low,
                clip_high=self.clip_high,
                dual_clip=self.dual_clip,
                delta=self.delta,
            )
        loss = surrogate.loss
        if token_level:
            # ∂ℓ_t/∂log π_t = -Â·r where no bound holds r (then ℓ = -Â·r exactly), else 0.
            free = (surrogate.factor == ratio) & (token_log_ratio.abs() <= self.max_log_ratio)
            loss = with_slope(loss, batch.log_prob, torch.where(free, loss, 0.0))
        count = batch.mask.sum()
        metrics = clip_metrics(
            surrogate.clipped_high,
            surrogate.clipped_low,
            batch.mask,
            None if self.dual_clip is None and self.delta is None else surrogate.clipped_dual,
            count,
        )
        metrics |= ratio_metrics(ratio, token_log_ratio, batch.mask, count)
        return PolicyTerms(loss, metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f of g = -Â·f·w, with b(r) = `clip_factor` and every ratio counted only while its log is within
        ±max_log_ratio:

            token ratio (PPO, GRPO, DAPO, BNPO, Dr.GRPO)   f = r·b(r)
            sequence ratio s_i (GSPO, GSPO-token)          f = s_i·b(s_i)
            whole-sequence ratio ρ_i (sample_grpo)         f = |y_i|·ρ_i·b(ρ_i)

        (for any aggregation: its weights are constant along a row). The whole-sequence ratio gives
        every token the weight of its whole sequence: |y_i| times GRPO's at ratio one. The sequence
        levels need advantages constant along each row (None otherwise).
        """
        m, limit = batch.mask, self.max_log_ratio
        token_log_ratio = log_ratio(batch.log_prob, batch.old_log_prob)
        b = functools.partial(
            clip_factor, clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip, delta=self.delta
        )
        level = self.ratio_level
        if level == "token":
            ratio = importance_ratio(batch.log_prob, batch.old_log_prob, m, level="token", max_log_ratio=limit)
            inside = (token_log_ratio.abs() <= limit).to(ratio.dtype)
            return GradientFactor(ratio * b(ratio, batch.advantages) * inside, "token ratio: f = r·b(r)")
        constant = (batch.advantages == batch.advantages[:, :1]) | ~m
        if not bool(constant.all()):
            return GradientFactor(
                None, f"ratio_level={level!r} with advantages that vary within a sequence: no per-token closed form"
            )
        product = level == "sequence_product"
        split = batch.sequence_parallel  # s_i and |y_i| over the whole sequence, not this rank's slice
        seq_log = sequence_log_ratio(token_log_ratio, m, length_normalized=not product, sequence_parallel=split)
        ratio = torch.exp(seq_log.clamp(-limit, limit))
        inside = (seq_log.abs() <= limit).to(ratio.dtype)
        factor = ratio * b(ratio, batch.advantages) * inside
        shared = level in ("sequence", "sequence_product")  # sequence_token: the token's own gradient
        if product:
            return GradientFactor(
                factor * row_lengths(m, split, keepdim=True, dtype=factor.dtype),
                "whole-sequence ratio: f = |y_i|·ρ_i·b(ρ_i)",
                per_sequence=shared,
            )
        return GradientFactor(factor, "sequence ratio: f = s_i·b(s_i)", per_sequence=shared)
