"""Reducing per-token values to the loss: the `loss_agg_mode`s and the global `Normalizer`.

With per-token values ℓ_{i,t}, mask m_{i,t}, |y_i| = Σ_t m_{i,t}, and the counts of one optimizer
step over every micro-batch and data-parallel rank (N_tok tokens, N_seq non-empty sequences,
N_grp non-empty groups, n_g tokens in group g):

    token-mean                ( Σ_i Σ_t m ℓ ) / N_tok                         (DAPO, BNPO, CISPO)
    seq-mean-token-mean       ( Σ_i (Σ_t m ℓ) / |y_i| ) / N_seq                (GRPO, GSPO, SAPO)
    seq-mean-token-sum        ( Σ_i Σ_t m ℓ ) / N_seq
    seq-mean-token-sum-norm   ( Σ_i Σ_t m ℓ ) / (N_seq · C)                    (Dr.GRPO, C = norm_constant)
    group-mean-token-mean     ( Σ_g (Σ_{i∈g} Σ_t m ℓ) / n_g ) / N_grp          (per prompt)
    token-sum                 Σ_i Σ_t m ℓ                                      (verl 0.9: no divisor)
    delta-l-norm              Σ_i x_i Σ_t m ℓ,  x_i = |y_i|^-α / (C · Σ_j |y_j|^-α)   (ΔL Norm, C = norm_constant)

Dr.GRPO (https://arxiv.org/abs/2503.20783, sec. 3.1) replaces GRPO's 1/|y_i| by a constant, the
generation budget: (1/G) Σ_i (1/C) Σ_t ℓ. C is `norm_constant` and is required: it is never the
padded width of the batch (verl's default, `loss_mask.shape[-1]`), which changes from batch to
batch. TRL and ms-swift divide by B·max_completion_length, the same thing. verl divides the token
sum by C alone, without 1/N_seq: its loss is N_seq times ours.

ΔL Normalization (He et al. 2025, arXiv 2509.07558, renamed "VL Norm" in its v2) treats each sequence's
token sum g_i = Σ_t ℓ_{i,t} as an unbiased estimate of the step's gradient whose variance grows with
its length, Var(g_i) ≈ V·|y_i|, and takes the minimum-variance unbiased combination Σ_i x_i g_i with
Σ_i x_i = 1/C: x_i ∝ 1/|y_i| (α = 1). The exponent α (`delta_l_alpha`) trades variance for the
weight of long responses: α = 0 is Dr.GRPO's 1/(N_seq·C) exactly, α = 1 the minimum variance; the
paper's recipes take α = 1 (CountDown) and α = 0.75 (math). The sum Σ_j over the step's non-empty
sequences (every micro-batch and rank) is the one global statistic: the Normalizer counts the step's
sequences per length (`length_counts`, whatever α), and Σ_j |y_j|^-α = Σ_L n_L·L^-α.

Each mode is one row of `AGGREGATIONS` (an `Aggregation`: what it divides by, the count of the step's
`Normalizer` it reads, whether it needs the budget C, its row weights); the call, `Algorithm`'s checks,
`pgloss.get`'s generation budget and the trainer translators and adapters ask that row, so a new mode
is one row.

Every mode is a weighted sum Σ w_{i,t} ℓ_{i,t} whose weights depend only on the mask and the
global counts, so a micro-batch's loss is its exact share of the step's loss: summing micro-batch
losses gives the whole-batch loss, and so does summing gradients. A sequence (and, for the group
mode, its count n_g) is never split, since the counts are global.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .batch import per_micro_batch
from .checks import check_values, host_reads, is_integer
from .sequence_parallel import SequenceParallel, check_sequence_parallel, data_parallel_group, row_lengths

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
            for k, (value, length) in enumerate(zip(value_list, lengths)):
                if not isinstance(value, Tensor) or value.shape != length.shape:
                    raise ValueError(
                        f"{name}[{k}] must be a tensor of shape {tuple(length.shape)}, got "
                        f"{tuple(getattr(value, 'shape', ())) or type(value).__name__}"
                    )
            return value_list

        rewarded = torch.zeros((), dtype=torch.float64, device=device)
        if scores is not None:
            for score, length in zip(per_row("scores", scores), lengths):
                rewarded = rewarded + torch.where(score.to(device) > 0, length.to(device), 0.0).sum()
        counts = torch.cat(
            [
                torch.stack(
                    [
                        sum(length.sum() for length in lengths),
                        sum((length > 0).sum() for length in lengths).to(torch.float64),
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
            for k, (ids, length) in enumerate(zip(id_list, lengths)):
                if not isinstance(ids, Tensor) or ids.shape != length.shape or not is_integer(ids):
                    raise ValueError(
                        f"group_ids[{k}] must be integers of shape {tuple(length.shape)}, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)} {tuple(getattr(ids, 'shape', ()))}"
                    )
                # The counts are a dense array indexed by id: ids number the step's groups, not a data set.
                check_values(
                    ids,
                    lambda ids=ids: ids < 0,
                    lambda at, ids=ids, k=k: (
                        f"group_ids[{k}] must be non-negative, got {int(ids[at])} at row {int(at)}"
                    ),
                )
                check_values(
                    ids,
                    lambda ids=ids: ids >= MAX_GROUPS,
                    lambda at, ids=ids, k=k: (
                        f"group_ids[{k}] must number the step's groups from 0 (below "
                        f"{MAX_GROUPS}), got id {int(ids[at])} at row {int(at)}; renumber "
                        f"them, e.g. by prompt position within the step"
                    ),
                )
            if distributed or all(host_reads(ids) for ids in id_list):
                # max id + 1 entries: read on the host, free on the CPU (and a collective is a sync point anyway)
                size = torch.tensor(max(int(ids.max()) + 1 if ids.numel() else 0 for ids in id_list), device=device)
                if distributed:
                    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=process_group)
                size = int(size)
            else:  # ids the host cannot read without a sync (an accelerator, torch.compile): the static bound
                size = MAX_GROUPS
            group_tokens = torch.zeros(size, dtype=torch.float64, device=device)
            for ids, length in zip(id_list, lengths):
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
                [m * (f != 0).to(m.device)[:, None] for m, f in zip(mask_list, flag_list)],
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


def row_weights(
    mask: Tensor,
    mode: str,
    normalizer: Normalizer,
    *,
    norm_constant: float | None = None,
    group_ids: Tensor | None = None,
    delta_l_alpha: float = 1.0,
) -> Tensor:
    """c_i with w_{i,t} = m_{i,t}·c_i for `mode` (its row of `AGGREGATIONS`): every mode weighs a row's
    valid tokens alike; `[B]`, float64.

    Every denominator is clamped at 1, so an all-masked batch gives a zero loss, never NaN.
    A `normalizer` that counted fewer tokens or non-empty sequences than this call holds was counted
    on other masks (a value check: `check_counts`).
    """
    check_counts(mask, normalizer)
    agg = aggregation(mode)
    if agg.needs_group_ids and group_ids is None:
        raise ValueError(f"loss_agg_mode {mode!r} needs group_ids")
    if agg.needs_budget and (norm_constant is None or not norm_constant > 0):
        raise ValueError(f"{mode} needs norm_constant > 0, got {norm_constant!r}")
    return agg.rows(mask, normalizer, norm_constant=norm_constant, group_ids=group_ids, delta_l_alpha=delta_l_alpha)


def _token_sum_rows(mask: Tensor, normalizer: Normalizer, **_: object) -> Tensor:
    return torch.ones((), dtype=torch.float64, device=mask.device).expand(mask.shape[0])


def _token_mean_rows(mask: Tensor, normalizer: Normalizer, **_: object) -> Tensor:
    return (1.0 / normalizer.tokens.clamp(min=1)).expand(mask.shape[0])


def _seq_mean_token_mean_rows(mask: Tensor, normalizer: Normalizer, **_: object) -> Tensor:
    lengths = row_lengths(mask, normalizer.sequence_parallel)
    return 1.0 / (lengths.clamp(min=1) * normalizer.sequences.clamp(min=1))


def _seq_mean_token_sum_rows(mask: Tensor, normalizer: Normalizer, **_: object) -> Tensor:
    return (1.0 / normalizer.sequences.clamp(min=1)).expand(mask.shape[0])


def _seq_mean_token_sum_norm_rows(mask: Tensor, normalizer: Normalizer, *, norm_constant: float, **_: object) -> Tensor:
    return (1.0 / (normalizer.sequences.clamp(min=1) * norm_constant)).expand(mask.shape[0])


def _group_mean_token_mean_rows(mask: Tensor, normalizer: Normalizer, *, group_ids: Tensor, **_: object) -> Tensor:
    if normalizer.group_tokens is None:
        raise ValueError("loss_agg_mode 'group-mean-token-mean' needs a Normalizer counted with group_ids")
    groups = len(normalizer.group_tokens)
    check_values(
        group_ids,
        lambda: (group_ids < 0) | (group_ids >= groups),
        lambda at: (
            f"group_ids must lie in [0, {groups}) (the groups the step's Normalizer counted), "
            f"got {int(group_ids[at])} at row {int(at)}"
        ),
    )
    ids = group_ids.to(mask.device).long()
    check_values(
        mask,
        lambda: (
            torch.zeros_like(normalizer.group_tokens).index_add_(0, ids, mask.sum(dim=-1, dtype=torch.float64))
            > normalizer.group_tokens
        ),
        lambda at: (
            f"the normalizer counted {int(normalizer.group_tokens[at])} tokens in group {int(at)} "
            f"but this call holds more; count the step's Normalizer on every micro-batch's mask"
        ),
    )
    per_row = normalizer.group_tokens[ids].clamp(min=1)
    return 1.0 / (per_row * normalizer.groups.clamp(min=1))


def _delta_l_norm_rows(
    mask: Tensor, normalizer: Normalizer, *, norm_constant: float, delta_l_alpha: float, **_: object
) -> Tensor:
    return _delta_l_rows(mask, normalizer, norm_constant, delta_l_alpha)


def _delta_l_rows(mask: Tensor, normalizer: Normalizer, norm_constant: float, alpha: float) -> Tensor:
    """ΔL Norm's x_i = |y_i|^-α / (C · Σ_j |y_j|^-α), Σ_j over the step's non-empty sequences
    (`normalizer.length_counts`); 0 for an empty row, and 0 for every row of an empty step."""
    counts = normalizer.length_counts
    if counts is None:
        raise ValueError(
            "loss_agg_mode 'delta-l-norm' needs a Normalizer that counted the step's lengths "
            "(Normalizer.count or Algorithm.step_normalizer)"
        )
    lengths = row_lengths(mask, normalizer.sequence_parallel)
    size = counts.shape[0]
    check_values(
        mask,
        lambda: lengths >= size,
        lambda at: (
            f"row {int(at)} holds {int(lengths[at])} valid tokens but the normalizer counted "
            f"lengths up to {size - 1}; count the step's Normalizer on every micro-batch's mask"
        ),
    )
    check_values(
        mask,
        lambda: (
            torch.zeros_like(counts).index_add_(0, lengths.long().clamp(max=size - 1), (lengths > 0).to(torch.float64))
            > counts
        ),
        lambda at: (
            f"the normalizer counted {int(counts[at])} sequences of {int(at)} tokens but this call "
            f"holds more; count the step's Normalizer on every micro-batch's mask"
        ),
    )
    support = torch.arange(size, dtype=torch.float64, device=counts.device)
    total = (counts * support.clamp(min=1).pow(-alpha)).sum()  # Σ_j |y_j|^-α (counts[0] = 0)
    own = torch.where(lengths > 0, lengths.clamp(min=1).pow(-alpha), 0.0)
    return own / (norm_constant * torch.where(total > 0, total, 1.0).to(own.device))


@dataclass(frozen=True)
class Aggregation:
    """One `loss_agg_mode`: what it divides by and what it needs, the one answer every path asks (the
    call's `row_weights`, `Algorithm`'s checks and `needs`, `pgloss.get`'s generation budget, the TRL and
    verl translators and adapters). A mode is one row of `AGGREGATIONS`; nothing else names it."""

    name: str
    divides_by: str
    """The divisor of a row's token sum, in the module docstring's symbols."""
    count: str | None
    """The count of the step's `Normalizer` it reads (`tokens`, `sequences`, `group_tokens`,
    `length_counts`), None when it reads none (token-sum)."""
    needs_budget: bool
    """True when it divides by a fixed generation budget C (`norm_constant`), which it then requires."""
    rows: Callable[..., Tensor]
    """c_i: rows(mask, normalizer, *, norm_constant, group_ids, delta_l_alpha) -> `[B]` float64."""

    @property
    def needs_group_ids(self) -> bool:
        """True when it divides by per-group counts: the call needs `group_ids` and the Normalizer their counts."""
        return self.count == "group_tokens"


AGGREGATIONS: dict[str, Aggregation] = {
    a.name: a
    for a in (
        Aggregation("token-mean", "N_tok", "tokens", False, _token_mean_rows),
        Aggregation("seq-mean-token-mean", "|y_i|·N_seq", "sequences", False, _seq_mean_token_mean_rows),
        Aggregation("seq-mean-token-sum", "N_seq", "sequences", False, _seq_mean_token_sum_rows),
        Aggregation("seq-mean-token-sum-norm", "N_seq·C", "sequences", True, _seq_mean_token_sum_norm_rows),
        Aggregation("group-mean-token-mean", "n_g·N_grp", "group_tokens", False, _group_mean_token_mean_rows),
        Aggregation("token-sum", "1", None, False, _token_sum_rows),
        Aggregation("delta-l-norm", "C·Σ_j |y_j|^-α / |y_i|^-α", "length_counts", True, _delta_l_norm_rows),
    )
}
"""loss_agg_mode -> its `Aggregation`: the table of the modes (the module docstring has the formulas)."""

AGG_MODES = tuple(AGGREGATIONS)
"""The built-in modes' names (`AGGREGATIONS`' keys)."""

BUDGET_MODES = tuple(name for name, agg in AGGREGATIONS.items() if agg.needs_budget)
"""The built-in modes that divide by a fixed generation budget C (`norm_constant`), which they require."""


def aggregation(mode: object, *, field: str = "loss_agg_mode") -> Aggregation:
    """The row of `AGGREGATIONS` for `mode`; ValueError naming `field` and the valid modes otherwise."""
    if not isinstance(mode, str) or mode not in AGGREGATIONS:
        raise ValueError(f"{field} must be one of {tuple(AGGREGATIONS)}, got {mode!r}")
    return AGGREGATIONS[mode]


def needs_budget(mode: object) -> bool:
    """True when `mode` is a known mode that divides by a fixed generation budget (`Aggregation.needs_budget`)."""
    return isinstance(mode, str) and mode in AGGREGATIONS and AGGREGATIONS[mode].needs_budget


def rewarded_row_weights(mask: Tensor, rewarded: Tensor, normalizer: Normalizer) -> Tensor:
    """c_i = [rewarded_i] / N_rew: the token mean over the step's rewarded sequences (`[B]` bool
    `rewarded`), N_rew = `normalizer.rewarded_tokens` (clamped at 1: a step without a rewarded token
    gives 0). The aggregation of VAPO's positive-example NLL (arXiv 2504.05118, eq. 10); `[B]`, float64."""
    if normalizer.rewarded_tokens is None:
        raise ValueError(
            "the positive-example NLL term needs a Normalizer counted with scores "
            "(Algorithm.step_normalizer(..., scores=...) or Normalizer.count(..., scores=...))"
        )
    held = torch.where(rewarded, mask.sum(dim=-1, dtype=torch.float64), 0.0).sum()
    check_values(
        mask,
        lambda: held > normalizer.rewarded_tokens,
        lambda _: (
            f"the normalizer counted {int(normalizer.rewarded_tokens)} tokens of rewarded sequences "
            f"but this call holds {int(held)}; count the step's Normalizer on every micro-batch's "
            f"mask and scores"
        ),
    )
    return rewarded.to(torch.float64) / normalizer.rewarded_tokens.clamp(min=1).to(mask.device)


