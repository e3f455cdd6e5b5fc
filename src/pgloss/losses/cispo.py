"""CISPO: clip the importance-sampling weight, not the update (MiniMax-M1, https://arxiv.org/abs/2506.13585).

Per token (minimisation form, paper eq. 4-5):

    L = -sg[ r̂ ] · A · log π_θ(y_t|·),     r̂ = clip(r, 1 - ε_low^IS, 1 + ε_high^IS)

The weight is detached, so every token keeps the REINFORCE gradient -r̂·A·∇log π_θ, scaled but
never zeroed: where PPO's gradient vanishes, CISPO's does not.

Two parameterisations are in use:
- the paper and verl: r̂ = clip(r, 1 - clip_low, 1 + clip_high). The paper sets ε_low^IS "to a large
  value" (no lower bound) and tunes only ε_high^IS: here `clip_low=None`.
- TRL and ms-swift (ms-swift's Loss Types documentation): r̂ = min(r, ε_high), with ε_high the cap itself. That is
  `clip_low=None, clip_high=ε_high - 1` here.
"""

from __future__ import annotations

from torch import Tensor


def cispo_weight(ratio: Tensor, *, clip_low: float | None, clip_high: float) -> Tensor:
    """r̂ = clip(r, 1 - clip_low, 1 + clip_high), detached; no lower bound when `clip_low` is None."""
    lower = None if clip_low is None else 1.0 - clip_low
    return ratio.detach().clamp(min=lower, max=1.0 + clip_high)


def cispo_loss(log_prob: Tensor, weight: Tensor, advantages: Tensor) -> Tensor:
    """-sg[r̂]·A·log π_θ per token; `weight` is `cispo_weight(...)`, `[B, T]`."""
    return -weight.detach() * advantages * log_prob
