"""VESPO: REINFORCE scaled by a gamma-shaped weight of the sequence importance ratio
(Variational Sequence-Level Soft Policy Optimization, Shen et al. 2026, https://arxiv.org/abs/2602.10693;
TRL `loss_type="vespo"`).

With the whole-sequence log-ratio S_i = Σ_t m_t clip(δ_t, -20, 20), δ = log π_θ - log π_old:

    log w_i = clip(S_i, log 1e-8, 20),    w_i = exp(log w_i)
    φ(w)    = exp( λ + k·log w - λ·w ) = e^λ · w^k · e^{-λw}         (φ(1) = 1)
    (k, λ)  = (k_pos, λ_pos) if A ≥ 0 else (k_neg, λ_neg),   λ clamped at 1e-4
    L_t     = -sg[φ(w_i)] · A_t · log π_θ(y_t)

φ peaks at w = k/λ and vanishes for w → 0 and w → ∞, so sequences that drifted far from π_old
are faded out rather than clipped. A non-finite φ is set to 0. Defaults (TRL `GRPOConfig`):
k_pos = 2, λ_pos = 3, k_neg = 3, λ_neg = 2; aggregated like DAPO (token-mean).

The rollout engine's log-probs. The paper's w is the sequence ratio against the policy that
sampled, π_θ(y_i)/μ(y_i): with `rollout_log_prob`, each token's ρ_t = π_old/π_rollout joins the
sum, S_i += Σ_t m_t clip(log ρ_t, log 1e-8, 20), and the loss is not multiplied by a rollout weight
again. `vespo_rollout_mode` says what is folded:

    "raw"       log ρ_t itself: w_i = π_θ(y_i)/π_rollout(y_i) (the paper; the default)
    "truncate"  log clip(ρ_t, clip_min, clip_max)           (TRL `vllm_importance_sampling_mode="token_truncate"`)
    "mask"      log ρ_t inside [clip_min, clip_max], log 1e-8 outside   (TRL "token_mask": ρ_t set to 0)

with clip_min, clip_max = `vespo_rollout_clip_min`, `vespo_rollout_clip_max` (TRL's
`vllm_importance_sampling_clip_min`/`_max`, default None and 3). The authors' verl recipe folds
whatever rollout weights verl hands it (truncated when verl's rollout correction truncates).
The conventions agree where every ρ_t lies inside the bounds; docs/reference.md gives their
measured difference.

Reference: TRL `GRPOTrainer.get_gamma_weights` and `_compute_loss` (trl/trainer/grpo_trainer.py);
Liger `get_gamma_weights` (liger_kernel/chunked_loss/grpo_loss.py); the authors'
`compute_policy_loss_vespo` (FloyedShen/VESPO, recipe/vespo/code/core_algos.py).

At r = 1, w = 1 and φ = 1: the gradient is REINFORCE's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from ..core.sequence_parallel import SequenceParallel, row_sum
from .closed_form import GradientFactor

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
    sequence_parallel: SequenceParallel | None = None,
) -> Tensor:
    """sg[φ(w_i)] with (k, λ) chosen by the sign of A_t, `[B, T]` (constant along a row when A is).

    Args:
        token_log_ratio: δ, `[B, T]`, finite at masked positions.
        advantages: A, `[B, T]`.
        mask: bool `[B, T]`.
        k_pos, lambda_pos, k_neg, lambda_neg: the gamma shape for A ≥ 0 and A < 0.
        rollout_log_ratio: log(π_old/π_rollout) `[B, T]` to add to S_i, or None.
        sequence_parallel: the sequence group of split rows (S_i sums the whole sequence).
    """
    with torch.no_grad():
        m = mask.to(token_log_ratio.dtype)
        log_w = token_log_ratio.clamp(-20.0, 20.0) * m
        if rollout_log_ratio is not None:
            log_w = log_w + rollout_log_ratio.clamp(_LOG_MIN_WEIGHT, 20.0) * m
        seq = row_sum(log_w, sequence_parallel, keepdim=True)
        log_w = seq.clamp(_LOG_MIN_WEIGHT, 20.0)
        nonneg = advantages >= 0
        k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)
        lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


VESPO_ROLLOUT_MODES = ("raw", "truncate", "mask")


def rollout_log_weight(
    rollout_log_ratio: Tensor, *, mode: str, clip_min: float | None = None, clip_max: float | None = None
) -> Tensor:
    """The per-token log-weight VESPO folds into S_i, from log ρ_t = log(π_old/π_rollout), `[B, T]`:
    log ρ_t ("raw"), log clip(ρ_t, clip_min, clip_max) ("truncate") or log ρ_t inside the bounds and
    log 1e-8 outside ("mask"); a bound that is None is absent."""
    if mode not in VESPO_ROLLOUT_MODES:
        raise ValueError(f"vespo_rollout_mode must be one of {VESPO_ROLLOUT_MODES}, got {mode!r}")
    if mode == "raw":
        return rollout_log_ratio
    low = None if clip_min is None else math.log(clip_min)
    high = None if clip_max is None else math.log(clip_max)
    if mode == "truncate":
        return rollout_log_ratio.clamp(min=low, max=high)
    outside = torch.zeros_like(rollout_log_ratio, dtype=torch.bool)
    if low is not None:
        outside = outside | (rollout_log_ratio < low)
    if high is not None:
        outside = outside | (rollout_log_ratio > high)
    return torch.where(outside, _LOG_MIN_WEIGHT, rollout_log_ratio)


def vespo_loss(log_prob: Tensor, phi: Tensor, advantages: Tensor) -> Tensor:
    """-sg[φ] · A · log π_θ per token, `[B, T]`."""
    return -phi.detach() * advantages * log_prob


@dataclass(frozen=True, kw_only=True)
class VESPO(Algorithm):
    """ℓ_{i,t} = -sg[φ(w_i)]·Â·log π_θ (`vespo_phi`, `vespo_loss`).

    With `rollout_log_prob`, log(π_old/π_rollout) enters w_i (the paper's ratio against the sampling
    policy, or TRL's bounded one: `vespo_rollout_mode`) and the loss is not multiplied by a rollout
    weight again (`consumes_rollout_log_prob`).
    """

    vespo_k_pos: float = 2.0
    """k for Â ≥ 0 (TRL `vespo_k_pos`)."""
    vespo_lambda_pos: float = 3.0
    """λ for Â ≥ 0 (TRL `vespo_lambda_pos`)."""
    vespo_k_neg: float = 3.0
    """k for Â < 0 (TRL `vespo_k_neg`)."""
    vespo_lambda_neg: float = 2.0
    """λ for Â < 0 (TRL `vespo_lambda_neg`)."""
    vespo_rollout_mode: str = "raw"
    """What of ρ_t = π_old/π_rollout enters w_i: "raw" (the paper), "truncate" or "mask" (TRL's token_truncate,
    token_mask, with `vespo_rollout_clip_min`/`_max`); see the module docstring."""
    vespo_rollout_clip_min: float | None = None
    """The lower bound of ρ_t for "truncate"/"mask" (TRL `vllm_importance_sampling_clip_min`); None: none."""
    vespo_rollout_clip_max: float | None = None
    """The upper bound of ρ_t for "truncate"/"mask" (TRL `vllm_importance_sampling_clip_max`, 3 there); None: none."""

    consumes_rollout_log_prob = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        check(
            self.vespo_rollout_mode in VESPO_ROLLOUT_MODES,
            f"vespo_rollout_mode must be one of {VESPO_ROLLOUT_MODES}, got {self.vespo_rollout_mode!r}",
        )
        low, high = self.vespo_rollout_clip_min, self.vespo_rollout_clip_max
        if self.vespo_rollout_mode == "raw":
            check(
                low is None and high is None,
                f"vespo_rollout_mode='raw' folds the unbounded ratio and takes no bounds; got "
                f"vespo_rollout_clip_min={low}, vespo_rollout_clip_max={high} (use 'truncate' or 'mask')",
            )
        else:
            check(
                low is not None or high is not None,
                f"vespo_rollout_mode={self.vespo_rollout_mode!r} needs vespo_rollout_clip_min or "
                f"vespo_rollout_clip_max (TRL's default cap is 3.0)",
            )
            check(low is None or low > 0, f"vespo_rollout_clip_min must be > 0 or None, got {low}")
            check(high is None or high > 0, f"vespo_rollout_clip_max must be > 0 or None, got {high}")
            check(
                low is None or high is None or low <= high,
                f"vespo_rollout_clip_min must be <= vespo_rollout_clip_max, got {low} and {high}",
            )

    def phi(self, batch: TokenBatch) -> Tensor:
        """sg[φ(w_i)], `[B, T]`, with the rollout log-weight folded into w_i when the call has rollout log-probs."""
        rollout = None
        if batch.rollout_log_prob is not None:
            rollout = rollout_log_weight(
                batch.old_log_prob - batch.rollout_log_prob,
                mode=self.vespo_rollout_mode,
                clip_min=self.vespo_rollout_clip_min,
                clip_max=self.vespo_rollout_clip_max,
            )
        return vespo_phi(
            log_ratio(batch.log_prob, batch.old_log_prob),
            batch.advantages,
            batch.mask,
            k_pos=self.vespo_k_pos,
            lambda_pos=self.vespo_lambda_pos,
            k_neg=self.vespo_k_neg,
            lambda_neg=self.vespo_lambda_neg,
            rollout_log_ratio=rollout,
            sequence_parallel=batch.sequence_parallel,
        )

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        phi = self.phi(batch)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        metrics = ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        metrics["vespo_phi_mean"] = token_mean(phi, batch.mask)
        return PolicyTerms(vespo_loss(batch.log_prob, phi, batch.advantages), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = sg[φ(w_i)], a detached weight."""
        return GradientFactor(self.phi(batch), "VESPO: f = sg[φ(w_i)], a detached weight")