def check_counts(mask: Tensor, normalizer: Normalizer) -> None:
    """Refuse a `normalizer` that counted fewer valid tokens or non-empty sequences than the bool
    `mask` of one call holds: it was counted on other masks (say, before a token mask was applied),
    and the loss would be too large. A value check (`pgloss.checks.check_values`)."""
    if not host_reads(mask):
        return
    lengths = mask.sum(dim=-1)
    for what, counted, held in (
        ("tokens", normalizer.tokens, lengths.sum()),
        ("sequences", normalizer.sequences, (lengths > 0).sum()),
    ):
        if bool(held > counted):
            raise ValueError(
                f"the normalizer counted {int(counted)} {what} but this call holds {int(held)}; count "
                f"the step's Normalizer on the masks the calls use (every micro-batch's, after any "
                f"token mask)"
            )


def token_weights(
    mask: Tensor,
    mode: str,
    normalizer: Normalizer,
    *,
    norm_constant: float | None = None,
    group_ids: Tensor | None = None,
    delta_l_alpha: float = 1.0,
) -> Tensor:
    """w_{i,t} with loss = Σ w ℓ for `mode` (see the module docstring); `[B, T]`, float64."""
    rows = row_weights(
        mask, mode, normalizer, norm_constant=norm_constant, group_ids=group_ids, delta_l_alpha=delta_l_alpha
    )
    return mask.to(torch.float64) * rows[:, None]


