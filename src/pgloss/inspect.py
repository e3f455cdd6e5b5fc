"""How much gradient each token gets from a loss, and why: g_{i,t} = ∂L/∂log π_θ(y_{i,t}).

The gradient of a loss with respect to the model's parameters is Σ_{i,t} g_{i,t} ∇_θ log π_θ(y_{i,t}|·):
g is the weight the loss puts on each token's log-prob (a negative g raises the token's probability).
`inspect` computes g with autograd from the algorithm's own loss (same mask, same normaliser), so it
holds for every algorithm, and, where the policy term has one, its closed form

    g_{i,t} = -Â_{i,t} · f_{i,t} · w_{i,t}

with Â the advantage, w the aggregation weight of the token (`aggregate.token_weights`: 1/N_tok for
token-mean, 1/(N_seq·|y_i|) for seq-mean-token-mean, 1/N_seq for seq-mean-token-sum, 1/(N_seq·C) for
Dr.GRPO's constant divisor, 1/(N_grp·n_g) per group) and f the ratio or clip factor:

    token ratio (PPO, GRPO, DAPO, BNPO, Dr.GRPO)   f = r · b(r)
    sequence ratio s_i (GSPO, GSPO-token)          f = s_i · b(s_i)
    whole-sequence ratio ρ_i (sample_grpo)         f = |y_i| · ρ_i · b(ρ_i)
    CISPO                                          f = clip(r, 1 - ε_low, 1 + ε_high)   (detached weight)
    GPG                                            f = 1
    TIS-PG, TOPR                                   f = sg[clip(r, lo, hi)] (TOPR: 1 where the score > 0)
    SAPO                                           f = 4·σ(τ(r-1))·(1 - σ(τ(r-1))) · r
    FIPO                                           f = sg[influence] · r · b(r)

where b(r) = ∂(clipped surrogate)/∂r ÷ (-Â) is 1 inside the clip range and 0 where a clip, the dual
clip or the δ cap is active (½ on a tie, as autograd splits max and min), and every ratio counts only
while its log is within ±max_log_ratio. The whole-sequence ratio gives every token the weight of its
whole sequence: |y_i| times GRPO's at ratio one, the sample-level loss's length effect in one factor.
With a rollout correction (the algorithm's `rollout_correction`, or truncated importance sampling
when only rollout_log_prob is given), f is multiplied by its weight (for a ratio shared by the
sequence, GSPO's and the sample-level one, by its mean over the sequence), its rejections leave
the mask, and in bypass mode the ratio is against the rollout log-probs. The closed form is of the
policy term: `policy_grad` is autograd's gradient without the KL and entropy terms, `grad` with them.
Families without a closed form here (sequence ratios with per-token advantages, and families added
later) have `closed_form` None and `reason` says why; `grad` is autograd's either way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .aggregate import Normalizer, token_weights
from .algorithms import CISPO, FIPO, SAPO, Algorithm, ClippedPolicy
from .base import _seq_advantages
from .batch import TokenBatch
from .losses.cispo import cispo_cap
from .losses.fipo import fipo_influence
from .losses.reinforce import GPG, TISPG, TOPR
from .ratios import importance_ratio, log_ratio, sequence_log_ratio


@dataclass(frozen=True)
class TokenGradients:
    """The per-token gradient of a loss with respect to log π_θ, `[B, T]`, and its factors."""

    grad: Tensor
    """g = ∂L/∂log π_θ of the whole loss (KL and entropy terms included), by autograd; 0 where masked."""
    policy_grad: Tensor
    """The same without the KL and entropy terms: what `closed_form` equals."""
    advantage: Tensor
    """Â_{i,t}, broadcast to `[B, T]`, 0 where masked."""
    weight: Tensor
    """w_{i,t}, the aggregation weight of each token in the loss (0 where masked)."""
    factor: Tensor | None
    """f_{i,t}, the ratio or clip factor; None where the family has no closed form here."""
    reason: str
    """Which closed form applies, or why there is none."""

    @property
    def closed_form(self) -> Tensor | None:
        """-Â·f·w, equal to `policy_grad` (None where there is no closed form)."""
        return None if self.factor is None else -self.advantage * self.factor * self.weight


def token_gradients(algorithm: Algorithm, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                    mask: Tensor, **kwargs) -> Tensor:
    """g = ∂L/∂log π_θ by autograd, `[B, T]`: `algorithm`'s loss on this batch, called with the same
    arguments as `algorithm(...)` (`kwargs`: ref_log_prob, entropy, normalizer, group_ids, ...)."""
    _check_algorithm(algorithm)
    if not isinstance(log_prob, Tensor):
        raise TypeError(f"log_prob must be a tensor, got {type(log_prob).__name__}")
    leaf = log_prob.detach().clone().requires_grad_(True)
    out = algorithm(leaf, old_log_prob, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf, allow_unused=True)
    return torch.zeros_like(leaf) if grad is None else grad.detach()


def inspect(algorithm: Algorithm, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor, *,
            ref_log_prob: Tensor | None = None, entropy: Tensor | None = None,
            rollout_log_prob: Tensor | None = None, normalizer: Normalizer | None = None,
            group_ids: Tensor | None = None, scores: Tensor | None = None) -> TokenGradients:
    """The per-token gradient of `algorithm`'s loss on this batch and its decomposition -Â·f·w.

    Arguments as for `algorithm(...)`; without `normalizer` the batch is the whole step.
    """
    _check_algorithm(algorithm)
    extra = dict(rollout_log_prob=rollout_log_prob, normalizer=normalizer, group_ids=group_ids, scores=scores)
    grad = token_gradients(algorithm, log_prob, old_log_prob, advantages, mask,
                           ref_log_prob=ref_log_prob, entropy=entropy, **extra)
    policy_only = algorithm
    if algorithm.kl_coef != 0 or algorithm.entropy_coef != 0:
        policy_only = dataclasses.replace(algorithm, kl_coef=0.0, entropy_coef=0.0)
    policy_grad = token_gradients(policy_only, log_prob, old_log_prob, advantages, mask, **extra)
    batch = TokenBatch.prepare(log_prob.detach(), old_log_prob, advantages, mask,
                               rollout_log_prob=rollout_log_prob, group_ids=group_ids, scores=scores)
    if normalizer is None:  # the batch is the whole step, counted by the algorithm's own rule
        normalizer = algorithm.step_normalizer(batch.mask, old_log_probs=batch.old_log_prob,
                                               rollout_log_probs=batch.rollout_log_prob, group_ids=batch.group_ids,
                                               reduce=False)
    tis = None
    correction = algorithm.correction(batch.rollout_log_prob is not None)
    if correction is not None:  # the call's own rollout correction: its weight, mask and old log-probs
        corrected = correction.apply(
            log_prob=batch.log_prob, old_log_prob=batch.old_log_prob, rollout_log_prob=batch.rollout_log_prob,
            mask=batch.mask, seq_advantages=_seq_advantages(batch),
            weight_mean=getattr(normalizer, "weight_mean", None))
        batch = dataclasses.replace(batch, old_log_prob=corrected.old_log_prob, mask=corrected.mask)
        tis = corrected.weight
    weight = token_weights(batch.mask, algorithm.loss_agg_mode, normalizer, norm_constant=algorithm.norm_constant,
                           group_ids=batch.group_ids).to(batch.log_prob.dtype) * normalizer.world_size
    factor, reason = _factor(algorithm, batch, tis)
    if factor is not None:
        factor = torch.where(batch.mask, factor, 0.0)
    return TokenGradients(grad=grad, policy_grad=policy_grad, advantage=batch.advantages, weight=weight,
                          factor=factor, reason=reason)


def _check_algorithm(algorithm: object) -> None:
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be a pgloss Algorithm (pgloss.get(name)), got {type(algorithm).__name__}")


def clip_factor(ratio: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float,
                dual_clip: float | None = None, delta: float | None = None) -> Tensor:
    """b(r) = ∂ℓ_clip/∂r ÷ (-Â) of PPO's clipped surrogate (losses/ppo.py), `[B, T]`: 1 on the active
    unclipped branch, 0 on an active clip, dual clip or δ cap, ½ where autograd splits a tie."""
    ratio = ratio.expand_as(advantages)
    unclipped = ratio if delta is None else ratio.clamp(max=delta)
    d_unclipped = torch.ones_like(ratio) if delta is None else (ratio <= delta).to(ratio.dtype)
    low, high = 1.0 - clip_low, 1.0 + clip_high
    d_clipped = ((ratio >= low) & (ratio <= high)).to(ratio.dtype)
    loss_unclipped, loss_clipped = -advantages * unclipped, -advantages * ratio.clamp(low, high)
    b = torch.where(loss_unclipped > loss_clipped, d_unclipped,
                    torch.where(loss_clipped > loss_unclipped, d_clipped, 0.5 * (d_unclipped + d_clipped)))
    if dual_clip is not None:
        loss = torch.maximum(loss_unclipped, loss_clipped)
        bound = -advantages * dual_clip
        keep = torch.where(loss < bound, 1.0, torch.where(loss > bound, 0.0, 0.5)).to(ratio.dtype)
        b = torch.where(advantages < 0, b * keep, b)
    return b


def _factor(algorithm: Algorithm, batch: TokenBatch, tis: Tensor | None) -> tuple[Tensor | None, str]:
    """f of the module docstring for the families with a closed form, else (None, why). `tis`: the
    truncated importance weights (or None); a ratio shared by a sequence takes their mean over it."""
    factor, reason = _policy_factor(algorithm, batch)
    if factor is None or tis is None:
        return factor, reason
    if getattr(algorithm, "ratio_level", "token") in ("sequence", "sequence_product"):
        tis = tis.sum(dim=-1, keepdim=True) / batch.mask.sum(dim=-1, keepdim=True).clamp(min=1)
    return factor * tis, reason + ", times the rollout correction's weight"


def _policy_factor(algorithm: Algorithm, batch: TokenBatch) -> tuple[Tensor | None, str]:
    m = batch.mask
    token_log_ratio = torch.where(m, log_ratio(batch.log_prob, batch.old_log_prob), 0.0)
    limit = algorithm.max_log_ratio
    kind = type(algorithm)
    if kind is CISPO:
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, m, level="token", max_log_ratio=limit)
        lower = None if algorithm.clip_low is None else 1.0 - algorithm.clip_low
        upper = cispo_cap(algorithm.clip_high, algorithm.cispo_convention)
        return ratio.clamp(min=lower, max=upper), "CISPO: f = clip(r), a detached weight"
    if kind is GPG:
        return torch.ones_like(batch.log_prob), "GPG: f = 1, REINFORCE without a ratio"
    if kind in (TISPG, TOPR):
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, m, level="token", max_log_ratio=limit)
        return algorithm.weights(batch, ratio), f"{kind.__name__}: f = the detached truncated weight"
    if kind is SAPO:
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, m, level="token", max_log_ratio=limit)
        tau = torch.full_like(batch.advantages, algorithm.tau_neg).masked_fill(batch.advantages > 0, algorithm.tau_pos)
        gate = torch.sigmoid(tau * (ratio - 1.0))
        inside = (token_log_ratio.abs() <= limit).to(ratio.dtype)
        return 4.0 * gate * (1.0 - gate) * ratio * inside, "SAPO: f = 4σ(1-σ)·r, the soft gate's slope"
    if kind not in (ClippedPolicy, FIPO):
        return None, (f"no closed form for the {kind.__name__} family here; grad is autograd's")
    clip = dict(clip_low=algorithm.clip_low, clip_high=algorithm.clip_high, dual_clip=algorithm.dual_clip,
                delta=algorithm.delta)
    level = algorithm.ratio_level
    if level == "token":
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, m, level="token", max_log_ratio=limit)
        inside = (token_log_ratio.abs() <= limit).to(ratio.dtype)
        factor = ratio * clip_factor(ratio, batch.advantages, **clip) * inside
        if kind is FIPO:
            influence, _ = fipo_influence(token_log_ratio, ratio, batch.advantages, m,
                                          decay_rate=algorithm.fipo_decay_rate, clip_range=algorithm.fipo_clip_range,
                                          clip_high_only=algorithm.fipo_clip_high_only,
                                          safety_threshold=algorithm.fipo_safety_threshold, delta=algorithm.delta)
            return influence * factor, "FIPO: f = sg[influence]·r·b(r)"
        return factor, "token ratio: f = r·b(r)"
    constant = (batch.advantages == batch.advantages[:, :1]) | ~m
    if not bool(constant.all()):
        return None, f"ratio_level={level!r} with advantages that vary within a sequence: no per-token closed form"
    product = level == "sequence_product"
    seq_log = sequence_log_ratio(token_log_ratio, m, length_normalized=not product)
    ratio = torch.exp(seq_log.clamp(-limit, limit))
    inside = (seq_log.abs() <= limit).to(ratio.dtype)
    factor = ratio * clip_factor(ratio, batch.advantages, **clip) * inside
    if product:
        return factor * m.sum(dim=-1, keepdim=True), "whole-sequence ratio: f = |y_i|·ρ_i·b(ρ_i)"
    return factor, "sequence ratio: f = s_i·b(s_i)"
