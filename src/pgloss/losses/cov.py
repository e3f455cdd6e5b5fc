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
are picked. k stays a tensor, so the call runs on `meta` tensors and under `torch.compile`.

The selection is a function of the tokens of one call: the means, N and the draw couple every
token of the batch it is given. Split a step into micro-batches and each selects among its own
tokens, as in verl. Everything else (the surrogate, the aggregation) is split-invariant.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..base import Algorithm, PolicyTerms, _check
from ..batch import TokenBatch
from ..metrics import clip_metrics, masked_mean, ratio_metrics
from ..ratios import importance_ratio, log_ratio


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


def first_ranked(keys: Tensor, count: Tensor, *, descending: bool) -> Tensor:
    """Bool map (the shape of `keys`) of the `count` positions first in the order of `keys`, ties
    in row-major order; `count` a 0-d tensor, so no host sync."""
    flat = keys.reshape(-1)
    order = flat.argsort(descending=descending, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return (rank < count).view(keys.shape)


def draw_keys(shape: torch.Size, device: torch.device, generator: torch.Generator | None = None) -> Tensor:
    """U[0, 1) keys, float64, one per position: from `generator` on its own device (then moved,
    without waiting), or from the global generator of `device`."""
    if generator is None:
        return torch.rand(shape, dtype=torch.float64, device=device)
    keys = torch.rand(shape, dtype=torch.float64, device=generator.device, generator=generator)
    return keys.to(device, non_blocking=True)


def clip_cov_selection(candidates: Tensor, *, count: Tensor | int, generator: torch.Generator | None = None) -> Tensor:
    """The bool `[B, T]` map of `count` candidates drawn uniformly without replacement (all if fewer):
    the candidates of smallest key (`draw_keys`). With the same generator state, the same tokens.

    Args:
        candidates: bool `[B, T]`: valid, not clipped by PPO, and lb < cov < ub.
        count: k = `selection_size(clip_cov_ratio, mask)`.
        generator: the draw's `torch.Generator`; None uses the global one of the tensors' device.
    """
    keys = torch.where(candidates, draw_keys(candidates.shape, candidates.device, generator), 2.0)
    return candidates & first_ranked(keys, torch.as_tensor(count, device=candidates.device), descending=False)


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
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    by_clip = (clipped > unclipped) & mask
    cov = token_covariance(log_prob, advantages, mask)
    candidates = mask & ~by_clip & (cov > cov_lb) & (cov < cov_ub)
    k = selection_size(cov_ratio, mask)
    picked = clip_cov_selection(candidates, count=k, generator=generator)
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
    """
    surrogate = -advantages * ratio
    cov = torch.where(mask, token_covariance(log_prob, advantages, mask), -torch.inf)
    top = mask & first_ranked(cov, selection_size(cov_ratio, mask), descending=True)
    return torch.where(top, surrogate + kl_coef * token_log_ratio.abs(), surrogate), top


@dataclass(frozen=True, kw_only=True)
class ClipCov(Algorithm):
    """PPO's clipped surrogate with k random high-covariance tokens detached (`clip_cov_loss`).

    The draw uses `generator` (compared by identity, not value); pass a seeded `torch.Generator`
    to make the step reproducible. The selection couples the tokens of one call (`couples_rows`).
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

    couples_rows = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.clip_low >= 0, f"clip_low must be >= 0, got {self.clip_low}")
        _check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        _check(self.clip_cov_ratio > 0, f"clip_cov_ratio must be > 0, got {self.clip_cov_ratio}")
        _check(self.clip_cov_lb < self.clip_cov_ub,
               f"clip_cov_lb must be < clip_cov_ub, got {self.clip_cov_lb} and {self.clip_cov_ub}")
        if self.generator is not None and not isinstance(self.generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {type(self.generator).__name__}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, batch.mask, level="token",
                                 max_log_ratio=self.max_log_ratio)
        loss, picked, by_clip = clip_cov_loss(
            ratio, batch.log_prob, batch.advantages, batch.mask, clip_low=self.clip_low, clip_high=self.clip_high,
            cov_ratio=self.clip_cov_ratio, cov_lb=self.clip_cov_lb, cov_ub=self.clip_cov_ub, generator=self.generator,
        )
        positive = batch.advantages > 0
        metrics = clip_metrics(by_clip & positive, by_clip & ~positive, batch.mask)
        metrics["clip_cov_fraction"] = masked_mean(picked.to(ratio.dtype), batch.mask)
        metrics |= ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        return PolicyTerms(loss, metrics)


@dataclass(frozen=True, kw_only=True)
class KLCov(Algorithm):
    """The unclipped surrogate, with κ·|δ| on the top-k covariance tokens (`kl_cov_loss`).

    The selection couples the tokens of one call (`couples_rows`).
    """

    kl_cov_ratio: float = 2e-4
    """Fraction of the call's valid tokens that get the penalty; at least one does (verl `kl_cov_ratio`)."""
    ppo_kl_coef: float = 0.1
    """κ, the weight of |log r| on the selected tokens (verl `ppo_kl_coef`, config default 0.1)."""

    couples_rows = True

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.kl_cov_ratio > 0, f"kl_cov_ratio must be > 0, got {self.kl_cov_ratio}")
        _check(self.ppo_kl_coef >= 0, f"ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, batch.mask, level="token",
                                 max_log_ratio=self.max_log_ratio)
        loss, top = kl_cov_loss(ratio, batch.log_prob, delta, batch.advantages, batch.mask,
                                cov_ratio=self.kl_cov_ratio, kl_coef=self.ppo_kl_coef)
        metrics = ratio_metrics(ratio, delta, batch.mask)
        metrics["kl_cov_fraction"] = masked_mean(top.to(ratio.dtype), batch.mask)
        metrics["ppo_kl_abs"] = masked_mean(delta.abs(), batch.mask)
        return PolicyTerms(loss, metrics)
