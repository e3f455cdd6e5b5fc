"""The clipped surrogate of PPO, with DAPO's asymmetric bounds, dual clip and the δ cap.

Per token (minimisation form, Schulman et al. 2017, https://arxiv.org/abs/1707.06347):

    L_clip = max( -A·r, -A·clip(r, 1-ε_low, 1+ε_high) )

- Clip-higher (DAPO, https://arxiv.org/abs/2503.14476): ε_high > ε_low.
- Dual clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729), for A < 0 only, c > 1:

      L = min( L_clip, -c·A )

  which bounds the loss of a bad action whose ratio has exploded (verl's `clip_ratio_c`).
- δ cap (two-sided clipping of INTELLECT-2, TRL's `delta`): the unclipped ratio is capped,
  r → min(r, δ) in the first branch only, δ > 1 + ε_high. For A < 0 it equals dual clip with
  c = δ; for A > 0 it changes nothing, since the clipped branch already wins there.

The ratio can be a token ratio `[B, T]` or a sequence ratio `[B, 1]` (GSPO): the formula is the same.
In the clipped zones the gradient with respect to the ratio is exactly zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class ClippedSurrogate:
    """Per-token loss and where each bound was active (bool, `[B, T]`)."""

    loss: Tensor
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
    """PPO's clipped surrogate loss per token; see the module docstring for the formulas.

    Computed in its one-clamp form: for A > 0, max(-A·r, -A·clip(r)) = -A·min(r, 1+ε_high); for
    A < 0 it is -A·max(r, 1-ε_low), and the dual clip (or δ cap, or both: the smaller) bounds
    that factor at c. So ℓ = -A·clamp(r, lo, hi) with per-token bounds chosen by the sign of A,
    which is one pass instead of two branches and a max, and the same value and gradient.

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
    bound = lambda value: ratio.new_tensor(value)  # noqa: E731  (python scalars would make float32 bounds)
    low = torch.where(positive, bound(-torch.inf), bound(1.0 - clip_low))
    high = torch.where(positive, bound(1.0 + clip_high), bound(cap))
    loss = -advantages * torch.clamp(ratio, low, high)
    r = ratio.detach().expand_as(advantages)
    return ClippedSurrogate(
        loss=loss,
        clipped_high=positive & (r > 1.0 + clip_high),
        clipped_low=negative & (r < 1.0 - clip_low),
        clipped_dual=negative & (r > cap),
    )
