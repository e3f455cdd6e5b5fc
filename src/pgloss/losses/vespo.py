"""VESPO: REINFORCE scaled by a gamma-shaped weight of the sequence importance ratio
(Variance-Reduced Sequence-level Policy Optimization; TRL `loss_type="vespo"`).

With the whole-sequence log-ratio S_i = Σ_t m_t clip(δ_t, -20, 20), δ = log π_θ - log π_old:

    log w_i = clip(S_i, log 1e-8, 20),    w_i = exp(log w_i)
    φ(w)    = exp( λ + k·log w - λ·w ) = e^λ · w^k · e^{-λw}         (φ(1) = 1)
    (k, λ)  = (k_pos, λ_pos) if A ≥ 0 else (k_neg, λ_neg),   λ clamped at 1e-4
    L_t     = -sg[φ(w_i)] · A_t · log π_θ(y_t)

φ peaks at w = k/λ and vanishes for w → 0 and w → ∞, so sequences that drifted far from π_old
are faded out rather than clipped. A non-finite φ is set to 0. Defaults (TRL `GRPOConfig`):
k_pos = 2, λ_pos = 3, k_neg = 3, λ_neg = 2; aggregated like DAPO (token-mean).

Reference: TRL `GRPOTrainer.get_gamma_weights` and `_compute_loss` (trl/trainer/grpo_trainer.py);
Liger `get_gamma_weights` (liger_kernel/chunked_loss/grpo_loss.py). With a rollout-engine
correction TRL adds Σ_t clip(log(π_old/π_rollout), log 1e-8, 20) to S_i and does not multiply the
loss by the rollout weight again: `rollout_log_ratio` below.

At r = 1, w = 1 and φ = 1: the gradient is REINFORCE's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm, PolicyTerms, _check
from ..batch import TokenBatch
from ..metrics import masked_mean, ratio_metrics
from ..ratios import importance_ratio, log_ratio

_LOG_MIN_WEIGHT = math.log(1e-8)


def vespo_phi(
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    k_pos: float,
    lambda_pos: float,
    k_neg: float,
    lambda_neg: float,
    rollout_log_ratio: Tensor | None = None,
) -> Tensor:
    """sg[φ(w_i)] with (k, λ) chosen by the sign of A_t, `[B, T]` (constant along a row when A is).

    Args:
        token_log_ratio: δ, `[B, T]`, finite at masked positions.
        advantages: A, `[B, T]`.
        mask: bool `[B, T]`.
        k_pos, lambda_pos, k_neg, lambda_neg: the gamma shape for A ≥ 0 and A < 0.
        rollout_log_ratio: log(π_old/π_rollout) `[B, T]` to add to S_i, or None.
    """
    with torch.no_grad():
        m = mask.to(token_log_ratio.dtype)
        seq = (token_log_ratio.clamp(-20.0, 20.0) * m).sum(dim=-1, keepdim=True)
        if rollout_log_ratio is not None:
            seq = seq + (rollout_log_ratio.clamp(_LOG_MIN_WEIGHT, 20.0) * m).sum(dim=-1, keepdim=True)
        log_w = seq.clamp(_LOG_MIN_WEIGHT, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def vespo_loss(log_prob: Tensor, phi: Tensor, advantages: Tensor) -> Tensor:
    """-sg[φ] · A · log π_θ per token, `[B, T]`."""
    return -phi.detach() * advantages * log_prob


@dataclass(frozen=True, kw_only=True)
class VESPO(Algorithm):
    """ℓ_{i,t} = -sg[φ(w_i)]·Â·log π_θ (`vespo_phi`, `vespo_loss`).

    With `rollout_log_prob`, log(π_old/π_rollout) enters w_i (as TRL) and the loss is not multiplied
    by the truncated rollout weight again (`consumes_rollout_log_prob`).
    """

    vespo_k_pos: float = 2.0
    """k for Â ≥ 0 (TRL `vespo_k_pos`)."""
    vespo_lambda_pos: float = 3.0
    """λ for Â ≥ 0 (TRL `vespo_lambda_pos`)."""
    vespo_k_neg: float = 3.0
    """k for Â < 0 (TRL `vespo_k_neg`)."""
    vespo_lambda_neg: float = 2.0
    """λ for Â < 0 (TRL `vespo_lambda_neg`)."""

    consumes_rollout_log_prob = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        rollout = None if batch.rollout_log_prob is None else batch.old_log_prob - batch.rollout_log_prob
        phi = vespo_phi(delta, batch.advantages, batch.mask, k_pos=self.vespo_k_pos,
                        lambda_pos=self.vespo_lambda_pos, k_neg=self.vespo_k_neg, lambda_neg=self.vespo_lambda_neg,
                        rollout_log_ratio=rollout)
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, batch.mask, level="token",
                                 max_log_ratio=self.max_log_ratio)
        metrics = ratio_metrics(ratio, delta, batch.mask)
        metrics["vespo_phi_mean"] = masked_mean(phi, batch.mask)
        return PolicyTerms(vespo_loss(batch.log_prob, phi, batch.advantages), metrics)
