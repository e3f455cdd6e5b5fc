"""Sequences split across ranks (Ulysses sequence parallelism, context parallelism): the one owner of how a
loss call whose `[B, T_local]` tokens are slices of longer sequences gets the loss and every gradient of one
process holding the whole sequences.

A `SequenceParallel` names the sequence (context) group and how a sequence of T = W·T_local positions is cut
over its W ranks (`layout`):

    contiguous       rank r holds positions [r·T_local, (r+1)·T_local)        (Ulysses, plain CP)
    load_balanced    2W chunks of T_local/2; rank r holds chunks r and 2W-1-r, in that order
                     (torch's context_parallel head-tail balancer, which accelerate's cp_size uses; Megatron CP)

Every rank of a sequence group holds the same rows (the same B, group ids, sequence advantages, scores), each
row's own slice of tokens; padding may sit anywhere in the mask (the end of a sequence, whole slices of a
sequence shorter than T). A call learns it is such a slice from the step's `Normalizer`, counted with
`sequence_parallel=` (`Normalizer.count`, `Algorithm.step_normalizer`): the one place. What then goes across the
sequence group, and nothing else:

- the step's counts (once per step, in `Normalizer.count`): each row's length Σ_t m summed over the group (one
  all-reduce of the step's `[B]` lengths) before the counts are taken and all-reduced over the data-parallel
  group as without it; `world_size` becomes data-parallel ranks × sequence ranks, the ranks a trainer averages
  gradients over (FSDP over the dp × sp mesh);
- per call, only what the configuration reads (`row_sum`, `row_max`, `along_sequence`): a per-sequence sum
  (a sequence log-ratio, a length, a mean advantage) is one all-reduce (SUM) of `[B]` values; an extreme
  (verl's seq_max rejection) one all-reduce (MAX); a statistic along the positions of a sequence (FIPO's
  future KL, IW-OPD's prefix weights, a discounted return) gathers the detached `[B, T_local]` values into
  whole rows (one all_gather), computes them as one process would and keeps this rank's columns.

A sum that carries a gradient (GSPO's sequence log-ratio, GMPO's, REAL's and GVPO's scores) is
differentiable: its forward is an all-reduce SUM and so is its backward (`torch.distributed.nn.functional
.all_reduce`). Each rank's loss is its own tokens' share L_r of the step's loss L = Σ_r L_r, so the gradient
that reaches a token's log-probability on rank r is Σ_r' ∂L_r'/∂S_i · ∂S_i/∂x: every rank's part, summed.
An identity backward would hand rank r only ∂L_r/∂S_i, wrong for any loss that reads S_i on more than one rank
(GSPO's and GMPO's gradients off by 0.1 on the test batch).

A call without a `Normalizer` is a whole step on one process: under a sequence group pass the step's. A call's
metrics stay over its own tokens, as a micro-batch's do (average them over ranks); the ones computed from a
sequence statistic (a rollout correction's sequence mismatch) read it over the whole sequence.

Every collective runs on every rank of the group in the same order: the code path is the same on each
(no branch on values), and a rank whose slice of a row is all padding still takes part.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

LAYOUTS = ("contiguous", "load_balanced")


@dataclass(frozen=True)
class SequenceParallel:
    """The sequence (context) group of this rank and the layout of each sequence over it (module docstring).

    Pass it to the step's count (`Algorithm.step_normalizer(..., sequence_parallel=)`, `Normalizer.count`);
    every call that takes that `Normalizer` is then computed over whole sequences."""

    group: dist.ProcessGroup | None = None
    """The ranks that hold the slices of the same sequences; None: the default group (pure sequence parallelism)."""
    layout: str = "contiguous"
    """How a sequence is cut over the group: "contiguous" or "load_balanced" (`LAYOUTS`)."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "SequenceParallel needs an initialised torch.distributed process group "
                "(torch.distributed.init_process_group)"
            )

    @property
    def size(self) -> int:
        """W, the ranks of the sequence group."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's place in the sequence group."""
        return dist.get_rank(self.group)

    def chunks(self, rank: int | None = None) -> tuple[int, ...]:
        """The chunks of a sequence `rank` (default: this rank) holds, in the order of its local columns:
        (r,) of W chunks (contiguous) or (r, 2W-1-r) of 2W (load_balanced)."""
        r = self.rank if rank is None else rank
        return (r,) if self.layout == "contiguous" else (r, 2 * self.size - 1 - r)

    def _chunk_width(self, local_width: int) -> int:
        per_rank = len(self.chunks(0))
        if local_width % per_rank:
            raise ValueError(
                f"layout 'load_balanced' holds two chunks of a sequence per rank: the local width must "
                f"be even, got {local_width}"
            )
        return local_width // per_rank

    def shard(self, values: Tensor, dim: int = 1) -> Tensor:
        """This rank's slice of whole sequences `values` (positions along `dim`, T = W·T_local): how a sequence
        sits on this rank, for building the inputs (hidden states, log-probs, masks) of a sharded call."""
        width = values.shape[dim]
        chunks = len(self.chunks(0)) * self.size
        if width % chunks:
            raise ValueError(
                f"a sequence of {width} positions does not cut into {chunks} equal chunks "
                f"(layout {self.layout!r} over {self.size} ranks); pad it to a multiple of {chunks}"
            )
        size = width // chunks
        return torch.cat([values.narrow(dim, c * size, size) for c in self.chunks()], dim=dim)

    def whole(self, values: Tensor) -> Tensor:
        """Every rank's `[B, T_local]` `values` gathered into whole `[B, T]` rows, in the sequence's order
        (detached; one all_gather)."""
        values = values.detach().contiguous()
        parts = [torch.empty_like(values) for _ in range(self.size)]
        dist.all_gather(parts, values, group=self.group)
        size = self._chunk_width(values.shape[-1])
        pieces = {}
        for rank, part in enumerate(parts):
            for k, chunk in enumerate(self.chunks(rank)):
                pieces[chunk] = part[..., k * size : (k + 1) * size]
        return torch.cat([pieces[c] for c in sorted(pieces)], dim=-1)

    def all_reduce(self, values: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> Tensor:
        """`values` reduced over the group, out of place: differentiable for SUM (its backward a SUM too, see
        the module docstring) when `values` carries a gradient."""
        if op == dist.ReduceOp.SUM and values.requires_grad:
            return _SumOverGroup.apply(values, self.group)
        out = values.detach().clone()
        dist.all_reduce(out, op=op, group=self.group)
        return out


class _SumOverGroup(torch.autograd.Function):
    """S = Σ_r s_r over the group, and ∂L/∂s_r = Σ_r' ∂L_r'/∂S: an all-reduce SUM both ways (as
    `torch.distributed.nn.functional.all_reduce`, without its deprecation)."""

    @staticmethod
    def forward(ctx, values: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        out = values.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _SumOverGroup.apply(grad, ctx.group), None


def check_sequence_parallel(value: object) -> SequenceParallel | None:
    """`value` when it is a `SequenceParallel` or None; TypeError naming the argument otherwise."""
    if value is not None and not isinstance(value, SequenceParallel):
        raise TypeError(f"sequence_parallel must be a pgloss.SequenceParallel or None, got {type(value).__name__}")
    return value


def row_sum(values: Tensor, sequence_parallel: SequenceParallel | None = None, *, keepdim: bool = False) -> Tensor:
    """Σ_t values_{i,t} over the whole of each row, `[B]` (`[B, 1]` with `keepdim`): this call's columns, summed
    over the sequence group when there is one (one all-reduce, differentiable). Zero `values` at masked
    positions first."""
    total = values.sum(dim=-1, keepdim=keepdim)
    return total if sequence_parallel is None else sequence_parallel.all_reduce(total)


def row_total_and_length(
    values: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None, *, keepdim: bool = False
) -> tuple[Tensor, Tensor]:
    """(Σ_t values, |y_i| = Σ_t m) over the whole of each row, in the values' dtype: one all-reduce of both under a
    sequence group (`row_sum`). Zero `values` at masked positions first."""
    total, length = row_sum(
        torch.stack([values, mask.to(values.dtype).expand_as(values)]), sequence_parallel, keepdim=keepdim
    )
    return total, length


def row_mean(
    values: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None, *, keepdim: bool = False
) -> Tensor:
    """Σ_t values / max(|y_i|, 1) over the whole of each row (`row_total_and_length`): 0 for an empty row."""
    total, length = row_total_and_length(values, mask, sequence_parallel, keepdim=keepdim)
    return total / length.clamp(min=1)


def row_lengths(
    mask: Tensor,
    sequence_parallel: SequenceParallel | None = None,
    *,
    keepdim: bool = False,
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """|y_i| = Σ_t m_{i,t} over the whole sequence, in `dtype`, `[B]` (`[B, 1]` with `keepdim`)."""
    return row_sum(mask.to(dtype), sequence_parallel, keepdim=keepdim)


def row_max(values: Tensor, sequence_parallel: SequenceParallel | None = None, *, keepdim: bool = False) -> Tensor:
    """max_t values_{i,t} over the whole of each row (detached; -inf for a row of width 0): one all-reduce (MAX)
    over the sequence group when there is one. Put -inf at masked positions first."""
    if values.shape[-1] == 0:
        high = values.new_full((*values.shape[:-1], 1) if keepdim else values.shape[:-1], -torch.inf)
    else:
        high = values.detach().amax(dim=-1, keepdim=keepdim)
    return high if sequence_parallel is None else sequence_parallel.all_reduce(high, op=dist.ReduceOp.MAX)


def along_sequence(
    fn: Callable[[Tensor], Tensor], values: Tensor, sequence_parallel: SequenceParallel | None = None
) -> Tensor:
    """`fn` (a detached map of whole `[B, T]` rows to `[B, T]`, reading positions in order: a prefix or suffix
    sum) applied to `values`; under a sequence group on the gathered rows (`SequenceParallel.whole`), this
    rank's columns kept. Several inputs: stack them on a leading dimension and unstack in `fn`."""
    if sequence_parallel is None:
        return fn(values)
    return sequence_parallel.shard(fn(sequence_parallel.whole(values)), dim=-1)


def data_parallel_group(
    process_group: dist.ProcessGroup | None, reduce: bool, sequence_parallel: SequenceParallel | None
) -> tuple[dist.ProcessGroup | None, bool]:
    """(the group a step statistic is reduced over, whether it is reduced): `process_group` and
    `is_distributed(reduce)` as without a sequence group; under one, `process_group` is the data-parallel group
    beside it (the ranks holding other sequences), and None there means none when the sequence group is every
    rank (pure sequence parallelism). A per-sequence statistic is summed over the sequence group first, so a
    group that holds slices of the same sequences would count them again: refused."""
    from .distributed import is_distributed

    distributed = is_distributed(reduce)
    if sequence_parallel is None or not distributed:
        return process_group, distributed
    if process_group is not None and process_group is sequence_parallel.group:
        raise ValueError(
            "process_group is the sequence group; pass the data-parallel group beside it (the ranks "
            "holding other sequences), or None when every rank holds slices of the same sequences"
        )
    if process_group is None:
        if dist.get_world_size() != sequence_parallel.size:
            raise ValueError(
                f"process_group=None under a sequence group of {sequence_parallel.size} ranks in a world "
                f"of {dist.get_world_size()}: pass the data-parallel group (the ranks holding other "
                f"sequences, e.g. mesh['dp'].get_group())"
            )
        return None, False
    return process_group, True
