"""AReaL's proximal approximation (AReaL 1.0.4 `areal/trainer/ppo/actor.py`,
`compute_prox_logp_approximations`, `prox_logp_method="loglinear"`): decoupled PPO without the
pass that recomputes the proximal policy's log-probabilities.

Decoupled PPO (Hilton et al. 2022, arXiv 2110.00641; see `pgloss.m2po`) clips the ratio against a
proximal policy π_prox, the policy one update behind the current one (version v_θ - 1), and weights
by π_prox/π_behave. AReaL approximates log π_prox per token from the policy version v_b that sampled
the token and the current version v_θ, with no forward pass:

    α_t = clip((v_θ - 1 - v_b,t) / (v_θ - v_b,t), 0, 1)     (0 where v_θ ≤ v_b,t or v_b,t < 0, a prompt token)
    loglinear:  log π_prox = log π_behave + α_t (sg[log π_θ] - log π_behave)
    linear:     log π_prox = log((1 - α_t) π_behave + α_t sg[π_θ] + 1e-10)
    rollout:    log π_prox = log π_behave

A token sampled by the previous policy (v_b = v_θ - 1) gets α = 0, the behaviour log-prob itself;
the staler the token, the nearer to the current policy. AReaL's `prox_logp_method` takes
"recompute" (the forward pass: pass its log-probs as `old_log_prob`), "loglinear" (this function,
`method="loglinear"`) and "metrics" (recompute, and log the approximations); "linear" and "rollout"
are the two other approximations it computes for those metrics.

AReaL computes it inside its loss from the current log-probs detached (`_resolve_proximal_logp(...,
logprobs=logprobs.detach())`), so π_prox carries no gradient: it is an `old_log_prob` like any
other, and this function is called before the pgloss call, on `log_prob.detach()` (it detaches
itself), not an option inside the loss:

    prox = pgloss.proximal.proximal_log_prob(behave, log_prob, versions, current_version)
    algorithm(log_prob, prox, advantages, mask, rollout_log_prob=behave)   # with a RolloutCorrection

The result is float64 when any input is float64, else float32.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from ..core.checks import check_log_prob

__all__ = ["METHODS", "proximal_log_prob", "proximal_weight"]

METHODS = ("loglinear", "linear", "rollout")


def _check_version(current_version: object) -> int:
    if isinstance(current_version, bool) or not isinstance(current_version, int):
        raise TypeError(f"current_version must be an int (the trainer's policy version), got {current_version!r}")
    return current_version


def proximal_weight(versions: Tensor, current_version: int) -> Tensor:
    """α_t = clip((v_θ - 1 - v_b,t)/(v_θ - v_b,t), 0, 1), 0 where v_θ ≤ v_b,t or v_b,t < 0; float64 `[B, T]`.
    `versions` are the per-token policy versions of the rollout (integers; negative at prompt tokens)."""
    v_theta = _check_version(current_version)
    versions = check_tensor("versions", versions, ndim=(2,), floating=False)
    if versions.dtype.is_floating_point or versions.dtype.is_complex or versions.dtype == torch.bool:
        raise TypeError(f"versions must be an integer tensor (policy versions), got dtype {versions.dtype}")
    v_b = versions.to(torch.float64)
    diff = v_theta - v_b
    alpha = torch.where((diff > 0) & (versions >= 0), (v_theta - 1 - v_b) / diff.clamp(min=1), 0.0)
    return alpha.clamp(0.0, 1.0)


def proximal_log_prob(
    behave_log_prob: Tensor,
    log_prob: Tensor,
    versions: Tensor,
    current_version: int,
    *,
    method: Literal["loglinear", "linear", "rollout"] = "loglinear",
    mask: Tensor | None = None,
) -> Tensor:
    """log π_prox `[B, T]`, detached (the module docstring's formula for `method`), from the rollout's
    log-probs `behave_log_prob`, the current policy's `log_prob`, the per-token `versions` (integers) and
    `current_version` (the policy version being trained). Log-probabilities are at most 0 where `mask`
    is valid (everywhere without one)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
    behave = check_tensor("behave_log_prob", behave_log_prob, ndim=(2,))
    current = check_tensor("log_prob", log_prob, ndim=(2,))
    for name, value in (("log_prob", current), ("versions", versions)):
        if not isinstance(value, Tensor):
            continue
        if value.shape != behave.shape:
            raise ValueError(
                f"{name} must have behave_log_prob's shape {tuple(behave.shape)}, got {tuple(value.shape)}"
            )
        check_device(name, value, behave.device, "behave_log_prob")
    alpha = proximal_weight(versions, current_version)
    if mask is not None:
        mask = check_mask(mask, behave.shape, behave.device, "behave_log_prob")
    check_log_prob("behave_log_prob", behave, mask)
    check_log_prob("log_prob", current, mask)
    dtype = torch.promote_types(torch.promote_types(behave.dtype, current.dtype), torch.float32)
    old = behave.detach().to(dtype)
    new = current.detach().to(dtype)
    alpha = alpha.to(dtype)
    if method == "loglinear":
        return old + alpha * (new - old)
    if method == "linear":
        return torch.log((1 - alpha) * old.exp() + alpha * new.exp() + 1e-10)
    return old.clone()
