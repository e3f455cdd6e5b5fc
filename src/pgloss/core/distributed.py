"""The one test of whether a step's statistic is reduced over ranks, and the reduction itself.

Every step-level count or statistic (the `Normalizer`, the rollout correction's weight mean, the
token masks' quantile, Clip-Cov's selection, batch-wide advantage statistics) is global over the
ranks of `process_group` when torch.distributed is initialised and `reduce=True`, and local
otherwise."""

from __future__ import annotations

import torch.distributed as dist
from torch import Tensor


def is_distributed(reduce: bool = True) -> bool:
    """True when a step statistic must be reduced over ranks: `reduce` and an initialised process group."""
    return reduce and dist.is_available() and dist.is_initialized()


def all_reduce(
    tensor: Tensor,
    process_group: dist.ProcessGroup | None = None,
    reduce: bool = True,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
) -> Tensor:
    """`tensor` reduced in place over the ranks when `is_distributed(reduce)`; returned either way."""
    if is_distributed(reduce):
        dist.all_reduce(tensor, op=op, group=process_group)
    return tensor


def world_size(process_group: dist.ProcessGroup | None = None, reduce: bool = True) -> int:
    return dist.get_world_size(process_group) if is_distributed(reduce) else 1


def rank(process_group: dist.ProcessGroup | None = None, reduce: bool = True) -> int:
    return dist.get_rank(process_group) if is_distributed(reduce) else 0
