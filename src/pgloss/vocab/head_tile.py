"""The head-kernel route (`kernels.use("head-kernel")`): log π(y) and H of one LM head, the logits formed inside
Triton kernels (`head_tile_kernels.py`) and never held in memory, not even one tile of them.

For hidden states x [N, H], the head W [V, H] (its bias b, `head.HeadKind`) and tempered logits z:

- forward: a grid of (row block, column range); each program keeps the running (m, s, a, z_y) of its rows over
  its columns (`entropy.LogProbEntropy`'s state) and writes them to a [N, splits] partial state. The splits
  combine here without a host sync: with M = maxⱼ mⱼ,

      s = Σⱼ e^{mⱼ − M} sⱼ,    a = Σⱼ e^{mⱼ − M} (aⱼ + (mⱼ − M) sⱼ),    z_y = maxⱼ z_yⱼ

  and `LogProbEntropy.tile_finish` turns (M, s, a, z_y) into log π(y) = (z_y − M) − log s and H = log s − a/s;
- backward: each (row block, column block) recomputes its logits and adds G W into a float32 ∂x [N, H], Gᵀ x
  into a float32 ∂W slab [slab, H] (the vocabulary `vocab_block` rows at a time, cast into a half-precision
  gradient once per slab; a float32 head's gradient is the accumulator itself) and Σ_rows G into a float32 ∂b.

Memory beyond the inputs and their gradients: 16 N · splits bytes in forward (the partial state), and in
backward 4 N H (∂x, for a half-precision x) + 4 · slab · H (∂W, half-precision W) + 4 V (∂b, half-precision b).
Flops: 2NHV forward, 6NHV backward (the block recomputed, then G W and Gᵀ x): 8NHV, as on the tiled routes.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from .chunks import plan_tiles
from .head import HeadKind

__all__ = ["plan", "HeadTileLoop"]

# Without a vocab_block or a memory_budget, the float32 ∂W slab of a half-precision head holds 2²⁵ bytes.
SLAB_BYTES = 1 << 25
# The forward's grid aims at this many programs per multiprocessor (the column ranges split the vocabulary).
PROGRAMS_PER_SM = 4
GRID_Y = 65535  # CUDA's limit on the grid's y axis: the column ranges and the column blocks of a slab


def plan(
    tokens: int, weight: Tensor, chunk_size: int | None, vocab_block: int | None, memory_budget: int | None
) -> tuple[int, int]:
    """(tokens, columns per slab) on the head-kernel route, the sizes checked as on every route (`plan_tiles`):
    the kernels take every token at once (an explicit `chunk_size` is unused), and `vocab_block` columns per ∂W
    slab and per forward range at most; without it, as many as a float32 slab [columns, H] of `memory_budget`
    bytes (2²⁵ without one) holds, at least one."""
    plan_tiles(tokens, weight.shape[0], chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    vocab, size = weight.shape
    if vocab_block is not None:
        return max(1, tokens), min(vocab_block, vocab)
    budget = SLAB_BYTES if memory_budget is None else memory_budget
    return max(1, tokens), max(1, min(vocab, budget // (4 * max(1, size))))


def _kernels():
    from . import head_tile_kernels

    return head_tile_kernels


def gpu_blocks(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_V, BLOCK_K, num_warps) of the kernels on a GPU, for a head of `dtype` (float32's IEEE
    operands, twice the bytes, take half as many hidden units a step)."""
    return 64, 128, 32 if dtype == torch.float32 else 64, 4


def blocks(weight: Tensor) -> tuple[int, int, int, int]:
    """`gpu_blocks` on CUDA. Triton's interpreter runs each operation in numpy: small blocks there walk every
    loop of the kernels (several column blocks, several steps over H) at a test's sizes."""
    return gpu_blocks(weight.dtype) if weight.device.type == "cuda" else (16, 16, 16, 1)


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _split_width(rows: int, weight: Tensor, columns: int, block_n: int, block_v: int) -> int:
    """Columns per forward program: at most `columns`, and on CUDA few enough that the grid fills the GPU."""
    vocab = weight.shape[0]
    if weight.device.type == "cuda":
        index = weight.device.index if weight.device.index is not None else torch.cuda.current_device()
        wanted = PROGRAMS_PER_SM * _multiprocessors(index)
        splits = min(_cdiv(vocab, block_v), max(1, _cdiv(wanted, _cdiv(rows, block_n))))
        columns = min(columns, _cdiv(_cdiv(vocab, splits), block_v) * block_v)
    if _cdiv(vocab, columns) > GRID_Y:
        raise ValueError(
            f"vocab_block gives {_cdiv(vocab, columns)} column ranges, one program each on the grid's y axis, at "
            f"most {GRID_Y} (CUDA's limit): pass a larger vocab_block"
        )
    return columns


