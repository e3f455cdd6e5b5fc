"""The one loop every vocabulary computation runs (`ChunkLoop`), its sources (given logits, `LogitRows`; hidden
states and an LM head described by `head.py`, `HeadRows`, whose matmuls are `head_chunks.py`'s), never more than one
[chunk, V] buffer per model, and its tiles (`plan_tiles`). Shared by the fused loss (`fused.py`), the exact KL from
hidden states (`full_kl.py`) and the student-teacher divergences (`divergence.py`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import compute_dtype
from .backends import Backend, Plan
from .banned import clamp_banned_
from .head import PLAIN, HeadKind, HeadOptions  # noqa: F401 (HeadOptions: still importable from here)
from .head_chunks import HeadChunks, head_grad_buffer
from .kernels import RawTile
from .statistic import Statistic

# ---------------------------------------------------------------------------------------
# The one chunk loop. A *source* gives a chunk's tempered logits z [rows, V] and takes the
# chunk's ∂L/∂z back to its inputs; a *statistic* turns the sources' z into per-token values
# and, in backward, into ∂L/∂z of the first source (the model being trained). Memory beyond
# the inputs and their gradients: one [chunk, V] buffer per source.
# ---------------------------------------------------------------------------------------


class LogitRows:
    """Source: given logits `[N, V]` (any float dtype). A tile is copied into the compute dtype,
    divided by τ, with −inf (banned tokens) clamped to the lowest finite value so that π is exactly
    0 there. Its gradient goes to the logits; in backward, when the dtypes agree, the tile is
    recomputed straight into the gradient's rows (no second buffer)."""

    arity = 1

    def __init__(self, logits: Tensor, chunk_size: int, dtype: torch.dtype, width: int | None = None) -> None:
        self.logits, self.dtype, self.chunk_size = logits, dtype, chunk_size
        self.grad: Tensor | None = None  # ∂L/∂logits, from `begin_backward`
        self.z: Tensor | None = None  # the tile buffer, allocated on first use
        self.vocab = logits.shape[1]
        self.width = self.vocab if width is None else min(width, self.vocab)

    def chunk(self, rows: slice, temperature: float, for_grad: bool = False, cols: slice | None = None) -> Tensor:
        block = self.logits[rows] if cols is None else self.logits[rows, cols]
        if for_grad and self.grad is not None and self.grad.dtype == self.dtype:
            return tempered(block, temperature, self.grad[rows] if cols is None else self.grad[rows, cols])
        if self.z is None:  # allocated on first use: not at all when backward writes into the gradient
            self.z = self.logits.new_empty(min(self.logits.shape[0], self.chunk_size) * self.width, dtype=self.dtype)
        return tempered(block, temperature, self.z[: block.numel()].view(block.shape))

    def begin_backward(self, needs: tuple[bool, ...]) -> None:
        self.grad = torch.empty_like(self.logits, memory_format=torch.contiguous_format) if needs[0] else None

    def send(self, rows: slice, grad: Tensor, first: bool, cols: slice | None = None, first_col: bool = True) -> None:
        if self.grad is None:
            return
        target = self.grad[rows] if cols is None else self.grad[rows, cols]
        if grad.data_ptr() != target.data_ptr():
            target.copy_(grad)

    def gradients(self) -> tuple[Tensor | None, ...]:
        return (self.grad,)


