"""A per-token value with its derivative given: the backward pass of an elementwise loss in one multiply.

When ℓ_t depends on log π_t alone (every token-level loss), autograd replays the forward's
graph backward, one pass per operation. A family that knows ∂ℓ_t/∂log π_t in closed form computes
it in the forward pass instead and attaches it with `with_slope`: the backward pass is then
grad_t · slope_t. The closed form is checked against finite differences (gradcheck) in the tests.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _WithSlope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value: Tensor, source: Tensor, slope: Tensor) -> Tensor:
        ctx.save_for_backward(slope)
        return value

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor):
        (slope,) = ctx.saved_tensors
        return None, grad * slope, None


def with_slope(value: Tensor, source: Tensor, slope: Tensor) -> Tensor:
    """`value` (computed without gradient), whose gradient with respect to `source` is
    `slope` ⊙ the incoming gradient: ∂value_t/∂source_t = slope_t, no cross terms. Without a
    gradient to carry (`source` needs none, or grad mode is off) it is `value` itself."""
    if not (torch.is_grad_enabled() and source.requires_grad):
        return value
    return _WithSlope.apply(value.detach(), source, slope.detach())
