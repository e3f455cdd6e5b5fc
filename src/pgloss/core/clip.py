"""PPO's clipped surrogate per token, the one owner of the clip for every path that clips a ratio: the PPO family
(`losses/ppo.py`, whose module docstring has the formulas and sources) and the distillation term that feeds a
teacher's advantage through the same clipped loss (`terms/distillation.py`, verl's `distillation_loss`).

    ℓ = max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)),  for A < 0 at most -c·A (dual clip) or -δ·A (δ cap)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ClippedSurrogate:
    """Per-token loss and where each bound was active (bool, `[B, T]`)."""

    loss: Tensor
    factor: Tensor  # clamp(r, lo, hi): ℓ = -A·factor
    clipped_high: Tensor  # A > 0 and r > 1 + ε_high: the clipped branch is taken
    clipped_low: Tensor  # A < 0 and r < 1 - ε_low
    clipped_dual: Tensor  # A < 0 and the dual clip (or δ cap) bound the loss


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
    delta: float | None = None,
) -> ClippedSurrogate:
    """PPO's clipped surrogate loss per token; losses/ppo.py's module docstring has the formulas.

    Computed in its clamp form: for A > 0, max(-A·r, -A·clip(r)) = -A·min(r, 1+ε_high); for
    A < 0 it is -A·max(r, 1-ε_low), and the dual clip (or δ cap, or both: the smaller) bounds
    that factor at c. So ℓ = -A·clamp(r, lo, hi) with the bounds chosen by the sign of A (A = 0
    takes A < 0's), which is two clamps and a choice instead of two branches and a max, and the
    same value and gradient.

    Args:
        ratio: importance ratio r, `[B, T]` or `[B, 1]`.
        advantages: Â, `[B, T]`, detached.
        clip_low: ε_low ≥ 0, the lower bound is 1 - ε_low.
        clip_high: ε_high ≥ 0, the upper bound is 1 + ε_high.
        dual_clip: c > 1 or None; bounds the loss at -c·A when A < 0.
        delta: δ > 1 + ε_high or None; caps the unclipped ratio at δ.
    """
    positive, negative = advantages > 0, advantages < 0
    caps = [c for c in (dual_clip, delta) if c is not None]
    cap = min(caps) if caps else torch.inf  # A < 0: the factor max(r, 1-ε_low) is at most c
    # Two clamps with Python bounds (compared in the ratio's dtype) and a choice by the sign of A: three
    # launches, where per-token bound tensors took seven. A `[B, 1]` ratio is expanded first, so that
    # autograd sums its gradient over the tokens once, as the broadcasting clamp did.
    expanded = ratio.expand_as(advantages)
    factor = torch.where(positive, expanded.clamp(max=1.0 + clip_high), expanded.clamp(1.0 - clip_low, cap))
    r = expanded.detach()
    return ClippedSurrogate(
        loss=-advantages * factor,
        factor=factor,
        clipped_high=positive & (r > 1.0 + clip_high),
        clipped_low=negative & (r < 1.0 - clip_low),
        clipped_dual=negative & (r > cap),
    )
