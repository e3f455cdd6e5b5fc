"""An LM head's side of the vocabulary loop (`chunks.HeadRows` holds one per model): a tile of tempered logits
z = head(x W[cols]ᵀ + b[cols]) / τ from a chunk of hidden states x, formed in one reused buffer, and the tile's
gradient sent back through the head's two matmuls to x, W and b, in float32 accumulators for a half-precision head
(`matmul_into`)."""

from __future__ import annotations

import torch
from torch import Tensor

from .banned import clamp_banned_
from .head import HeadKind
from .kernels import RawTile


class HeadChunks:
    """A reusable buffer for a tile of tempered logits z = head(x W[cols]ᵀ + b[cols]) / τ from hidden states x
    and a head (W, b, `kind`: `HeadKind`), clamped from below at `banned.BANNED_LOGIT` (a −inf logit is a banned
    token), `width` vocabulary columns at most (the whole vocabulary by default), and the tile's gradient applied
    back to x, W and b (`apply_grad`). One per model in a loop. The buffers are flat, so that a short last tile
    is a contiguous [rows, k] view.

    On the kernel route (`kernel=True`, `kernels.py`) the tile is the matmul's output x W[cols]ᵀ in the head's
    dtype, handed out as a `kernels.RawTile` for a kernel to apply the head to, and the gradient it gets back
    is already ∂L/∂(x Wᵀ + b)."""

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        kind: HeadKind,
        chunk_size: int,
        dtype: torch.dtype,
        width: int | None = None,
        kernel: bool = False,
    ) -> None:
        self.weight, self.bias, self.kind, self.kernel = weight, bias, kind, kernel
        rows = min(hidden.shape[0], chunk_size)
        width = weight.shape[0] if width is None else min(width, weight.shape[0])
        self.z = weight.new_empty(rows * width, dtype=weight.dtype if kernel else dtype)
        # Low-precision parameters: the matmul writes in their dtype, the softmax runs in float32.
        self.raw = None if kernel or weight.dtype == dtype else weight.new_empty(rows * width)
        # A soft-capped head that is differentiated keeps its tile's slope (`HeadKind.transform_`).
        self.slope: Tensor | None = None
        self.keep_slope = False

    def logits(self, x: Tensor, temperature: float, cols: slice | None = None) -> Tensor | RawTile:
        w = self.weight if cols is None else self.weight[cols]
        m, k = x.shape[0], w.shape[0]
        z = self.z[: m * k].view(m, k)
        bias = self.bias if self.bias is None or cols is None else self.bias[cols]
        if self.kernel:
            return RawTile(torch.mm(x, w.t(), out=z), bias, self.kind, temperature)
        if self.raw is None:
            torch.mm(x, w.t(), out=z)
        else:
            z.copy_(torch.mm(x, w.t(), out=self.raw[: m * k].view(m, k)))
        slope = None
        if self.keep_slope and self.kind.softcap is not None:
            if self.slope is None:
                self.slope = torch.empty_like(self.z)
            slope = self.slope[: m * k].view(m, k)
        return clamp_banned_(self.kind.transform_(z, bias, temperature, slope))

    def apply_grad(
        self,
        grad: Tensor,
        x: Tensor,
        grad_hidden: Tensor | None,
        grad_weight: Tensor | None,
        grad_bias: Tensor | None,
        first: bool,
        cols: slice | None = None,
        first_col: bool = True,
    ) -> None:
        """The tile's ∂L/∂logits (before τ) through the head's kind to ∂L/∂r = G, then
        grad_hidden ← G W[cols] for this tile's rows (+= after the first column tile);
        grad_weight[cols] ← Gᵀ x and grad_bias[cols] ← Σ_rows G (first row chunk), or += after.

        `grad_weight` and `grad_bias` are in the compute dtype: in place for float32/64 parameters, float32
        accumulators for half-precision ones (whose matmuls run in their own dtype)."""
        weight = self.weight
        if cols is not None:
            weight = weight[cols]
            grad_weight = None if grad_weight is None else grad_weight[cols]
            grad_bias = None if grad_bias is None else grad_bias[cols]
        if not self.kernel:  # the kernel's gradient has the head's slope in it
            grad = self.kind.grad_(grad, None if self.slope is None else self.slope[: grad.numel()].view(grad.shape))
        if grad_bias is not None:
            if first:
                torch.sum(grad, dim=0, dtype=grad_bias.dtype, out=grad_bias)
            else:
                grad_bias.add_(grad.sum(dim=0, dtype=grad_bias.dtype))
        if self.raw is not None:
            grad = self.raw[: grad.numel()].view(grad.shape).copy_(grad)
        if grad_hidden is not None:
            matmul_into(grad_hidden, grad, weight, first_col)
        if grad_weight is not None:
            matmul_into(grad_weight, grad.t(), x, first)


# torch >= 2.8 multiplies half-precision matrices into a float32 output on CUDA (addmm's out_dtype).
FLOAT32_PRODUCTS = "dtype_out" in torch.ops.aten.addmm.overloads()


def matmul_into(out: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """`out` ← a b (`first`), else `out` += a b. A float32 `out` for half-precision `a`, `b` is an accumulator over
    tiles: on CUDA cuBLAS writes the products in float32 (`out_dtype`), so no tile's product is rounded to half
    precision before the sum; elsewhere each product is formed in the inputs' dtype, then added."""
    if out.dtype == a.dtype:
        torch.mm(a, b, out=out) if first else out.addmm_(a, b)
    elif out.is_cuda and FLOAT32_PRODUCTS:
        torch.addmm(out, a, b, beta=0.0 if first else 1.0, out_dtype=out.dtype, out=out)
    elif first:
        out.copy_(torch.mm(a, b))
    else:
        out.add_(torch.mm(a, b))


def head_grad_buffer(param: Tensor, dtype: torch.dtype, rows: int) -> Tensor:
    """∂L/∂W's (or ∂L/∂b's) buffer: left unfilled for the first chunk to write, zeros when there is no chunk."""
    return (torch.empty if rows else torch.zeros)(param.shape, dtype=dtype, device=param.device)
