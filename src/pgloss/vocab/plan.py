"""A loop's plan, resolved once per call: the backend (`backends.choose`, the one place a route is chosen) and the
tiles on it (`chunks.plan_tiles`, or `head_tile.plan` for kernels that hold no tile), handed down to the loop as a
`backends.Plan`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import compute_dtype
from . import head_tile
from .backends import TRITON_HEAD, TRITON_TILES, Plan, choose
from .chunks import plan_tiles
from .head import HeadKind

__all__ = ["plan"]


def plan(
    statistic: object,
    kinds: tuple,
    weight: Tensor,
    tokens: int,
    *,
    chunk_size: int | None,
    vocab_block: int | None,
    memory_budget: int | None,
) -> Plan:
    """The plan of a loop of `statistic` (or its class) over `tokens` tokens of sources `kinds` (a `head.HeadKind`
    each, or "logits"), the trained model's source defined by `weight` (its LM head [V, H], or its logits [N, V]).

    The buffers that `memory_budget` bounds, by backend: on the torch one, a logits tile per source in the compute
    dtype, one more per half-precision head for its matmul's output, and one for a soft-capped trained head's slope;
    on Triton's tiles, the raw tile of each head in its own dtype; on the head kernels, the float32 ∂W slab."""
    backend = choose(statistic, kinds, weight)
    if backend is TRITON_HEAD:
        return Plan(*head_tile.plan(tokens, weight, chunk_size, vocab_block, memory_budget), backend)
    head = isinstance(kinds[0], HeadKind)
    vocab = weight.shape[0] if head else weight.shape[-1]
    if backend is TRITON_TILES:  # the raw tile of each head, in its dtype
        buffers, itemsize, kernel = len(kinds), weight.element_size(), True
    else:
        dtype = compute_dtype(weight.dtype)
        per_source = 2 if head and weight.dtype != dtype else 1
        softcap = head and kinds[0].softcap is not None
        buffers, itemsize, kernel = len(kinds) * per_source + int(softcap), torch.finfo(dtype).bits // 8, False
    tiles = plan_tiles(
        tokens,
        vocab,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        memory_budget=memory_budget,
        buffers=buffers,
        itemsize=itemsize,
        kernel=kernel,
    )
    return Plan(*tiles, backend)
