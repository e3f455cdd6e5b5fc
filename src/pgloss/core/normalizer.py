"""The counts of one optimizer step that every `loss_agg_mode` divides by (`pgloss.core.aggregate`): the
`Normalizer`, global over the step's micro-batches and data-parallel ranks.

N_tok valid tokens, N_seq non-empty sequences, the sequences per length (ΔL Norm's Σ_j |y_j|^-α), the tokens
per group n_g (with `group_ids`), the tokens of rewarded sequences (with `scores`, the positive-example NLL)
and the same counts over the expert rows (with `expert`, CHORD). Counted once per step by `Normalizer.count`
(a collective under torch.distributed) and passed to every micro-batch's call, so that a micro-batch's loss
is its exact share of the step's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .batch import per_micro_batch
from .checks import check_values, host_reads, is_integer
from .sequence_parallel import SequenceParallel, check_sequence_parallel, data_parallel_group

MAX_GROUPS = 1 << 20
"""Group ids index a dense float64 count array (8 MiB at this bound)."""


@dataclass(frozen=True)
class Normalizer:
    """The token, sequence, length and group counts of one optimizer step, global over ranks.

    `length_counts[L]` is the number of the step's sequences with L valid tokens (L >= 1; index 0
    holds 0), the statistic of `delta-l-norm`; a Normalizer built by hand without it refuses that mode.
    `rewarded_tokens` (counted when `scores` are given) is the number of valid tokens of the step's
    sequences whose reward is > 0, the divisor of the positive-example NLL term (`rewarded_row_weights`).
    `expert` (counted when `expert` flags are given) holds the same counts over the step's expert rows
    alone (CHORD's SFT rows); `complement(self.expert)` are the other rows' counts.

    Build it once per optimizer step with `Normalizer.count` over all of the step's micro-batch
    masks, and pass it to every micro-batch's loss call. When the counts were all-reduced over a
    data-parallel group of `world_size` ranks, each rank's loss is multiplied by `world_size`, so
    that the gradient average of DDP and FSDP yields the gradient of the global loss.
    """

    tokens: Tensor
    sequences: Tensor
    group_tokens: Tensor | None = None
    world_size: int = 1
    length_counts: Tensor | None = None
    rewarded_tokens: Tensor | None = None
    expert: Normalizer | None = None
    sequence_parallel: SequenceParallel | None = None
    """The sequence group the step's sequences are split over (`pgloss.core.sequence_parallel`): every call
    that takes this Normalizer then computes over whole sequences. None: each call holds whole rows."""

    def complement(self, part: Normalizer | None) -> Normalizer:
        """The counts of the step's rows outside `part` (a sub-count of the same rows, e.g. `self.expert`):
        every count minus `part`'s; `self` when `part` is None."""
        if part is None:
            return self
        minus = lambda mine, theirs: None if mine is None or theirs is None else mine - theirs  # noqa: E731
        return Normalizer(
            tokens=self.tokens - part.tokens,
            sequences=self.sequences - part.sequences,
            group_tokens=minus(self.group_tokens, part.group_tokens),
            world_size=self.world_size,
            length_counts=minus(self.length_counts, part.length_counts),
            rewarded_tokens=minus(self.rewarded_tokens, part.rewarded_tokens),
            sequence_parallel=self.sequence_parallel,
        )

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
        scores: Tensor | Sequence[Tensor] | None = None,
        expert: Tensor | Sequence[Tensor] | None = None,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
    ) -> Normalizer:
        """Count valid tokens, non-empty sequences, sequences per length and (with `group_ids`)
        tokens per group.

        Under torch.distributed this is a collective: every rank of `process_group` must call it
        at every optimizer step, in the same order, even a rank whose micro-batches are empty. The
        length counts span the widest mask of the step (a MAX over the ranks' widths, then one SUM
        of the counts).

        Args:
            masks: the `[B, T]` mask of each micro-batch of the step (or one mask).
            group_ids: the `[B]` integer group (prompt) id of each row, one tensor per micro-batch.
                Ids are global: the same prompt has the same id on every rank. They number the
                step's groups from 0 (below `MAX_GROUPS`): the counts are a dense array.
            scores: the `[B]` sequence rewards of each micro-batch: counts the tokens of the rewarded
                (reward > 0) sequences, for the positive-example NLL term (`positive_nll_coef`).
            expert: the `[B]` bool flags of the expert (off-policy demonstration) rows of each micro-batch:
                the same counts over them alone, in `expert` (CHORD; one more collective of the counts).
            process_group: the data-parallel group (None: the default group).
            reduce: all-reduce (SUM) the counts when torch.distributed is initialized.
            sequence_parallel: the sequence group when the masks are slices of longer sequences
                (`pgloss.SequenceParallel`): each row's length is summed over it first (one all-reduce),
                `process_group` is then the data-parallel group beside it, and `world_size` counts both.
        """
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
        width = max(m.shape[-1] for m in mask_list)  # static: the shapes, never the values
        if distributed:
            widest = torch.tensor(width, device=device)
            dist.all_reduce(widest, op=dist.ReduceOp.MAX, group=process_group)
            width = int(widest)
        if sequence_parallel is not None:
            width *= sequence_parallel.size  # a whole sequence's positions
        per_length = torch.zeros(width + 1, dtype=torch.float64, device=device)
        for length in lengths:
            per_length.index_add_(0, length.to(device).long(), (length > 0).to(torch.float64))

        def per_row(name: str, values: Tensor | Sequence[Tensor]) -> list[Tensor]:
            """`values` of each micro-batch, checked to be `[B]` like its mask's rows."""
            value_list = per_micro_batch(name, values, len(mask_list))
            for k, (value, length) in enumerate(zip(value_list, lengths, strict=True)):
                if not isinstance(value, Tensor) or value.shape != length.shape:
                    raise ValueError(
                        f"{name}[{k}] must be a tensor of shape {tuple(length.shape)}, got "
                        f"{tuple(getattr(value, 'shape', ())) or type(value).__name__}"
                    )
            return value_list

        zero = torch.zeros((), dtype=torch.float64, device=device)
        rewarded = zero
        if scores is not None:
            for score, length in zip(per_row("scores", scores), lengths, strict=True):
                rewarded = rewarded + torch.where(score.to(device) > 0, length.to(device), 0.0).sum()
        counts = torch.cat(
            [
                torch.stack(
                    [
                        sum((length.sum() for length in lengths), zero),
                        sum(((length > 0).sum() for length in lengths), zero),
                        rewarded,
                    ]
                ),
                per_length,
            ]
        )
        if distributed:
            dist.all_reduce(counts, group=process_group)
        group_tokens = None
        if group_ids is not None:
            id_list = per_micro_batch("group_ids", group_ids, len(mask_list))
            for k, (ids, length) in enumerate(zip(id_list, lengths, strict=True)):
                if not isinstance(ids, Tensor) or ids.shape != length.shape or not is_integer(ids):
                    raise ValueError(
                        f"group_ids[{k}] must be integers of shape {tuple(length.shape)}, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}"
                    )
                _check_group_ids(f"group_ids[{k}]", ids)
            if distributed or all(host_reads(ids) for ids in id_list):
                # max id + 1 entries: read on the host, free on the CPU (and a collective is a sync point anyway)
                ends = torch.tensor(max(int(ids.max()) + 1 if ids.numel() else 0 for ids in id_list), device=device)
                if distributed:
                    dist.all_reduce(ends, op=dist.ReduceOp.MAX, group=process_group)
                size = int(ends)
            else:  # ids the host cannot read without a sync (an accelerator, torch.compile): the static bound
                size = MAX_GROUPS
            group_tokens = torch.zeros(size, dtype=torch.float64, device=device)
            for ids, length in zip(id_list, lengths, strict=True):
                group_tokens.index_add_(0, ids.to(device).long(), length)
            if distributed:
                dist.all_reduce(group_tokens, group=process_group)
        world_size = dist.get_world_size(process_group) if distributed else 1
        if sequence_parallel is not None:
            world_size *= sequence_parallel.size
        expert_counts = None
        if expert is not None:
            flag_list = per_row("expert", expert)
            expert_counts = cls.count(
                [m * (f != 0).to(m.device)[:, None] for m, f in zip(mask_list, flag_list, strict=True)],
                group_ids=group_ids,
                scores=scores,
                process_group=process_group,
                reduce=reduce,
                sequence_parallel=sequence_parallel,
            )
        return cls(
            tokens=counts[0],
            sequences=counts[1],
            group_tokens=group_tokens,
            world_size=world_size,
            length_counts=counts[3:],
            rewarded_tokens=counts[2] if scores is not None else None,
            expert=expert_counts,
            sequence_parallel=sequence_parallel,
        )


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
