"""KL estimators on sampled tokens, KL in the reward, and the KL coefficient controllers.

With d = log π_θ(y) - log π_ref(y) for y ~ π_θ (Schulman, "Approximating KL divergence", 2020,
http://joschu.net/blog/kl-approx.html):

    k1   d                          unbiased, high variance, can be negative
    abs  |d|
    k2   ½ d²                       biased, low variance
    k3   e^{-d} - (-d) - 1          unbiased and ≥ 0 (verl's `low_var_kl`, GRPO's D_KL)

k3 is unbiased: E_{π_θ}[π_ref/π_θ] = Σ_y π_ref(y) = 1, so E[e^{-d} + d - 1] = E[d] = KL(π_θ‖π_ref).
For stability (as verl and TRL) -d is clamped to [-max_log_ratio, max_log_ratio] before `exp`
and k3 to [-max_kl, max_kl] after; beyond those bounds the gradient is zero.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import check_mask, check_tensor
from ..core.checks import check_number

KL_ESTIMATORS = ("k1", "abs", "k2", "k3")


def kl_estimate(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    estimator: str = "k3",
    *,
    max_log_ratio: float = 20.0,
    max_kl: float = 10.0,
) -> Tensor:
    """Per-token estimate of KL(π_θ ‖ π_ref) from sampled-token log-probabilities; `[B, T]`."""
    d = log_prob - ref_log_prob
    if estimator == "k1":
        return d
    if estimator == "abs":
        return d.abs()
    if estimator == "k2":
        return 0.5 * d.square()
    if estimator == "k3":
        neg = (-d).clamp(-max_log_ratio, max_log_ratio)
        return (torch.exp(neg) - neg - 1.0).clamp(-max_kl, max_kl)
    raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def kl_penalized_rewards(
    token_rewards: Tensor,
    old_log_prob: Tensor,
    ref_log_prob: Tensor,
    mask: Tensor,
    *,
    kl_coef: float,
    estimator: str = "k1",
) -> tuple[Tensor, Tensor]:
    """KL in the reward (PPO for RLHF; verl's `apply_kl_penalty`; the loss blog post of 2025-10-21):

        r_t ← r_t - β · KL_t(π_old ‖ π_ref) · m_t

    Returns the penalised token rewards and the masked per-token KL, both `[B, T]`. Masked
    positions keep their reward unchanged and get KL 0.
    """
    token_rewards = check_tensor("token_rewards", token_rewards, ndim=(2,))
    for name, value in (("old_log_prob", old_log_prob), ("ref_log_prob", ref_log_prob)):
        value = check_tensor(name, value, ndim=(2,))
        if value.shape != token_rewards.shape:
            raise ValueError(
                f"{name} must have the shape of token_rewards {tuple(token_rewards.shape)}, got {tuple(value.shape)}"
            )
    mask = check_mask(mask, token_rewards.shape, token_rewards.device)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    kl = torch.where(mask, kl_estimate(old_log_prob.detach(), ref_log_prob.detach(), estimator), 0.0)
    return token_rewards - kl_coef * kl, kl


@dataclass
class FixedKLController:
    """A constant β."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """A fixed coefficient ignores the observed KL."""


@dataclass
class AdaptiveKLController:
    """β adapted towards a target KL (Ziegler et al. 2019, https://arxiv.org/abs/1909.08593):

    e = clip(KL / KL_target - 1, -0.2, 0.2),    β ← β · (1 + e · n_steps / horizon)
    """

    value: float
    target: float
    horizon: float

    def __post_init__(self) -> None:
        for name in ("value", "target", "horizon"):
            check_number(name, getattr(self, name))
        if not (self.value >= 0 and self.target > 0 and self.horizon > 0):
            raise ValueError(
                f"AdaptiveKLController needs value >= 0, target > 0, horizon > 0; got "
                f"value={self.value}, target={self.target}, horizon={self.horizon}"
            )

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β after observing `current_kl` over `n_steps` samples.

        A non-finite KL (a NaN from an empty batch, say) is refused rather than turning β into NaN."""
        check_number("current_kl", current_kl)
        if isinstance(n_steps, bool) or not isinstance(n_steps, numbers.Integral) or n_steps < 0:
            raise ValueError(f"n_steps must be an integer >= 0, got {n_steps!r}")
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