def weighted_sum(masked_values: Tensor, rows: Tensor, world_size: int = 1) -> Tensor:
    """Σ_i c_i Σ_t ℓ_{i,t} · world_size for `[B, T]` values already 0 at masked positions and
    `rows` = `row_weights(...)`: one pass over the tokens, in the values' dtype (no multiply by one rank)."""
    total = (masked_values.sum(dim=-1) * rows.to(masked_values.dtype)).sum()
    return total if world_size == 1 else total * world_size


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    normalizer: Normalizer | None = None,
    norm_constant: float | None = None,
    group_ids: Tensor | None = None,
    delta_l_alpha: float = 1.0,
) -> Tensor:
    """Reduce `[B, T]` per-token `values` to a scalar with `loss_agg_mode` `mode`.

    Without a `normalizer` the counts come from `mask` alone (this batch is the whole step).
    Values at masked positions (NaN and inf included) are ignored.
    """
    mask = mask.bool()
    if normalizer is None:
        normalizer = Normalizer.count(mask, group_ids=group_ids, reduce=False)
    rows = row_weights(
        mask, mode, normalizer, norm_constant=norm_constant, group_ids=group_ids, delta_l_alpha=delta_l_alpha
    )
    return weighted_sum(torch.where(mask, values, 0.0), rows, normalizer.world_size)
