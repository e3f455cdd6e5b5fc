"""SAPO: a soft, sign-dependent gate instead of a hard clip (Gao et al. 2025, https://arxiv.org/abs/2511.20347).

Per token (minimisation form):

    L = -f_τ(r) · A,     f_τ(r) = (4/τ) · σ(τ·(r - 1)),     τ = τ_pos if A > 0 else τ_neg

The factor 4/τ makes the on-policy gradient REINFORCE's: d f_τ / d r = 4·σ(1-σ) = 1 at r = 1, so
∇L = -A·∇log π_θ when π_θ = π_old, whatever τ. Away from r = 1 the gradient weight
4·σ(τ(r-1))·(1-σ(τ(r-1)))·r decays smoothly instead of dropping to zero as in PPO.
ms-swift's Loss Types documentation writes the gate as σ(τ(ρ-1)) without 4/τ; that scales the on-policy gradient by τ/4.
A larger τ_neg (paper: 1.05 vs 1.0) attenuates negative-advantage updates faster.
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


def sapo_gate(ratio: Tensor, advantages: Tensor, *, tau_pos: float, tau_neg: float) -> Tensor:
    """f_τ(r) = (4/τ)·σ(τ(r-1)) with τ chosen by the sign of A; `[B, T]`."""
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    return torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)


def sapo_loss(ratio: Tensor, advantages: Tensor, *, tau_pos: float, tau_neg: float) -> tuple[Tensor, Tensor]:
    """(ℓ = -f_τ(r)·A per token, the gate f_τ(r)), both `[B, T]`."""
    gate = sapo_gate(ratio, advantages, tau_pos=tau_pos, tau_neg=tau_neg)
    return -gate * advantages, gate


def sapo_slope(ratio: Tensor, advantages: Tensor, *, tau_pos: float, tau_neg: float) -> Tensor:
    """d f_τ/d r = 4·σ(τ(r-1))·(1 - σ(τ(r-1))), the gate's slope (1 at r = 1); `[B, T]`."""
    tau = torch.full_like(advantages, tau_neg).masked_fill(advantages > 0, tau_pos)
    sigma = torch.sigmoid(tau * (ratio - 1.0))
    return 4.0 * sigma * (1.0 - sigma)


@dataclass(frozen=True, kw_only=True)
class SAPO(Algorithm):
    """ℓ_{i,t} = -(4/τ)·σ(τ(r - 1))·Â, τ = τ_pos for Â > 0 else τ_neg (`sapo_loss`)."""

    tau_pos: float = 1.0
    """Gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """Gate temperature for negative advantages."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.tau_pos > 0 and self.tau_neg > 0,
            f"tau_pos and tau_neg must be > 0, got {self.tau_pos}, {self.tau_neg}",
        )

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        loss, gate = sapo_loss(ratio, batch.advantages, tau_pos=self.tau_pos, tau_neg=self.tau_neg)
        metrics = ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        metrics["sapo_gate_mean"] = token_mean(gate, batch.mask)
        return PolicyTerms(loss, metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = f_τ'(r)·r = 4σ(1-σ)·r where |log r| ≤ max_log_ratio (0 beyond, where r is clamped)."""
        token_log_ratio = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        slope = sapo_slope(ratio, batch.advantages, tau_pos=self.tau_pos, tau_neg=self.tau_neg)
        inside = (token_log_ratio.abs() <= self.max_log_ratio).to(ratio.dtype)
        return GradientFactor(slope * ratio * inside, "SAPO: f = 4σ(1-σ)·r, the soft gate's slope")
