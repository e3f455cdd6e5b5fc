"""Clip-Cov and KL-Cov: act on the few tokens whose covariance drives entropy collapse
(Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
https://arxiv.org/abs/2505.22617).

Both score each valid token by the centred product of its advantage and log-probability, with
means over the valid tokens of the call:

    cov_t = (A_t - mean_m A) · (log π_θ(y_t) - mean_m log π_θ)        (detached)

Clip-Cov (verl `compute_policy_loss_clip_cov`): among the valid tokens that PPO's clip left alone
and whose cov lies strictly inside (lb, ub), pick k = max(⌊ratio·N⌋, 1) uniformly at random
(all of them if fewer) and detach them from the gradient:

    L_t = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)) · c_t,      c_t = 0 if picked else 1

KL-Cov (verl `compute_policy_loss_kl_cov`): the k = max(⌊ratio·N⌋, 1) tokens of largest cov get a
penalty on the log-ratio δ = log r, the other tokens the unclipped surrogate:

    L_t = -A·r + κ·|δ|·1[t in top-k]

Defaults (verl `PolicyLossConfig`): clip_cov_ratio 2e-4, clip_cov_lb 1, clip_cov_ub 5,
kl_cov_ratio 2e-4, κ = ppo_kl_coef 0.1 (the code's fallback 1.0 applies only without a config).
verl's Clip-Cov draws with `torch.randperm(n_candidates)` from the global generator, which needs
the candidate count on the host (a sync). Here the draw is as uniform, without the host: one key
u ~ U[0, 1) per position (float64, from an explicit `torch.Generator`, so a step can be replayed
exactly; None: the global generator of the tensors' device), and the k candidates of smallest key
are picked. k stays a tensor, so a call runs on `meta` tensors and under `torch.compile`.

The selection is a function of the tokens of one call: the means, N and the draw couple every
token of the batch it is given. Split a step into micro-batches and each selects among its own
tokens, as in verl. To select over the whole step instead, take the step's selection before its
micro-batches, `algorithm.step_selection(log_probs, ...)` (every micro-batch and, under
torch.distributed, every rank: the means, N, the draw or the top-k are the step's), and give each
micro-batch's call its part, `dataclasses.replace(algorithm, selection=part)`. Everything else (the
surrogate, the aggregation) is split-invariant, so the step's loss and gradient then do not depend
on the split. The covariance reads the current policy's log-probs, which a trainer sees one
micro-batch at a time: take them from a no-grad forward pass over the step (the parameters do not
change within a step), or pass the old log-probs where the step is on-policy (π_θ = π_old at its
first update). One process's step selection on its whole batch is exactly `clip_cov_loss`'s and
`kl_cov_loss`'s selection on that batch (the same keys from the same generator state; the same top-k).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch, check_mask, check_tensor, per_micro_batch
from ..core.distributed import is_distributed
from ..core.metrics import clip_metrics, ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from ..correction.token_masks import gather_values
from .closed_form import GradientFactor
from .ppo import clip_factor


def token_covariance(log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """cov_t = (A - mean_m A)(log π - mean_m log π) over the valid tokens, detached, `[B, T]`."""
    m = mask.to(log_prob.dtype)
    count = m.sum().clamp(min=1)
    lp = log_prob.detach()
    mean_a = (advantages * m).sum() / count
    mean_lp = (lp * m).sum() / count
    return (advantages - mean_a) * (lp - mean_lp)


def selection_size(ratio: float, mask: Tensor) -> Tensor:
    """k = max(⌊ratio · N_valid⌋, 1), as verl, as a 0-d int64 tensor (no host sync)."""
    return (ratio * mask.sum(dtype=torch.float64)).floor().clamp(min=1).long()


def first_ranked(keys: Tensor, count: Tensor | int, *, descending: bool) -> Tensor:
    """Bool map (the shape of `keys`) of the `count` positions first in the order of `keys`, ties
    in row-major order; `count` may be a 0-d tensor: no host sync."""
    flat = keys.reshape(-1)
    order = flat.argsort(descending=descending, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return (rank < count).view(keys.shape)


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


def kl_cov_loss(
    ratio: Tensor,
    log_prob: Tensor,
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cov_ratio: float,
    kl_coef: float,
    selection: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(L_t `[B, T]`, the bool `[B, T]` map of the top-k tokens that carry the |δ| penalty).

    Args:
        ratio: r = π_θ/π_old, `[B, T]`.
        log_prob: log π_θ, `[B, T]` (only its detached value enters cov).
        token_log_ratio: δ = log π_θ - log π_old, `[B, T]`, with gradient.
        advantages: A, `[B, T]`, detached.
        mask: bool `[B, T]`.
        cov_ratio: the fraction of valid tokens to penalise (at least one).
        kl_coef: κ, verl's `ppo_kl_coef`.
        selection: the penalised tokens, bool `[B, T]` (the step's, `KLCov.step_selection`); None: the
            top-k of this call's tokens.
    """
    surrogate = -advantages * ratio
    if selection is None:  # the top k, ties in row-major order
        cov = torch.where(mask, token_covariance(log_prob, advantages, mask), -torch.inf)
        top = mask & first_ranked(cov, selection_size(cov_ratio, mask), descending=True)
    else:
        top = selection & mask
    return torch.where(top, surrogate + kl_coef * token_log_ratio.abs(), surrogate), top


