"""Clip-Cov: PPO's clipped surrogate with a few random high-covariance tokens detached from the gradient
(Cui et al. 2025, arXiv 2505.22617; verl `compute_policy_loss_clip_cov`). cov_t and the selection over a
call or a step: `cov.py`.

Among the valid tokens that PPO's clip left alone and whose cov lies strictly inside (lb, ub), pick
k = max(⌊ratio·N⌋, 1) uniformly at random (all of them if fewer) and detach them from the gradient:

    L_t = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)) · c_t,      c_t = 0 if picked else 1

Defaults (verl `PolicyLossConfig`): clip_cov_ratio 2e-4, clip_cov_lb 1, clip_cov_ub 5. verl draws with
`torch.randperm(n_candidates)` from the global generator, which needs the candidate count on the host (a
sync). Here the draw is as uniform, without the host: one key u ~ U[0, 1) per position (float64, from an
explicit `torch.Generator`, so a step can be replayed exactly; None: the global generator of the tensors'
device), and the k candidates of smallest key are picked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch, check_mask, per_micro_batch
from ..core.distributed import is_distributed
from ..core.metrics import clip_metrics, ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from ..correction.token_masks import gather_values
from .closed_form import GradientFactor
from .cov import (
    SPLIT_SELECTION,
    StepTokens,
    check_selection,
    first_ranked,
    selection_size,
    step_covariance,
    token_covariance,
)
from .ppo import clip_factor


def draw_keys(
    shape: torch.Size | tuple[int, ...], device: torch.device, generator: torch.Generator | None = None
) -> Tensor:
    """U[0, 1) keys, float64, one per position: from `generator` on its own device (then moved,
    without waiting), or from the global generator of `device`."""
    if generator is None:
        return torch.rand(shape, dtype=torch.float64, device=device)
    keys = torch.rand(shape, dtype=torch.float64, device=generator.device, generator=generator)
    return keys.to(device, non_blocking=True)


def clip_cov_selection(candidates: Tensor, *, count: Tensor | int, generator: torch.Generator | None = None) -> Tensor:
    """The bool `[B, T]` map of `count` candidates drawn uniformly without replacement (all if fewer):
    the candidates of smallest key (`draw_keys`, one per position). With the same generator state,
    the same tokens.

    Args:
        candidates: bool `[B, T]`: valid, not clipped by PPO, and lb < cov < ub.
        count: k = `selection_size(clip_cov_ratio, mask)`.
        generator: the draw's `torch.Generator`; None uses the global one of the tensors' device.
    """
    keys = torch.where(candidates, draw_keys(candidates.shape, candidates.device, generator), 2.0)
    return candidates & first_ranked(keys, count, descending=False)


def _clip_cov_candidates(cov: Tensor, by_clip: Tensor, mask: Tensor, *, cov_lb: float, cov_ub: float) -> Tensor:
    """Bool `[B, T]`: valid, left alone by PPO's clip, and lb < cov < ub."""
    return mask & ~by_clip & (cov > cov_lb) & (cov < cov_ub)


