"""REINFORCE on log π_θ: plain (GPG), with a truncated importance weight (TIS-PG), and tapered by
the sign of the reward (TOPR).

Per token (minimisation form), with r = π_θ/π_old and sg the stop-gradient:

    gpg     L = -A · log π_θ(y_t)
    tis_pg  L = -sg[clip(r, lo, hi)] · A · log π_θ(y_t)
    topr    L = -A · log π_θ(y_t)                            if score_i > 0
            L = -sg[clip(r, lo, hi)] · A · log π_θ(y_t)      otherwise

- GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
  Reasoning", https://arxiv.org/abs/2504.02546): verl `compute_policy_loss_gpg`
  (verl/trainer/ppo/core_algos.py); the same loss is verl's bypass-mode `reinforce`, ROLL's
  `vanilla` and NeMo-RL's `disable_ppo_ratio`. There is no ratio: the gradient is REINFORCE's
  -A·∇log π_θ whatever π_old, so the loss is only unbiased on-policy.
- TIS-PG: ROLL `_compute_tis_loss` (roll/pipeline/rlvr/actor_pg_worker.py), bounds
  `tis_lower_bound` = 0 and `tis_upper_bound` = 1: the off-policy gradient r·A·∇log π_θ with the
  weight truncated, so stale samples are down-weighted and never up-weighted.
- TOPR (Le Roux et al. 2025, "Tapered Off-Policy REINFORCE", https://arxiv.org/abs/2503.14286):
  ROLL `_compute_topr_loss`. Trajectories with a positive *raw score* (the reward, not the
  advantage) get the SFT-like update, the others the truncated-IS one; both weights w₊ = w₋ = 1.

At r = 1 (π_θ = π_old) all three give the REINFORCE gradient -A·∇log π_θ. Their values are not
those of a ratio loss: they depend on log π_θ itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from .closed_form import GradientFactor


def reinforce_loss(log_prob: Tensor, advantages: Tensor) -> Tensor:
    """GPG: -A · log π_θ per token, `[B, T]`."""
    return -advantages * log_prob


def truncated_weight(ratio: Tensor, *, low: float, high: float) -> Tensor:
    """sg[clip(r, low, high)], `[B, T]`."""
    return ratio.detach().clamp(low, high)


def tis_pg_loss(log_prob: Tensor, ratio: Tensor, advantages: Tensor, *, low: float, high: float) -> Tensor:
    """TIS-PG: -sg[clip(r, low, high)] · A · log π_θ per token, `[B, T]`."""
    return -truncated_weight(ratio, low=low, high=high) * advantages * log_prob


def topr_weight(ratio: Tensor, positive: Tensor, *, low: float, high: float) -> Tensor:
    """1 where `positive` (bool, `[B, 1]` or `[B, T]`: score > 0), else sg[clip(r, low, high)]; `[B, T]`."""
    return torch.where(positive, torch.ones_like(ratio), truncated_weight(ratio, low=low, high=high))


def topr_loss(
    log_prob: Tensor, ratio: Tensor, advantages: Tensor, positive: Tensor, *, low: float, high: float
) -> Tensor:
    """TOPR per token, `[B, T]`: REINFORCE where `positive` (bool, `[B, 1]` or `[B, T]`: score > 0),
    TIS-PG elsewhere."""
    return -topr_weight(ratio, positive, low=low, high=high) * advantages * log_prob


@dataclass(frozen=True, kw_only=True)
class GPG(Algorithm):
    """ℓ_{i,t} = -Â·log π_θ (`reinforce_loss`): REINFORCE, no ratio."""

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        return PolicyTerms(reinforce_loss(batch.log_prob, batch.advantages), ratio_metrics(ratio, delta, batch.mask))

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = 1: REINFORCE without a ratio."""
        return GradientFactor(torch.ones_like(batch.log_prob), "GPG: f = 1, REINFORCE without a ratio")


@dataclass(frozen=True, kw_only=True)
class TISPG(Algorithm):
    """ℓ_{i,t} = -sg[clip(r, lo, hi)]·Â·log π_θ (`tis_pg_loss`)."""

    tis_lower_bound: float = 0.0
    """lo, the truncated weight's lower bound (ROLL `tis_lower_bound`)."""
    tis_upper_bound: float = 1.0
    """hi, the truncated weight's upper bound (ROLL `tis_upper_bound`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            0 <= self.tis_lower_bound <= self.tis_upper_bound and self.tis_upper_bound > 0,
            f"tis bounds must satisfy 0 <= tis_lower_bound <= tis_upper_bound, tis_upper_bound > 0; got "
            f"{self.tis_lower_bound}, {self.tis_upper_bound}",
        )

    def weights(self, batch: TokenBatch, ratio: Tensor) -> Tensor:
        """The detached per-token weight of -Â·log π_θ (`truncated_weight`)."""
        return truncated_weight(ratio, low=self.tis_lower_bound, high=self.tis_upper_bound)

    def per_token(self, batch: TokenBatch, ratio: Tensor) -> Tensor:
        """ℓ_{i,t} (`tis_pg_loss`)."""
        return tis_pg_loss(batch.log_prob, ratio, batch.advantages, low=self.tis_lower_bound, high=self.tis_upper_bound)

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        weight = self.weights(batch, ratio)
        metrics = ratio_metrics(ratio, delta, batch.mask)
        metrics["is_weight_mean"] = token_mean(weight, batch.mask)
        metrics["is_truncated_fraction"] = token_mean((weight != ratio.detach()).to(ratio.dtype), batch.mask)
        return PolicyTerms(self.per_token(batch, ratio), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = the detached weight (`weights`)."""
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        return GradientFactor(self.weights(batch, ratio), f"{type(self).__name__}: f = the detached truncated weight")


@dataclass(frozen=True, kw_only=True)
class TOPR(TISPG):
    """REINFORCE on sequences whose raw score is > 0, TIS-PG on the others (`topr_loss`).

    Needs `scores`, the `[B]` raw rewards, in the call: the split is on the score, not on Â.
    """

    required_inputs = ("scores",)

    def _positive(self, batch: TokenBatch) -> Tensor:
        if batch.scores is None:
            raise ValueError(f"{self.name} splits on the raw reward and needs scores=[B] in the call")
        return (batch.scores > 0)[:, None]

    def weights(self, batch: TokenBatch, ratio: Tensor) -> Tensor:
        """1 on rows whose score is > 0, the truncated weight elsewhere (`topr_weight`)."""
        return topr_weight(ratio, self._positive(batch), low=self.tis_lower_bound, high=self.tis_upper_bound)

    def per_token(self, batch: TokenBatch, ratio: Tensor) -> Tensor:
        """ℓ_{i,t} (`topr_loss`)."""
        return topr_loss(
            batch.log_prob,
            ratio,
            batch.advantages,
            self._positive(batch),
            low=self.tis_lower_bound,
            high=self.tis_upper_bound,
        )