class _StepTokens:
    """The valid tokens of a step's micro-batches on this rank, in order (micro-batch, then row-major),
    and where this rank's tokens sit among every rank's (rank order)."""

    def __init__(self, masks: list[Tensor], *, process_group, reduce: bool) -> None:
        self.masks = masks
        self.index = [m.reshape(-1).nonzero().squeeze(-1) for m in masks]
        self.count = sum(len(i) for i in self.index)
        device = masks[0].device
        sizes = gather_values(torch.tensor([self.count], device=device), process_group=process_group, reduce=reduce)
        rank = dist.get_rank(process_group) if is_distributed(reduce) else 0
        self.offset = int(sizes[:rank].sum())
        self.total = int(sizes.sum())

    def values(self, tensors: list[Tensor]) -> Tensor:
        """The valid values of `tensors` (one per micro-batch), concatenated, 1-d."""
        return torch.cat([t.reshape(-1)[i] for t, i in zip(tensors, self.index)])

    def scatter(self, chosen: Tensor) -> list[Tensor]:
        """Bool maps, one per micro-batch, of the local tokens at positions `chosen` (of `values`)."""
        flags = torch.zeros(self.count, dtype=torch.bool, device=chosen.device).index_fill(0, chosen, True)
        out, start = [], 0
        for mask, index in zip(self.masks, self.index):
            part = flags[start : start + len(index)].to(mask.device)
            out.append(
                torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
                .index_fill(0, index[part], True)
                .view_as(mask)
            )
            start += len(index)
        return out

    def local(self, global_index: Tensor) -> Tensor:
        """The global positions (every rank's tokens, in rank order) that are this rank's, as local positions."""
        mine = (global_index >= self.offset) & (global_index < self.offset + self.count)
        return global_index[mine] - self.offset


def step_covariance(
    log_probs: Tensor | Sequence[Tensor],
    advantages: Tensor | Sequence[Tensor],
    masks: Tensor | Sequence[Tensor],
    *,
    process_group: dist.ProcessGroup | None = None,
    reduce: bool = True,
) -> list[Tensor]:
    """cov_t = (A_t - mean A)(log π_t - mean log π) with the means over the step's valid tokens (every
    micro-batch, and every rank when torch.distributed is initialized and `reduce`: a collective);
    one detached `[B, T]` tensor per micro-batch. `advantages` `[B]` or `[B, T]` per micro-batch."""
    ms = [check_mask(m, m.shape, m.device) for m in per_micro_batch("masks", masks)]
    lps = [check_tensor("log_probs", lp, ndim=(2,)).detach() for lp in per_micro_batch("log_probs", log_probs, len(ms))]
    advs = [
        check_tensor("advantages", a, ndim=(1, 2)).detach() for a in per_micro_batch("advantages", advantages, len(ms))
    ]
    advs = [a[:, None].expand_as(m) if a.ndim == 1 else a for a, m in zip(advs, ms)]
    for k, (lp, a, m) in enumerate(zip(lps, advs, ms)):
        if lp.shape != m.shape or a.shape != m.shape:
            raise ValueError(
                f"micro-batch {k}: log_probs, advantages and masks must share one [B, T] shape, got "
                f"{tuple(lp.shape)}, {tuple(a.shape)}, {tuple(m.shape)}"
            )
    dtype = torch.float64 if lps[0].dtype == torch.float64 else torch.float32
    sums = torch.stack(
        [
            sum(torch.where(m, a, 0.0).sum() for a, m in zip(advs, ms)),
            sum(torch.where(m, lp, 0.0).sum() for lp, m in zip(lps, ms)),
            sum(m.sum() for m in ms),
        ]
    ).to(torch.float64)
    if is_distributed(reduce):
        dist.all_reduce(sums, group=process_group)
    count = sums[2].clamp(min=1)
    mean_a, mean_lp = (sums[0] / count).to(dtype), (sums[1] / count).to(dtype)
    return [torch.where(m, (a.to(dtype) - mean_a) * (lp.to(dtype) - mean_lp), 0.0) for a, lp, m in zip(advs, lps, ms)]