def _rowwise(t: Tensor) -> Tensor:
    """`t` with unit stride along its last axis (the kernels' tl.dot loads), copied only where it has not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _head_args(x: Tensor, w: Tensor, bias: Tensor | None, kind: HeadKind) -> tuple:
    return (
        x,
        x.stride(0),
        w,
        w.stride(0),
        x if bias is None else bias,
        0 if bias is None else bias.stride(0),
        kind.scale,
        1.0 if kind.softcap is None else kind.softcap,
    )


def _constants(kind: HeadKind, bias: Tensor | None, valid: Tensor | None, sizes: tuple[int, int, int, int]) -> dict:
    """The compile-time arguments both kernels share: the head's flags, the valid rows' and the blocks (`blocks`)."""
    block_n, block_v, block_k, warps = sizes
    return dict(
        HAS_BIAS=bias is not None,
        SOFTCAP=kind.softcap is not None,
        HAS_VALID=valid is not None,
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCK_K=block_k,
        num_warps=warps,
    )


def _forward(statistic, kind, temperature, columns, valid, x, w, bias) -> list[Tensor]:
    """The combined state (m, s, a, z_y) [N] of every row over the whole vocabulary."""
    (rows, _), vocab = x.shape, w.shape[0]
    sizes = blocks(w)
    block_n, block_v = sizes[:2]
    width = _split_width(rows, w, columns, block_n, block_v)
    splits = _cdiv(vocab, width)
    m, s, a, z_y = (torch.empty(rows, splits, dtype=torch.float32, device=x.device) for _ in range(4))
    targets = statistic.targets
    if rows:
        _kernels().head_log_prob_entropy_forward[(_cdiv(rows, block_n), splits)](
            *_head_args(x, w, bias, kind),
            targets,
            targets.stride(0),
            targets if valid is None else valid,
            m,
            s,
            a,
            z_y,
            rows,
            x.shape[1],
            vocab,
            width,
            1.0 / temperature,
            **_constants(kind, bias, valid, sizes),
        )
    top = m.amax(dim=1, keepdim=True)
    step = m - top
    rescale = torch.exp(step)
    return [
        top.squeeze(1),
        (rescale * s).sum(dim=1),
        (rescale * (a + step * s)).sum(dim=1),
        z_y.amax(dim=1),
    ]


def _backward(statistic, kind, temperature, columns, valid, x, w, bias, upstream, needs) -> tuple:
    """∂L/∂x, ∂L/∂W, ∂L/∂b (None where not needed) from the rows' (c, log s, H, ∂L/∂log π(y), ∂L/∂H)."""
    shift, log_s, entropy, grad_log_prob, grad_entropy = upstream
    needs_x, needs_w, needs_b = needs[0], needs[1], needs[2] and bias is not None
    (rows, size), vocab = x.shape, w.shape[0]
    sizes = blocks(w)
    block_n, block_v = sizes[:2]
    columns = min(columns, vocab, GRID_Y * block_v)  # a slab's column blocks on the grid's y axis
    float32 = dict(dtype=torch.float32, device=x.device)
    grad_x = torch.zeros(rows, size, **float32) if needs_x else None
    grad_w = slab = None
    if needs_w:  # a float32 head's gradient is its own accumulator; a half-precision one's is the slab
        half = w.dtype != torch.float32 and rows > 0
        grad_w = (torch.empty if half else torch.zeros)(vocab, size, dtype=w.dtype, device=w.device)
        slab = torch.empty(columns, size, **float32) if half else None
    grad_b = torch.zeros(vocab, **float32) if needs_b else None
    targets = statistic.targets
    for col0 in range(0, vocab if rows else 0, columns):
        width = min(columns, vocab - col0)
        into = shift if grad_w is None else grad_w[col0 : col0 + width] if slab is None else slab[:width].zero_()
        _kernels().head_log_prob_entropy_backward[(_cdiv(rows, block_n), _cdiv(width, block_v))](
            *_head_args(x, w, bias, kind),
            targets,
            targets.stride(0),
            targets if valid is None else valid,
            shift,
            log_s,
            entropy,
            shift if grad_log_prob is None else grad_log_prob.contiguous(),
            shift if grad_entropy is None else grad_entropy.contiguous(),
            shift if grad_x is None else grad_x,
            size,
            into,
            size,
            shift if grad_b is None else grad_b,
            rows,
            size,
            col0,
            width,
            1.0 / temperature,
            **_constants(kind, bias, valid, sizes),
            HAS_GLP=grad_log_prob is not None,
            HAS_GENT=grad_entropy is not None,
            NEEDS_X=needs_x,
            NEEDS_W=needs_w,
            NEEDS_B=needs_b,
        )
        if grad_w is not None and slab is not None:  # the slab cast into the half-precision gradient, once
            grad_w[col0 : col0 + width].copy_(into)
    return (
        None if grad_x is None else grad_x.to(x.dtype),
        grad_w,
        None if grad_b is None or bias is None else grad_b.to(bias.dtype),
    )


class HeadTileLoop(torch.autograd.Function):
    """(log π(y), H) [N] of `statistic` (`entropy.LogProbEntropy`) from hidden [N, H], weight [V, H] and bias [V]
    (or None) on the head-kernel route; saves the inputs and four floats a row, never a logit."""

    @staticmethod
    def forward(ctx, statistic, kind, temperature, columns, valid, hidden, weight, bias):
        x, w = _rowwise(hidden), _rowwise(weight)
        values = statistic.allocate(x.shape[0], torch.float32, x.device)
        statistic.tile_finish(_forward(statistic, kind, temperature, columns, valid, x, w, bias), slice(None), values)
        ctx.statistic, ctx.kind, ctx.temperature, ctx.columns = statistic, kind, temperature, columns
        ctx.save_for_backward(valid, x, w, bias, *values)
        ctx.set_materialize_grads(False)
        return statistic.outputs(values)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        valid, x, w, bias, *values = ctx.saved_tensors
        needs = ctx.needs_input_grad[5:8]
        if all(g is None for g in grads) or not any(needs):
            return (None,) * 8
        upstream = ctx.statistic.upstream(slice(None), values, grads)
        args = (ctx.statistic, ctx.kind, ctx.temperature, ctx.columns, valid, x, w, bias)
        return (None,) * 5 + _backward(*args, upstream, needs)
