"""The logits of a chunk of tokens from hidden states and an LM head, never more than one
[chunk, V] buffer per model, and the chunk's gradient sent back to the hidden states and the head.
Shared by the fused loss (`fused.py`) and the exact KL from hidden states (`full_kl.py`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import compute_dtype


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


# ---------------------------------------------------------------------------------------
# The one chunk loop. A *source* gives a chunk's tempered logits z [rows, V] and takes the
# chunk's ∂L/∂z back to its inputs; a *statistic* turns the sources' z into per-token values
# and, in backward, into ∂L/∂z of the first source (the model being trained). Memory beyond
# the inputs and their gradients: one [chunk, V] buffer per source.
# ---------------------------------------------------------------------------------------


class LogitRows:
    """Source: given logits `[N, V]` (any float dtype). A chunk is copied into the compute dtype,
    divided by τ, with −inf (banned tokens) clamped to the lowest finite value so that π is exactly
    0 there. Its gradient goes to the logits; in backward, when the dtypes agree, the chunk is
    recomputed straight into the gradient's rows (no second buffer)."""

    arity = 1

    def __init__(self, logits: Tensor, chunk_size: int, dtype: torch.dtype) -> None:
        self.logits, self.dtype, self.chunk_size, self.grad, self.z = logits, dtype, chunk_size, None, None

    def chunk(self, rows: slice, temperature: float, for_grad: bool = False) -> Tensor:
        if for_grad and self.grad is not None and self.grad.dtype == self.dtype:
            return tempered(self.logits[rows], temperature, self.grad[rows])
        if self.z is None:  # allocated on first use: not at all when backward writes into the gradient
            rows_max = min(self.logits.shape[0], self.chunk_size)
            self.z = self.logits.new_empty(rows_max, self.logits.shape[1], dtype=self.dtype)
        return tempered(self.logits[rows], temperature, self.z[: self.logits[rows].shape[0]])

    def begin_backward(self, needs: tuple[bool, ...]) -> None:
        self.grad = torch.empty_like(self.logits, memory_format=torch.contiguous_format) if needs[0] else None

    def send(self, rows: slice, grad: Tensor, first: bool) -> None:
        if self.grad is not None and grad.data_ptr() != self.grad[rows].data_ptr():
            self.grad[rows] = grad

    def gradients(self) -> tuple[Tensor | None, ...]:
        return (self.grad,)


class HeadRows:
    """Source: hidden states `[N, H]` and an LM head `[V, H]` (`HeadChunks`); the gradient goes to
    both, whichever needs it."""

    arity = 2

    def __init__(self, hidden: Tensor, weight: Tensor, chunk_size: int, dtype: torch.dtype) -> None:
        self.hidden, self.weight, self.dtype = hidden, weight, dtype
        self.head = HeadChunks(hidden, weight, chunk_size, dtype)
        self.grad_hidden = self.grad_weight = None

    def chunk(self, rows: slice, temperature: float, for_grad: bool = False) -> Tensor:
        return self.head.logits(self.hidden[rows], self.weight, temperature)

    def begin_backward(self, needs: tuple[bool, ...]) -> None:
        if needs[0]:
            self.grad_hidden = torch.empty_like(self.hidden, memory_format=torch.contiguous_format)
        if needs[1]:
            self.grad_weight = weight_grad_buffer(self.weight, self.dtype, rows=self.hidden.shape[0])

    def send(self, rows: slice, grad: Tensor, first: bool) -> None:
        self.head.apply_grad(grad, self.hidden[rows], self.weight,
                             None if self.grad_hidden is None else self.grad_hidden[rows], self.grad_weight, first)

    def gradients(self) -> tuple[Tensor | None, ...]:
        return self.grad_hidden, None if self.grad_weight is None else self.grad_weight.to(self.weight.dtype)


SOURCES = {"logits": LogitRows, "head": HeadRows}


def tempered(chunk: Tensor, temperature: float, out: Tensor) -> Tensor:
    """`chunk` / τ written into `out` (compute dtype), with −inf logits (banned tokens)
    clamped to the lowest finite value so that their π is exactly 0 and 0 · log π stays 0."""
    if temperature == 1.0:
        out.copy_(chunk)
    else:
        torch.div(chunk, temperature, out=out)
    return out.clamp_(min=torch.finfo(out.dtype).min)


class ChunkLoop(torch.autograd.Function):
    """The loop every vocabulary computation runs: `statistic` over the chunks of its sources.

    `kinds` names each source ("logits" or "head", `SOURCES`); `tensors` are their inputs in order
    (one for logits, hidden and weight for a head). Only the first source is differentiated (the
    others, a reference or a teacher, are detached by the caller). Saves the inputs and the
    statistic's per-token values, never a [N, V] tensor; backward recomputes each chunk's logits.
    """

    @staticmethod
    def forward(ctx, statistic, kinds, temperature, chunk_size, *tensors):
        sources = _sources(kinds, tensors, chunk_size, compute_dtype(tensors[0].dtype if kinds[0] == "logits"
                                                                     else tensors[1].dtype))
        n = tensors[0].shape[0]
        values = statistic.allocate(n, sources[0].dtype, tensors[0].device)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            statistic.forward([s.chunk(rows, temperature) for s in sources], rows, values)
        ctx.statistic, ctx.kinds, ctx.temperature, ctx.chunk_size = statistic, kinds, temperature, chunk_size
        ctx.arity = sources[0].arity
        ctx.save_for_backward(*tensors, *values)
        ctx.set_materialize_grads(False)
        return statistic.outputs(values)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        statistic, kinds, temperature, chunk_size = ctx.statistic, ctx.kinds, ctx.temperature, ctx.chunk_size
        saved = ctx.saved_tensors
        n_inputs = sum(SOURCES[k].arity for k in kinds)
        tensors, values = saved[:n_inputs], saved[n_inputs:]
        needs = ctx.needs_input_grad[4:4 + ctx.arity]
        nothing = (None,) * (4 + n_inputs)
        if all(g is None for g in grads) or not any(needs):
            return nothing
        sources = _sources(kinds, tensors, chunk_size, values[0].dtype)
        sources[0].begin_backward(needs)
        for start in range(0, tensors[0].shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            zs = [sources[0].chunk(rows, temperature, for_grad=True)] + [s.chunk(rows, temperature) for s in sources[1:]]
            sources[0].send(rows, statistic.grad(zs, rows, values, grads, temperature), first=start == 0)
        return (None,) * 4 + sources[0].gradients() + (None,) * (n_inputs - ctx.arity)


def _sources(kinds, tensors, chunk_size, dtype) -> list:
    sources, at = [], 0
    for kind in kinds:
        cls = SOURCES[kind]
        sources.append(cls(*tensors[at:at + cls.arity], chunk_size, dtype))
        at += cls.arity
    return sources