def clip_cov_loss(
    ratio: Tensor,
    log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    cov_ratio: float,
    cov_lb: float,
    cov_ub: float,
    generator: torch.Generator | None = None,
    selection: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(L_t `[B, T]`, the map of detached tokens, the map of PPO-clipped tokens), both bool `[B, T]`.

    Args:
        ratio: r = π_θ/π_old, `[B, T]`.
        log_prob: log π_θ, `[B, T]` (only its detached value enters cov).
        advantages: A, `[B, T]`, detached.
        mask: bool `[B, T]`.
        clip_low, clip_high: PPO's ε_low, ε_high.
        cov_ratio: the fraction of valid tokens to detach (at least one).
        cov_lb, cov_ub: the open interval of cov a candidate must lie in.
        generator: the random draw's generator (None: the global one).
        selection: the tokens to detach, bool `[B, T]` (the step's, `ClipCov.step_selection`); None:
            drawn here among this call's tokens.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    by_clip = (clipped > unclipped) & mask
    if selection is None:
        candidates = _clip_cov_candidates(
            token_covariance(log_prob, advantages, mask), by_clip, mask, cov_lb=cov_lb, cov_ub=cov_ub
        )
        picked = clip_cov_selection(candidates, count=selection_size(cov_ratio, mask), generator=generator)
    else:
        picked = selection & mask
    loss = torch.where(picked, 0.0, torch.maximum(unclipped, clipped))
    return loss, picked, by_clip


@dataclass(frozen=True, kw_only=True)
class ClipCov(Algorithm):
    """PPO's clipped surrogate with k random high-covariance tokens detached (`clip_cov_loss`).

    The draw uses `generator` (compared by identity, not value); pass a seeded `torch.Generator`
    to make the step reproducible. The selection couples the tokens of one call (`couples_rows`),
    unless the step's is given (`selection`, from `step_selection`).
    """

    clip_low: float = 0.2
    """ε_low of PPO's clip (verl `clip_ratio_low`)."""
    clip_high: float = 0.2
    """ε_high of PPO's clip (verl `clip_ratio_high`)."""
    clip_cov_ratio: float = 2e-4
    """Fraction of the call's valid tokens to detach; at least one is (verl `clip_cov_ratio`)."""
    clip_cov_lb: float = 1.0
    """Candidates have cov > clip_cov_lb (verl `clip_cov_lb`)."""
    clip_cov_ub: float = 5.0
    """Candidates have cov < clip_cov_ub (verl `clip_cov_ub`)."""
    generator: torch.Generator | None = field(default=None, compare=False)
    """The generator of the random draw (`draw_keys`); None: torch's global generator of the tensors' device."""
    selection: Tensor | None = field(default=None, compare=False, repr=False)
    """The tokens to detach in this call, bool `[B, T]`: its part of the step's `step_selection`; None: drawn
    among the call's own tokens (verl)."""

    couples_rows = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.clip_low >= 0, f"clip_low must be >= 0, got {self.clip_low}")
        check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        check(self.clip_cov_ratio > 0, f"clip_cov_ratio must be > 0, got {self.clip_cov_ratio}")
        check(
            self.clip_cov_lb < self.clip_cov_ub,
            f"clip_cov_lb must be < clip_cov_ub, got {self.clip_cov_lb} and {self.clip_cov_ub}",
        )
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")

    def sequence_split_refusal(self) -> str | None:
        return SPLIT_SELECTION if self.selection is None else None

    def step_selection(
        self,
        log_probs: Tensor | Sequence[Tensor],
        old_log_probs: Tensor | Sequence[Tensor],
        advantages: Tensor | Sequence[Tensor],
        masks: Tensor | Sequence[Tensor],
        *,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
    ) -> list[Tensor]:
        """The step's detached tokens, one bool `[B, T]` map per micro-batch: the candidates of the whole
        step (its means, PPO's clip on log_probs - old_log_probs, lb < cov < ub), k = max(⌊ratio·N⌋, 1)
        with N the step's valid tokens: the k candidates of smallest key, one key per position of the
        step's micro-batches (in order; ranks in rank order) drawn at once on `generator` (`draw_keys`),
        ties in that order. Under torch.distributed this is a collective, and every rank must seed its
        `generator` (or the global one) alike. Pass each
        part to its call: `dataclasses.replace(algorithm, selection=part)`.

        `log_probs`: the current policy's log-probs of each micro-batch (a no-grad forward over the step;
        the old log-probs on an on-policy step); `old_log_probs` as in the call.
        """
        covs = step_covariance(log_probs, advantages, masks, process_group=process_group, reduce=reduce)
        ms = [check_mask(m, m.shape, m.device) for m in per_micro_batch("masks", masks)]
        olds = per_micro_batch("old_log_probs", old_log_probs, len(ms))
        lps = per_micro_batch("log_probs", log_probs, len(ms))
        advs = [
            a[:, None].expand_as(m) if a.ndim == 1 else a
            for a, m in zip(per_micro_batch("advantages", advantages, len(ms)), ms, strict=True)
        ]
        candidates = []
        for cov, lp, old, adv, m in zip(covs, lps, olds, advs, ms, strict=True):
            ratio = importance_ratio(
                lp.detach().to(cov.dtype),
                old.detach().to(cov.dtype),
                m,
                level="token",
                max_log_ratio=self.max_log_ratio,
            )
            adv = adv.detach().to(cov.dtype)
            by_clip = (-adv * ratio.clamp(1.0 - self.clip_low, 1.0 + self.clip_high) > -adv * ratio) & m
            candidates.append(_clip_cov_candidates(cov, by_clip, m, cov_lb=self.clip_cov_lb, cov_ub=self.clip_cov_ub))
        tokens = StepTokens(candidates, process_group=process_group, reduce=reduce)
        valid = torch.tensor(float(sum(int(m.sum()) for m in ms)), dtype=torch.float64, device=ms[0].device)
        if is_distributed(reduce):
            dist.all_reduce(valid, group=process_group)
        k = max(int(self.clip_cov_ratio * int(valid)), 1)
        # every rank draws the keys of every rank's positions (the same generator state), and keeps its own
        sizes = gather_values(
            torch.tensor([sum(m.numel() for m in ms)], device=ms[0].device), process_group=process_group, reduce=reduce
        )
        rank = dist.get_rank(process_group) if is_distributed(reduce) else 0
        keys = draw_keys((int(sizes.sum()),), ms[0].device, self.generator)[int(sizes[:rank].sum()) :]
        parts = list(keys[: int(sizes[rank])].split([m.numel() for m in ms]))
        values = gather_values(
            tokens.values([part.view(m.shape) for part, m in zip(parts, ms, strict=True)]),
            process_group=process_group,
            reduce=reduce,
        )
        return tokens.scatter(tokens.local(values.argsort(stable=True)[:k]).to(ms[0].device))

    def _loss(self, batch: TokenBatch, ratio: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return clip_cov_loss(
            ratio,
            batch.log_prob,
            batch.advantages,
            batch.mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            cov_ratio=self.clip_cov_ratio,
            cov_lb=self.clip_cov_lb,
            cov_ub=self.clip_cov_ub,
            generator=self.generator,
            selection=check_selection(self.selection, batch.mask),
        )

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        loss, picked, by_clip = self._loss(batch, ratio)
        positive = batch.advantages > 0
        metrics = clip_metrics(by_clip & positive, by_clip & ~positive, batch.mask)
        metrics["clip_cov_fraction"] = token_mean(picked.to(ratio.dtype), batch.mask)
        metrics |= ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        return PolicyTerms(loss, metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = r·b(r)·(1 - picked): PPO's factor, 0 on the detached tokens (the call's draw)."""
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        _, picked, _ = self._loss(batch, ratio)
        inside = (log_ratio(batch.log_prob, batch.old_log_prob).abs() <= self.max_log_ratio).to(ratio.dtype)
        b = clip_factor(ratio, batch.advantages, clip_low=self.clip_low, clip_high=self.clip_high)
        return GradientFactor(
            torch.where(picked, 0.0, ratio * b * inside), "Clip-Cov: f = r·b(r), 0 on the detached tokens"
        )