class HeadRows:
    """Source: hidden states `[N, H]`, an LM head `[V, H]` and its bias `[V]` (or None), the head's `kind`
    (`HeadKind`: scale, soft-cap) beside them (`HeadChunks`); the gradient goes to each input that needs it.

    `valid` (a bool `[N]`, or None: every row) says which rows count: the others are read as zeros, whatever they
    hold (NaN and inf from left padding included), so that no value of theirs reaches a logit, ∂L/∂W or ∂L/∂b,
    and their ∂L/∂x is 0. The one place every loop over a head reads its hidden states: `x_rows`."""

    arity = 3

    def __init__(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        chunk_size: int,
        dtype: torch.dtype,
        width: int | None = None,
        kind: HeadKind = PLAIN,
        kernel: bool = False,
        valid: Tensor | None = None,
    ) -> None:
        self.hidden, self.weight, self.bias, self.dtype, self.vocab = hidden, weight, bias, dtype, weight.shape[0]
        self.valid = valid
        self._rows: slice | None = None  # the chunk whose hidden states `_x` holds (`x_rows`)
        self._x: Tensor | None = None
        self.head = HeadChunks(hidden, weight, bias, kind, chunk_size, dtype, width, kernel)
        self.grad_hidden: Tensor | None = None
        self.grad_weight: Tensor | None = None
        self.grad_bias: Tensor | None = None
        # Whether ∂L/∂x sums over vocabulary tiles and ∂L/∂W over token chunks: a half-precision head's sums
        # then run in float32 accumulators (`matmul_into`); a single term is written in the head's dtype.
        self.sums = (width is not None and width < self.vocab, chunk_size < hidden.shape[0])

    def x_rows(self, rows: slice) -> Tensor:
        """The hidden states of `rows`, zero where not `valid` (formed once per chunk, kept for its tiles)."""
        if self.valid is None:
            return self.hidden[rows]
        if self._x is None or self._rows != rows:
            self._rows, self._x = rows, torch.where(self.valid[rows, None], self.hidden[rows], 0.0)
        return self._x

    def chunk(
        self, rows: slice, temperature: float, for_grad: bool = False, cols: slice | None = None
    ) -> Tensor | RawTile:
        return self.head.logits(self.x_rows(rows), temperature, cols)

    def begin_backward(self, needs: tuple[bool, ...]) -> None:
        rows = self.hidden.shape[0]
        over_tiles, over_chunks = (summed and self.weight.dtype != self.dtype for summed in self.sums)
        if needs[0]:
            self.grad_hidden = torch.empty(
                self.hidden.shape, dtype=self.dtype if over_tiles else self.hidden.dtype, device=self.hidden.device
            )
        if needs[1]:
            self.grad_weight = head_grad_buffer(
                self.weight, self.dtype if over_chunks else self.weight.dtype, rows=rows
            )
        if len(needs) > 2 and needs[2] and self.bias is not None:
            self.grad_bias = head_grad_buffer(self.bias, self.dtype, rows=rows)
        self.head.keep_slope = True

    def send(self, rows: slice, grad: Tensor, first: bool, cols: slice | None = None, first_col: bool = True) -> None:
        self.head.apply_grad(
            grad,
            self.x_rows(rows),
            None if self.grad_hidden is None else self.grad_hidden[rows],
            self.grad_weight,
            self.grad_bias,
            first,
            cols,
            first_col,
        )

    def gradients(self) -> tuple[Tensor | None, ...]:
        grad_hidden = self.grad_hidden
        if grad_hidden is not None and self.valid is not None:
            grad_hidden = torch.where(self.valid[:, None], grad_hidden, 0.0)
        grads = (grad_hidden, self.grad_weight, self.grad_bias)
        params = (self.hidden, self.weight, self.bias)  # a gradient only for a given parameter
        return tuple(None if g is None or p is None else g.to(p.dtype) for g, p in zip(grads, params, strict=True))


def source_class(kind) -> type[LogitRows] | type[HeadRows]:
    """The source of a `ChunkLoop` kind: given logits ("logits") or an LM head (a `HeadKind`)."""
    return HeadRows if isinstance(kind, HeadKind) else LogitRows


def tempered(chunk: Tensor, temperature: float, out: Tensor) -> Tensor:
    """`chunk` / τ written into `out` (compute dtype), −inf logits (banned tokens) clamped as `banned.py` says."""
    if temperature == 1.0:
        out.copy_(chunk)
    else:
        torch.div(chunk, temperature, out=out)
    return clamp_banned_(out)


def tileable(statistic) -> bool:
    """Whether `statistic` is a `statistic.Statistic` (the tile interface: its values accumulate over vocabulary
    blocks with an online max). Any other object with `allocate`, `forward`, `grad` and `outputs` runs
    whole-vocabulary token chunks."""
    return isinstance(statistic, Statistic)


def _columns(vocab: int, vocab_block: int):
    for start in range(0, vocab, vocab_block):
        yield slice(start, min(start + vocab_block, vocab)), start == 0


def forward_rows(
    backend: Backend,
    statistic,
    sources: list,
    rows: slice,
    temperature: float,
    vocab_block: int,
    values: list[Tensor],
) -> list[Tensor] | None:
    """The statistic's per-token values for one chunk of tokens, into `values[...][rows]`, run by `backend`.

    Untiled (`vocab_block` >= V): one [chunk, V] block per source, returned (a caller may reuse it
    for the gradient). Tiled: vocabulary blocks of `vocab_block` columns, the statistic's running
    state carried from tile to tile (`tile_forward`) and turned into values at the end
    (`tile_finish`); returns None (no block outlives its tile)."""
    vocab = sources[0].vocab
    if vocab_block >= vocab:
        zs = [s.chunk(rows, temperature) for s in sources]
        backend.forward(statistic, zs, rows, values)
        return zs
    state = None
    for cols, _ in _columns(vocab, vocab_block):
        zs = [s.chunk(rows, temperature, cols=cols) for s in sources]
        state = backend.tile_forward(statistic, zs, rows, cols, state)
    backend.tile_finish(statistic, state, rows, values)
    return None


