"""Subsets of a step's rows that a term aggregates over with counts of their own.

A term's value is aggregated in `Part`s: each part holds the rows of one `RowSet` (None: every row) and divides
them by that subset's counts with its own `loss_agg_mode`. The plain objective has one part, every row with
`loss_agg_mode`; a term that trains on a subset (the positive-example NLL on the rewarded sequences) or a policy
term that treats two kinds of rows apart (on-policy and demonstration rows) declares its parts, and the step's
count (`Algorithm.count_step`) counts each declared `RowSet` apart (`Normalizer.parts`). Nothing else in the
core knows which subsets exist: each is declared beside the term that reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class RowSet:
    """The rows chosen by a `[B]` optional input of the call (`input`): `select(value)` gives their bool flags.
    When the call (or the step's count) has no such input, the set holds every row (`absent=True`) or none."""

    name: str
    """The key of its counts in `Normalizer.parts`."""
    input: str
    """The `[B]` optional input that chooses the rows (a name of `pgloss.core.inputs.OPTIONAL_INPUTS`)."""
    doc: str
    """What the rows are, for messages ("rewarded sequences")."""
    select: Callable[[Tensor], Tensor]
    """The input's values -> the bool `[B]` flags of the rows in the set."""
    absent: bool = False
    """The rows it holds when the input is not given: every row (True) or none (False)."""

    def flags(self, value: Tensor | None) -> Tensor | bool:
        """The bool `[B]` flags of the rows in the set, or `absent` when `value` is None."""
        return self.absent if value is None else self.select(value)


@dataclass(frozen=True)
class Part:
    """One share of a term's aggregation: the rows of `rows` (None: every row) aggregated with `mode` over their
    own counts. `field` is the option that chose `mode`, for messages."""

    mode: str
    rows: RowSet | None = None
    field: str = "loss_agg_mode"
