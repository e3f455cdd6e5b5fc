"""The KL term's gradient corrections: one estimator's value with another gradient.

With d = log π_θ(y) - log π_ref(y), y sampled from π_old, r = π_θ(y)/π_old(y), k_X one of the
estimators of `pgloss.kl.estimators` and k2 = ½d², whose gradient d·∇log π_θ is the score-function gradient
of KL(π_θ‖π_ref) on a sample from π_θ:

    straight_through   sg[k_X] + k2 - sg[k2]                   value k_X, gradient d·∇log π_θ
                       (verl's "k1+", "k3+", ...: `kl_penalty` in verl/trainer/ppo/core_algos.py)
    ratio_weighted     k_X · r, r differentiable               value and gradient weighted by r
                       (TRL `use_bias_correction_kl` with token ratios, trl/trainer/grpo_trainer.py;
                       Liger ×exp(log_importance_weights); slime `--use-unbiased-kl`)
    ratio_clamped      k_X · min(r, cap), r differentiable       value and gradient weighted by r capped
                       (no gradient through r where r > cap)
                       (Trinity-RFT `corrected_k3`: k3, r clamped to [0, 2], trinity/algorithm/kl_fn/kl_fn.py)
    unbiased_gradient  sg[k_X] + w·k2 - sg[w·k2],  w = sg[min(r, cap)], cap 10
                       value k_X, gradient w·d·∇log π_θ
                       (OpenRLHF `compute_approx_kl(..., unbiased_gradient)`, openrlhf/models/utils.py)

Why: k1 and k3 have the right expected value but not the right expected gradient (∇k3 =
(1 - π_ref/π_θ)·∇log π_θ), so the KL the optimiser follows is not the one reported. k2's gradient
is the right one on-policy; off-policy the samples come from π_old and r re-weights them.
TRL's form also re-weights the reported value; OpenRLHF's keeps the value and re-weights only the
gradient, with the weight capped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .estimators import KL_ESTIMATORS, kl_estimate

KL_CORRECTIONS = ("ratio_weighted", "ratio_clamped", "unbiased_gradient")
STRAIGHT_THROUGH = tuple(f"{name}+" for name in KL_ESTIMATORS)
"""verl's suffix: "k3+" is k3's value with k2's gradient."""
FULL = "full"
"""The exact KL over the vocabulary (`pgloss.vocab.full_kl`), passed to an algorithm as `full_kl=`."""
KL_OPTIONS = KL_ESTIMATORS + STRAIGHT_THROUGH + (FULL,)


def straight_through(value: Tensor, log_prob: Tensor, ref_log_prob: Tensor, weight: Tensor | None = None) -> Tensor:
    """sg[value] + w·½d² - sg[w·½d²] (w = 1 when `weight` is None), `[B, T]`."""
    k2 = 0.5 * (log_prob - ref_log_prob).square()
    if weight is not None:
        k2 = weight.detach() * k2
    return value.detach() + (k2 - k2.detach())


def ratio_weighted(value: Tensor, token_log_ratio: Tensor, *, max_log_ratio: float) -> Tensor:
    """k · r with r = exp(clip(log r, ±max_log_ratio)) differentiable, `[B, T]`."""
    return value * torch.exp(token_log_ratio.clamp(-max_log_ratio, max_log_ratio))


def ratio_clamped(value: Tensor, token_log_ratio: Tensor, *, cap: float, max_log_ratio: float) -> Tensor:
    """k · min(r, cap) with r = exp(clip(log r, ±max_log_ratio)) differentiable below the cap, `[B, T]`."""
    return value * torch.exp(token_log_ratio.clamp(-max_log_ratio, max_log_ratio)).clamp(max=cap)


def unbiased_gradient(
    value: Tensor, log_prob: Tensor, ref_log_prob: Tensor, token_log_ratio: Tensor, *, cap: float, max_log_ratio: float
) -> Tensor:
    """sg[k] + w·½d² - sg[w·½d²], w = sg[min(r, cap)], `[B, T]`."""
    weight = torch.exp(token_log_ratio.detach().clamp(-max_log_ratio, max_log_ratio)).clamp(max=cap)
    return straight_through(value, log_prob, ref_log_prob, weight)


def kl_term(
    log_prob: Tensor,
    ref_log_prob: Tensor,
    old_log_prob: Tensor,
    *,
    estimator: str,
    correction: str | None = None,
    correction_cap: float = 10.0,
    max_log_ratio: float = 20.0,
    max_kl: float = 10.0,
) -> Tensor:
    """The per-token KL term an algorithm adds: `estimator` (k1, abs, k2, k3 or their "+" forms)
    with an optional `correction` ("ratio_weighted" or "unbiased_gradient"), `[B, T]`.

    The sampled-token value is `pgloss.kl.kl_estimate` with its clamps; "+" swaps in k2's gradient;
    the correction then re-weights by r = π_θ/π_old (see the module docstring).
    """
    base = estimator[:-1] if estimator in STRAIGHT_THROUGH else estimator
    value = kl_estimate(log_prob, ref_log_prob, base, max_log_ratio=max_log_ratio, max_kl=max_kl)
    if estimator in STRAIGHT_THROUGH:
        value = straight_through(value, log_prob, ref_log_prob)
    token_log_ratio = log_prob - old_log_prob
    if correction == "ratio_weighted":
        return ratio_weighted(value, token_log_ratio, max_log_ratio=max_log_ratio)
    if correction == "ratio_clamped":
        return ratio_clamped(value, token_log_ratio, cap=correction_cap, max_log_ratio=max_log_ratio)
    if correction == "unbiased_gradient":
        return unbiased_gradient(
            value, log_prob, ref_log_prob, token_log_ratio, cap=correction_cap, max_log_ratio=max_log_ratio
        )
    if correction is not None:
        raise ValueError(f"kl_correction must be None or one of {KL_CORRECTIONS}, got {correction!r}")
    return value