def backward_rows(
    backend: Backend,
    statistic,
    sources: list,
    rows: slice,
    temperature: float,
    vocab_block: int,
    values: list[Tensor],
    grads,
    first: bool,
    zs: list[Tensor] | None = None,
) -> None:
    """One chunk's ∂L/∂z sent back to the first source, tile by tile (recomputing each tile's logits),
    or from the forward's whole-vocabulary blocks `zs` when given."""
    vocab = sources[0].vocab
    if vocab_block >= vocab:
        if zs is None:
            zs = [sources[0].chunk(rows, temperature, for_grad=True)] + [
                s.chunk(rows, temperature) for s in sources[1:]
            ]
        sources[0].send(rows, backend.grad(statistic, zs, rows, values, grads, temperature), first=first)
        return
    for cols, first_col in _columns(vocab, vocab_block):
        zs = [sources[0].chunk(rows, temperature, for_grad=True, cols=cols)] + [
            s.chunk(rows, temperature, cols=cols) for s in sources[1:]
        ]
        grad = backend.tile_grad(statistic, zs, rows, cols, values, grads, temperature)
        sources[0].send(rows, grad, first=first, cols=cols, first_col=first_col)


class ChunkLoop(torch.autograd.Function):
    """The loop every vocabulary computation runs: `statistic` over the chunks of its sources.

    `kinds` names each source ("logits", or a `HeadKind` for an LM head); `tensors` are their inputs in
    order (one for logits; hidden, weight and bias, or None, for a head). `valid` (bool [N], or None) are the
    rows that count: a head source reads the others as zeros (`HeadRows`), whatever they hold. `plan` is the
    call's `backends.Plan` (tokens per chunk, vocabulary columns per tile, the backend; from `plan.plan`); a bare
    (chunk, block) pair runs on the torch backend; an object that is not a `statistic.Statistic` runs
    whole-vocabulary chunks whatever the second number. Only the first source is differentiated (the others, a
    reference or a teacher, are detached by the caller). Saves the inputs and the statistic's
    per-token values, never a [N, V] tensor; backward recomputes each tile's logits.

    The plan's backend runs the statistic (`backends.py`): on `TRITON_TILES` the head sources hand out the matmul's
    raw tiles (`kernels.RawTile`) to the statistic's kernels; the loop, the tiles and the gradients' matmuls are
    the same.
    """

    @staticmethod
    def forward(ctx, statistic, kinds, temperature, plan, valid, *tensors):
        chunk_size, vocab_block, backend = plan if isinstance(plan, Plan) else Plan(*plan)
        head = isinstance(kinds[0], HeadKind)
        dtype = compute_dtype(tensors[1].dtype if head else tensors[0].dtype)
        if not tileable(statistic):  # whole-vocabulary token chunks
            vocab_block = tensors[1].shape[0] if head else tensors[0].shape[1]
        sources = _sources(kinds, tensors, chunk_size, vocab_block, dtype, backend.raw_tiles, valid)
        n = tensors[0].shape[0]
        values = statistic.allocate(n, sources[0].dtype, tensors[0].device)
        for start in range(0, n, chunk_size):
            rows = slice(start, start + chunk_size)
            forward_rows(backend, statistic, sources, rows, temperature, vocab_block, values)
        ctx.statistic, ctx.kinds, ctx.temperature = statistic, kinds, temperature
        ctx.plan = Plan(chunk_size, vocab_block, backend)
        ctx.arity = sources[0].arity
        ctx.save_for_backward(valid, *tensors, *values)
        ctx.set_materialize_grads(False)
        return statistic.outputs(values)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        statistic, kinds, temperature = ctx.statistic, ctx.kinds, ctx.temperature
        chunk_size, vocab_block, backend = ctx.plan
        valid, *saved = ctx.saved_tensors
        n_inputs = sum(source_class(k).arity for k in kinds)
        tensors, values = saved[:n_inputs], saved[n_inputs:]
        needs = ctx.needs_input_grad[5 : 5 + ctx.arity]
        nothing = (None,) * (5 + n_inputs)
        if all(g is None for g in grads) or not any(needs):
            return nothing
        sources = _sources(kinds, tensors, chunk_size, vocab_block, values[0].dtype, backend.raw_tiles, valid)
        sources[0].begin_backward(needs)
        for start in range(0, tensors[0].shape[0], chunk_size):
            backward_rows(
                backend,
                statistic,
                sources,
                slice(start, start + chunk_size),
                temperature,
                vocab_block,
                values,
                grads,
                first=start == 0,
            )
        return (None,) * 5 + sources[0].gradients() + (None,) * (n_inputs - ctx.arity)


