"""The counts of one optimizer step that every `loss_agg_mode` divides by (`pgloss.core.aggregate`): the
`Normalizer`, global over the step's micro-batches and data-parallel ranks.

N_tok valid tokens, N_seq non-empty sequences, the sequences per length (ΔL Norm's Σ_j |y_j|^-α), the tokens
per group n_g (with `group_ids`); the same counts over each subset of rows a term aggregates apart (`parts`, by
the name of its `RowSet`), and the step-wide sums a rollout correction reads (`sums`). Counted once per step by
`Normalizer.count` and passed to every micro-batch's call, so that a micro-batch's loss is its exact share of
the step's. `Algorithm.count_step` is the entry point: it asks the objective which counts it declared and
counts them here.

Under torch.distributed the count is one packed MAX all-reduce (the widest mask, the largest group id) and one
packed SUM all-reduce of everything else, over the data-parallel group; under a sequence group, the rows'
lengths are summed over it first (one all-reduce: a whole sequence's length is what the counts read).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from .batch import per_micro_batch
from .checks import check_values, host_reads, is_integer
from .row_set import RowSet
from .sequence_parallel import SequenceParallel, check_sequence_parallel, data_parallel_group

MAX_GROUPS = 1 << 20
"""Group ids index a dense float64 count array (8 MiB at this bound)."""


@dataclass(frozen=True)
class Normalizer:
    """The token, sequence, length and group counts of one optimizer step, global over ranks.

    `length_counts[L]` is the number of the step's sequences with L valid tokens (L >= 1; index 0
    holds 0), the statistic of `delta-l-norm`; a Normalizer built by hand without it refuses that mode.
    `parts[name]` holds the same counts over the step's rows of one `RowSet` (`pgloss.core.row_set`), for a
    term that aggregates over those rows alone; `sums[name]` a step-wide sum a correction declared.

    Build it once per optimizer step (`Algorithm.count_step`) over all of the step's micro-batches, and
    pass it to every micro-batch's loss call. When the counts were all-reduced over a data-parallel
    group of `world_size` ranks, each rank's loss is multiplied by `world_size`, so that the gradient
    average of DDP and FSDP yields the gradient of the global loss.
    """

    tokens: Tensor
    sequences: Tensor
    group_tokens: Tensor | None = None
    world_size: int = 1
    length_counts: Tensor | None = None
    sequence_parallel: SequenceParallel | None = None
    """The sequence group the step's sequences are split over (`pgloss.core.sequence_parallel`): every call
    that takes this Normalizer then computes over whole sequences. None: each call holds whole rows."""
    parts: Mapping[str, Normalizer] = field(default_factory=dict)
    """The counts over each declared subset of the step's rows, by its `RowSet`'s name."""
    sums: Mapping[str, Tensor] = field(default_factory=dict)
    """Step-wide sums (float64), by name: summed over the micro-batches and ranks with the counts."""

    @property
    def groups(self) -> Tensor:
        """Number of groups with at least one valid token."""
        if self.group_tokens is None:
            raise ValueError("this Normalizer was counted without group_ids")
        return (self.group_tokens > 0).sum()

    @classmethod
    def count(
        cls,
        masks: Tensor | Sequence[Tensor],
        *,
        group_ids: Tensor | Sequence[Tensor] | None = None,
        row_sets: Mapping[RowSet, Tensor | Sequence[Tensor]] | None = None,
        sums: Mapping[str, Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
        **inputs: object,
    ) -> Normalizer:
        """Count valid tokens, non-empty sequences, sequences per length and (with `group_ids`) tokens per group;
        the same over each of `row_sets`; and carry `sums`. `Algorithm.count_step` calls it with the counts
        the configured loss declared; call it directly for the counts of masks (and group ids) alone.

        Under torch.distributed this is a collective: every rank of `process_group` must call it at every
        optimizer step, in the same order, even a rank whose micro-batches are empty: one MAX all-reduce (the
        step's widest mask and largest group id) and one SUM all-reduce (every count and sum, packed).

        Args:
            masks: the `[B, T]` mask of each micro-batch of the step (or one mask).
            group_ids: the `[B]` integer group (prompt) id of each row, one tensor per micro-batch.
                Ids are global: the same prompt has the same id on every rank. They number the
                step's groups from 0 (below `MAX_GROUPS`): the counts are a dense array.
            row_sets: a `RowSet` -> its `[B]` input in each micro-batch (one tensor per micro-batch): the counts of
                its rows go to `parts[row_set.name]`.
            sums: name -> a float64 tensor of this rank's partial sums, summed over ranks into `sums[name]`.
            process_group: the data-parallel group (None: the default group).
            reduce: all-reduce the counts when torch.distributed is initialized.
            sequence_parallel: the sequence group when the masks are slices of longer sequences
                (`pgloss.SequenceParallel`): each row's length is summed over it first (one all-reduce),
                `process_group` is then the data-parallel group beside it, and `world_size` counts both.
        """
        if inputs:  # a configured loss's own counts (its row sets, its correction's) are the algorithm's to declare
            given = ", ".join(f"{name}=..." for name in inputs)
            raise TypeError(
                f"Normalizer.count counts masks and group ids alone; count the step with "
                f"algorithm.count_step(mask, {given}), which counts what the algorithm reads of them"
            )
        mask_list = per_micro_batch("masks", masks)
        for k, mask in enumerate(mask_list):
            if not isinstance(mask, Tensor) or mask.ndim != 2:
                raise ValueError(f"masks[{k}] must be a [B, T] tensor, got {getattr(mask, 'shape', type(mask))}")
        device = mask_list[0].device
        sequence_parallel = check_sequence_parallel(sequence_parallel)
        process_group, distributed = data_parallel_group(process_group, reduce, sequence_parallel)
        lengths = [(m != 0).sum(dim=-1).to(torch.float64) for m in mask_list]
        if sequence_parallel is not None:  # each row's whole length: one all-reduce for the step's rows
            lengths = list(sequence_parallel.all_reduce(torch.cat(lengths)).split([len(n) for n in lengths]))
        flags = {rows.name: _row_flags(rows, values, lengths) for rows, values in (row_sets or {}).items()}
        ids = None if group_ids is None else _group_ids(group_ids, lengths)

        width = max(m.shape[-1] for m in mask_list)  # static: the shapes, never the values
        groups = 0
        if ids is not None:
            if distributed or all(host_reads(i) for i in ids):
                # max id + 1 entries: read on the host, free on the CPU (and a collective is a sync point anyway)
                groups = max(int(i.max()) + 1 if i.numel() else 0 for i in ids)
            else:  # ids the host cannot read without a sync (an accelerator, torch.compile): the static bound
                groups = MAX_GROUPS
        if distributed:  # the one MAX all-reduce
            bounds = torch.tensor([width, groups], device=device)
            dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=process_group)
            width, groups = int(bounds[0]), int(bounds[1])
        if sequence_parallel is not None:
            width *= sequence_parallel.size  # a whole sequence's positions

        def counts(rows: list[Tensor] | None) -> Tensor:
            """[N_tok, N_seq, n_L for L = 0..width, n_g for each group] over the rows flagged in `rows` (None: all)."""
            kept = lengths if rows is None else [torch.where(r, n, 0.0) for r, n in zip(rows, lengths, strict=True)]
            zero = torch.zeros((), dtype=torch.float64, device=device)
            per_length = torch.zeros(width + 1, dtype=torch.float64, device=device)
            for n in kept:
                per_length.index_add_(0, n.to(device).long(), (n > 0).to(torch.float64))
            parts = [torch.stack([sum((n.sum() for n in kept), zero), sum(((n > 0).sum() for n in kept), zero)])]
            parts.append(per_length)
            if ids is not None:
                per_group = torch.zeros(groups, dtype=torch.float64, device=device)
                for i, n in zip(ids, kept, strict=True):
                    per_group.index_add_(0, i.to(device).long(), n.to(device))
                parts.append(per_group)
            return torch.cat(parts)

        blocks = {"": counts(None)} | {name: counts(rows) for name, rows in flags.items()}
        blocks |= {f"sum:{name}": value.to(torch.float64).reshape(-1) for name, value in (sums or {}).items()}
        packed = torch.cat([block.to(device) for block in blocks.values()])
        if distributed:  # the one SUM all-reduce
            dist.all_reduce(packed, group=process_group)
        reduced = dict(zip(blocks, packed.split([len(block) for block in blocks.values()]), strict=True))
        world_size = dist.get_world_size(process_group) if distributed else 1
        if sequence_parallel is not None:
            world_size *= sequence_parallel.size

        def normalizer(
            block: Tensor, parts: Mapping[str, Normalizer] | None = None, sums: Mapping[str, Tensor] | None = None
        ) -> Normalizer:
            return cls(
                tokens=block[0],
                sequences=block[1],
                length_counts=block[2 : width + 3],
                group_tokens=None if ids is None else block[width + 3 :],
                world_size=world_size,
                sequence_parallel=sequence_parallel,
                parts=parts or {},
                sums=sums or {},
            )

        return normalizer(
            reduced[""],
            parts={name: normalizer(reduced[name]) for name in flags},
            sums={name: reduced[f"sum:{name}"].reshape(value.shape) for name, value in (sums or {}).items()},
        )


def _row_flags(rows: RowSet, values: Tensor | Sequence[Tensor], lengths: list[Tensor]) -> list[Tensor]:
    """The rows of `rows` in each micro-batch (bool `[B]`), from its input, checked to be one value per row."""
    value_list = per_micro_batch(rows.input, values, len(lengths))
    for k, (value, length) in enumerate(zip(value_list, lengths, strict=True)):
        if not isinstance(value, Tensor) or value.shape != length.shape:
            raise ValueError(
                f"{rows.input}[{k}] must be a tensor of shape {tuple(length.shape)}, got "
                f"{tuple(getattr(value, 'shape', ())) or type(value).__name__}"
            )
    return [rows.select(value).to(length.device) for value, length in zip(value_list, lengths, strict=True)]


def _group_ids(group_ids: Tensor | Sequence[Tensor], lengths: list[Tensor]) -> list[Tensor]:
    """The `[B]` integer group ids of each micro-batch, checked."""
    id_list = per_micro_batch("group_ids", group_ids, len(lengths))
    for k, (ids, length) in enumerate(zip(id_list, lengths, strict=True)):
        if not isinstance(ids, Tensor) or ids.shape != length.shape or not is_integer(ids):
            raise ValueError(
                f"group_ids[{k}] must be integers of shape {tuple(length.shape)}, got "
                f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}"
            )
        _check_group_ids(f"group_ids[{k}]", ids)
    return id_list


def _check_group_ids(name: str, ids: Tensor) -> None:
    """The counts are a dense array indexed by id: ids number the step's groups from 0, not a data set."""
    check_values(ids, lambda: ids < 0, lambda at: f"{name} must be non-negative, got {int(ids[at])} at row {int(at)}")
    check_values(
        ids,
        lambda: ids >= MAX_GROUPS,
        lambda at: (
            f"{name} must number the step's groups from 0 (below {MAX_GROUPS}), got id {int(ids[at])} at row "
            f"{int(at)}; renumber them, e.g. by prompt position within the step"
        ),
    )
