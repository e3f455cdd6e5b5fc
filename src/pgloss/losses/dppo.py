"""DPPO-Binary-TV and DPPO-Binary-KL: a trust region on the probability of the sampled token
instead of on the ratio ("Divergence Proximal Policy Optimization", https://arxiv.org/abs/2602.04879).

With p = π_θ(y_t), p_old = π_old(y_t), r = p/p_old and the truncated, detached weight
r̃ = sg[min(r, c)], per token (minimisation form):

    L = -A · r̃ · log π_θ(y_t) · sg[valid_t]

A token leaves the trust region (valid = 0, no gradient) only when it moves in the direction its
advantage pushes it, further than the threshold:

    TV:   valid = (p - p_old ≤ ε_high)               if A > 0
          valid = (p - p_old ≥ -ε_low)               otherwise
    KL:   D = p_old·log(p_old/p) + (1 - p_old)·log((1 - p_old + 1e-8)/(1 - p + 1e-8))
          valid = (D ≤ ε_high) or (p ≤ p_old)        if A > 0
          valid = (D ≤ ε_low) or (p ≥ p_old)         otherwise

D is the KL divergence between the two Bernoulli distributions "sample y_t or not". Here ε_low and
ε_high are divergence thresholds, not ratio widths (verl reads them from `clip_ratio_low/high`,
default 0.2).

Reference: verl `compute_policy_loss_dppo_tv`, `compute_policy_loss_dppo_kl`
(verl/trainer/ppo/core_algos.py). The truncation c: verl's code reads `config.get("clip_ratio_c", 20.0)`,
but its `ActorConfig` defines `clip_ratio_c = 3.0`, so a verl run truncates at c = 3.0 unless the
user sets it; that is our default. The paper (sec. 5.4, quoted in verl's comment) recommends a
large c, to limit the truncation's bias. log r is clamped to ±20 before exp, as verl.
prime-rl's `default_loss_fn` applies the same TV mask against the inference policy, with c = ∞.

Metrics as verl: pg_clipfrac = mean(1 - valid), pg_clipfrac_lower = mean(valid and r > c).
At r = 1 every token is valid and r̃ = 1: the gradient is REINFORCE's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import clip_metrics, ratio_metrics
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from .closed_form import GradientFactor

DPPO_DIVERGENCES = ("tv", "kl")


def dppo_valid(
    log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, *, divergence: str, clip_low: float, clip_high: float
) -> Tensor:
    """The bool `[B, T]` trust-region mask of DPPO-Binary-TV (`divergence="tv"`) or -KL (`"kl"`)."""
    with torch.no_grad():
        p, p_old = torch.exp(log_prob), torch.exp(old_log_prob)
        positive = advantages > 0
        if divergence == "tv":
            return torch.where(positive, p - p_old <= clip_high, p - p_old >= -clip_low)
        if divergence == "kl":
            binary_kl = p_old * (old_log_prob - log_prob) + (1 - p_old) * torch.log((1 - p_old + 1e-8) / (1 - p + 1e-8))
            return torch.where(
                positive, (binary_kl <= clip_high) | (p <= p_old), (binary_kl <= clip_low) | (p >= p_old)
            )
    raise ValueError(f"divergence must be one of {DPPO_DIVERGENCES}, got {divergence!r}")


def dppo_weight(ratio: Tensor, valid: Tensor, *, truncation: float) -> Tensor:
    """sg[min(r, c)] · sg[valid], the detached weight of -A·log π_θ, `[B, T]`."""
    return ratio.detach().clamp(max=truncation) * valid.to(ratio.dtype)


def dppo_loss(log_prob: Tensor, ratio: Tensor, advantages: Tensor, valid: Tensor, *, truncation: float) -> Tensor:
    """-A · sg[min(r, c)] · log π_θ · sg[valid] per token, `[B, T]`."""
    return -advantages * dppo_weight(ratio, valid, truncation=truncation) * log_prob


@dataclass(frozen=True, kw_only=True)
class DPPO(Algorithm):
    """ℓ_{i,t} = -Â·sg[min(r, c)]·log π_θ·sg[valid] (`dppo_loss`, `dppo_valid`)."""

    divergence: str = "tv"
    """The trust region: "tv" (DPPO-Binary-TV) or "kl" (DPPO-Binary-KL)."""
    clip_low: float = 0.2
    """ε_low, the divergence threshold for Â ≤ 0 (verl `clip_ratio_low`)."""
    clip_high: float = 0.2
    """ε_high, the divergence threshold for Â > 0 (verl `clip_ratio_high`)."""
    truncation: float = 3.0
    """c, the cap of the detached ratio weight (verl `clip_ratio_c`, 3.0 in its ActorConfig)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.divergence in DPPO_DIVERGENCES,
            f"divergence must be one of {DPPO_DIVERGENCES}, got {self.divergence!r}",
        )
        check(self.clip_low >= 0, f"clip_low must be >= 0, got {self.clip_low}")
        check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        check(self.truncation > 0, f"truncation must be > 0, got {self.truncation}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        valid = dppo_valid(
            batch.log_prob,
            batch.old_log_prob,
            batch.advantages,
            divergence=self.divergence,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
        )
        # Outside the region: pushed up too far (Â > 0: "high") or down too far ("low"); as verl,
        # pg_clipfrac_lower is the share of valid tokens whose weight the truncation c capped.
        positive = batch.advantages > 0
        metrics = clip_metrics(
            ~valid & positive, ~valid & ~positive, batch.mask, valid & (ratio.detach() > self.truncation)
        )
        metrics |= ratio_metrics(ratio, delta, batch.mask)
        return PolicyTerms(
            dppo_loss(batch.log_prob, ratio, batch.advantages, valid, truncation=self.truncation), metrics
        )

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = sg[min(r, c)]·sg[valid] (`dppo_weight`)."""
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        valid = dppo_valid(
            batch.log_prob,
            batch.old_log_prob,
            batch.advantages,
            divergence=self.divergence,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
        )
        return GradientFactor(
            dppo_weight(ratio, valid, truncation=self.truncation),
            "DPPO: f = sg[min(r, c)]·sg[valid], a detached weight",
        )