def _sources(
    kinds, tensors, chunk_size, vocab_block, dtype, kernel: bool = False, valid: Tensor | None = None
) -> list[LogitRows | HeadRows]:
    sources: list[LogitRows | HeadRows] = []
    at = 0
    for kind in kinds:
        if isinstance(kind, HeadKind):
            hidden, weight, bias = tensors[at : at + HeadRows.arity]
            sources.append(HeadRows(hidden, weight, bias, chunk_size, dtype, vocab_block, kind, kernel, valid))
        else:
            sources.append(LogitRows(tensors[at], chunk_size, dtype, vocab_block))
        at += source_class(kind).arity
    return sources


# ---------------------------------------------------------------------------------------
# Choosing the tiles: tokens per chunk and vocabulary columns per tile, from explicit sizes or
# from a memory budget in bytes.
# ---------------------------------------------------------------------------------------

# Default chunk: about 2²⁷ logits (512 MiB in float32) per chunk buffer.
CHUNK_ELEMENTS = 1 << 27
# Under a budget, a chunk keeps whole-vocabulary rows while it can hold this many tokens; below,
# it tiles the vocabulary with chunks of up to TILE_ROWS tokens (the matmuls stay large).
WHOLE_ROWS, TILE_ROWS = 512, 2048
# The kernel route (a GPU) takes every token in one chunk, up to KERNEL_ROWS, and the widest vocabulary tile
# the buffer holds: large matmuls, and ∂L/∂W written once per tile (no float32 [V, H] accumulator).
KERNEL_ROWS = 1 << 15


def _positive_int(name: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def plan_tiles(
    tokens: int,
    vocab: int,
    *,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
    buffers: int = 1,
    itemsize: int = 4,
    kernel: bool = False,
) -> tuple[int, int]:
    """(tokens per chunk, vocabulary columns per tile) for a loop over `tokens` x `vocab` logits.

    Explicit `chunk_size` / `vocab_block` are taken as they are (None: about 2²⁷ / V tokens, the
    whole vocabulary). `memory_budget` (bytes, exclusive with both) bounds the loop's buffers:
    `buffers` tiles of logits (one per source) and two cache-block temporaries, each
    chunk x vocab_block values of `itemsize` bytes. A budget that holds whole-vocabulary rows for
    at least 512 tokens (or all of them) keeps whole rows; a smaller one tiles the vocabulary with
    chunks of up to 2048 tokens. A budget below one value per buffer is refused.

    On the kernel route (`kernel`, `kernels.py`) the buffers are the `buffers` raw tiles alone (no
    temporaries), and without explicit sizes a chunk holds every token, up to 2¹⁵, in tiles of the width that
    the budget (None: about 2²⁷ values per buffer) leaves.
    """
    chunk_size = _positive_int("chunk_size", chunk_size)
    vocab_block = _positive_int("vocab_block", vocab_block)
    memory_budget = _positive_int("memory_budget", memory_budget)
    explicit = chunk_size is not None or vocab_block is not None
    if memory_budget is None and (explicit or not kernel):
        return chunk_size or max(1, CHUNK_ELEMENTS // max(1, vocab)), min(vocab_block or vocab, max(1, vocab))
    if explicit:
        given = "chunk_size" if chunk_size is not None else "vocab_block"
        raise ValueError(f"memory_budget and {given} are exclusive: pass a budget in bytes, or the sizes")
    per_value = itemsize * (buffers if kernel else buffers + 2)
    elements = CHUNK_ELEMENTS * buffers if memory_budget is None else memory_budget // per_value
    if elements < 1:
        raise ValueError(
            f"memory_budget must hold at least one value per buffer ({per_value} bytes), got {memory_budget}"
        )
    vocab = max(1, vocab)
    if kernel:
        rows = min(max(1, tokens), KERNEL_ROWS, elements)
        return rows, max(1, min(vocab, elements // rows))
    rows = elements // vocab
    if rows >= min(max(1, tokens), WHOLE_ROWS):
        return max(1, rows), vocab
    rows = max(1, min(max(1, tokens), TILE_ROWS, elements))
    return rows, max(1, min(vocab, elements // rows))
