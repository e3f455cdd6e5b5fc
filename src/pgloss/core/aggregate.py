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
global counts (the step's `Normalizer`, `pgloss.core.normalizer`), so a micro-batch's loss is its exact
share of the step's loss: summing micro-batch losses gives the whole-batch loss, and so does summing
gradients. A sequence (and, for the group mode, its count n_g) is never split, since the counts are global.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import check_values, host_reads
from .normalizer import Normalizer
from .row_set import Part
from .sequence_parallel import row_lengths


def row_weights(
    mask: Tensor,
    mode: str,
    normalizer: Normalizer,
    *,
    norm_constant: float | None = None,
    group_ids: Tensor | None = None,
    delta_l_alpha: float = 1.0,
    of: str = "",
) -> Tensor:
    """c_i with w_{i,t} = m_{i,t}·c_i for `mode` (its row of `AGGREGATIONS`): every mode weighs a row's
    valid tokens alike; `[B]`, float64.

    Every denominator is clamped at 1, so an all-masked batch gives a zero loss, never NaN.
    A `normalizer` that counted fewer tokens or non-empty sequences than this call holds was counted
    on other masks (a value check: `check_counts`, its message qualified by `of`).
    """
    check_counts(mask, normalizer, of)
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
    group_tokens = normalizer.group_tokens
    if group_tokens is None:
        raise ValueError("loss_agg_mode 'group-mean-token-mean' needs a Normalizer counted with group_ids")
    groups = len(group_tokens)
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
        lambda: torch.zeros_like(group_tokens).index_add_(0, ids, mask.sum(dim=-1, dtype=torch.float64)) > group_tokens,
        lambda at: (
            f"the normalizer counted {int(group_tokens[at])} tokens in group {int(at)} "
            f"but this call holds more; count the step's Normalizer on every micro-batch's mask"
        ),
    )
    per_row = group_tokens[ids].clamp(min=1)
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
            "(Algorithm.count_step or Normalizer.count)"
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


def parts_row_weights(
    mask: Tensor,
    parts: tuple[Part, ...],
    normalizer: Normalizer,
    inputs: Mapping[str, Tensor | None],
    *,
    owner: str,
    norm_constant: float | None = None,
    group_ids: Tensor | None = None,
    delta_l_alpha: float = 1.0,
) -> Tensor:
    """c_i of a term aggregated in `parts` (`pgloss.core.row_set`): each part's rows weighed by its `mode` over
    their own counts (`normalizer.parts[rows.name]`; every row: the step's counts), `[B]`, float64. `inputs`
    holds the call's `[B]` inputs the row sets read; `owner` names the loss in a refusal."""
    rows: Tensor | None = None
    for part in parts:
        flags = True if part.rows is None else part.rows.flags(inputs.get(part.rows.input))
        if flags is False:  # the part holds no row of this call
            continue
        counts = normalizer if part.rows is None else normalizer.parts.get(part.rows.name)
        if counts is None and flags is True:  # every row, and the step did not count the set apart: all of it
            counts = normalizer
        if counts is None:
            assert part.rows is not None
            raise ValueError(
                f"{owner} needs a Normalizer counted with {part.rows.input}: the {part.rows.doc} are aggregated "
                f"over their own counts, so it needs a Normalizer that counted them apart "
                f"(algorithm.count_step(mask, ..., {part.rows.input}=...))"
            )
        held = mask if flags is True else mask & flags[:, None]
        of = "" if part.rows is None or flags is True else f" of {part.rows.doc}"
        weights = row_weights(
            held,
            part.mode,
            counts,
            norm_constant=norm_constant,
            group_ids=group_ids,
            delta_l_alpha=delta_l_alpha,
            of=of,
        )
        if flags is not True:
            weights = torch.where(flags, weights, 0.0 if rows is None else rows)
        rows = weights
    return torch.zeros(mask.shape[0], dtype=torch.float64, device=mask.device) if rows is None else rows


def check_counts(mask: Tensor, normalizer: Normalizer, of: str = "") -> None:
    """Refuse a `normalizer` that counted fewer valid tokens or non-empty sequences than the bool
    `mask` of one call holds: it was counted on other masks (say, before a token mask was applied),
    and the loss would be too large. A value check (`pgloss.checks.check_values`); `of` qualifies the
    counts in the message (" of" and the subset of rows a `Part` holds)."""
    if not host_reads(mask):
        return
    lengths = mask.sum(dim=-1)
    for what, counted, held in (
        (f"tokens{of}", normalizer.tokens, lengths.sum()),
        (f"sequences{of}", normalizer.sequences, (lengths > 0).sum()),
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