SPLIT_SELECTION = (
    "its token selection is drawn among a call's own tokens, a slice of each sequence; take the "
    "step's with step_selection(..., process_group=<every rank holding the step's tokens>) and give "
    "each call its part, dataclasses.replace(algorithm, selection=part)"
)
"""Why Clip-Cov and KL-Cov without a `selection` refuse sequences split across ranks (`sequence_split_refusal`)."""


def _check_selection(selection: object, mask: Tensor) -> Tensor | None:
    if selection is None:
        return None
    if not isinstance(selection, Tensor) or selection.dtype != torch.bool or selection.shape != mask.shape:
        raise ValueError(
            f"selection must be a bool tensor of the call's shape {tuple(mask.shape)} (this call's part of "
            f"step_selection), got {getattr(selection, 'dtype', type(selection).__name__)} "
            f"{tuple(getattr(selection, 'shape', ()))}"
        )
    return selection.to(mask.device)


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
            a[:, None].expand_as(m) if a.ndim == 1 else a for a, m in zip(per_micro_batch("advantages", advantages), ms)
        ]
        candidates = []
        for cov, lp, old, adv, m in zip(covs, lps, olds, advs, ms):
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
        tokens = _StepTokens(candidates, process_group=process_group, reduce=reduce)
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
            tokens.values([part.view(m.shape) for part, m in zip(parts, ms)]),
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
            selection=_check_selection(self.selection, batch.mask),
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


@dataclass(frozen=True, kw_only=True)
class KLCov(Algorithm):
    """The unclipped surrogate, with κ·|δ| on the top-k covariance tokens (`kl_cov_loss`).

    The selection couples the tokens of one call (`couples_rows`), unless the step's is given
    (`selection`, from `step_selection`).
    """

    kl_cov_ratio: float = 2e-4
    """Fraction of the call's valid tokens that get the penalty; at least one does (verl `kl_cov_ratio`)."""
    ppo_kl_coef: float = 0.1
    """κ, the weight of |log r| on the selected tokens (verl `ppo_kl_coef`, config default 0.1)."""
    selection: Tensor | None = field(default=None, compare=False, repr=False)
    """The penalised tokens of this call, bool `[B, T]`: its part of the step's `step_selection`; None: the
    top-k of the call's own tokens (verl)."""

    couples_rows = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.kl_cov_ratio > 0, f"kl_cov_ratio must be > 0, got {self.kl_cov_ratio}")
        check(self.ppo_kl_coef >= 0, f"ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")

    def sequence_split_refusal(self) -> str | None:
        return SPLIT_SELECTION if self.selection is None else None

    def step_selection(
        self,
        log_probs: Tensor | Sequence[Tensor],
        advantages: Tensor | Sequence[Tensor],
        masks: Tensor | Sequence[Tensor],
        *,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
    ) -> list[Tensor]:
        """The step's penalised tokens, one bool `[B, T]` map per micro-batch: the k = max(⌊ratio·N⌋, 1)
        tokens of largest cov over the step (its means, its N valid tokens; every rank under
        torch.distributed: a collective). Pass each part to its call: `dataclasses.replace(algorithm,
        selection=part)`. `log_probs`: as for `ClipCov.step_selection`.
        """
        ms = [check_mask(m, m.shape, m.device) for m in per_micro_batch("masks", masks)]
        covs = step_covariance(log_probs, advantages, ms, process_group=process_group, reduce=reduce)
        tokens = _StepTokens(ms, process_group=process_group, reduce=reduce)
        values = gather_values(tokens.values(covs), process_group=process_group, reduce=reduce)
        if tokens.total == 0:
            return [torch.zeros_like(m) for m in ms]
        k = min(max(int(self.kl_cov_ratio * tokens.total), 1), tokens.total)
        return tokens.scatter(tokens.local(values.argsort(descending=True, stable=True)[:k]))  # ties: in order

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        loss, top = kl_cov_loss(
            ratio,
            batch.log_prob,
            delta,
            batch.advantages,
            batch.mask,
            cov_ratio=self.kl_cov_ratio,
            kl_coef=self.ppo_kl_coef,
            selection=_check_selection(self.selection, batch.mask),
        )
        metrics = ratio_metrics(ratio, delta, batch.mask)
        metrics["kl_cov_fraction"] = token_mean(top.to(ratio.dtype), batch.mask)
        metrics["ppo_kl_abs"] = token_mean(delta.abs(), batch.mask)
        return PolicyTerms(loss, metrics)
