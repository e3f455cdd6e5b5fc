"""The logits of a chunk of tokens from hidden states and an LM head, never more than one
[chunk, V] buffer per model, and the chunk's gradient sent back to the hidden states and the head.
Shared by the fused loss (`fused.py`) and the exact KL from hidden states (`full_kl.py`)."""

from __future__ import annotations

import torch
from torch import Tensor


class HeadChunks:
    """A reusable [chunk, V] buffer for a chunk's tempered logits z = x Wᵀ / τ from hidden states x and a
    head W, and the chunk's gradient applied back to both (`apply_grad`). One per model in a loop."""

    def __init__(self, hidden: Tensor, weight: Tensor, chunk_size: int, dtype: torch.dtype) -> None:
        rows = min(hidden.shape[0], chunk_size)
        self.z = weight.new_empty(rows, weight.shape[0], dtype=dtype)
        # Low-precision parameters: the matmul writes in their dtype, the softmax runs in float32.
        self.raw = None if weight.dtype == dtype else weight.new_empty(rows, weight.shape[0])

    def logits(self, x: Tensor, weight: Tensor, temperature: float) -> Tensor:
        m = x.shape[0]
        z = self.z[:m]
        if self.raw is None:
            torch.mm(x, weight.t(), out=z)
        else:
            z.copy_(torch.mm(x, weight.t(), out=self.raw[:m]))
        if temperature != 1.0:
            z.div_(temperature)
        return z

    def apply_grad(self, grad: Tensor, x: Tensor, weight: Tensor, grad_hidden: Tensor | None,
                   grad_weight: Tensor | None, first: bool) -> None:
        """grad_hidden ← G W for this chunk's rows; grad_weight ← Gᵀ x (first chunk) or += Gᵀ x.

        `grad_weight` is in the compute dtype: in place for float32/64 parameters, a float32
        accumulator for half-precision ones (whose matmuls run in their own dtype)."""
        if self.raw is not None:
            grad = self.raw[: grad.shape[0]].copy_(grad)
        if grad_hidden is not None:
            torch.mm(grad, weight, out=grad_hidden)
        if grad_weight is None:
            return
        if grad_weight.dtype != grad.dtype and first:
            grad_weight.copy_(torch.mm(grad.t(), x))
        elif grad_weight.dtype != grad.dtype:
            grad_weight.add_(torch.mm(grad.t(), x))
        elif first:
            torch.mm(grad.t(), x, out=grad_weight)
        else:
            grad_weight.addmm_(grad.t(), x)


def weight_grad_buffer(weight: Tensor, dtype: torch.dtype, rows: int) -> Tensor:
    """∂L/∂W's buffer: left unfilled for the first chunk to write, zeros when there is no chunk."""
    return (torch.empty if rows else torch.zeros)(weight.shape, dtype=dtype, device=weight.device)
