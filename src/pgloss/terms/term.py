"""A term of an objective: what it reads, how it is aggregated, and its per-token value.

An objective (`pgloss.Algorithm`) is its family's policy term plus the declared terms of `pgloss.terms.TERMS`
(the KL penalty, the entropy bonus, the positive-example NLL, ...), each weighed by its coefficient:

    L = Agg_policy(w · ℓ) + Σ_k c_k · Agg_k(v_k)

where w is the rollout correction's weight. A term declares the inputs it needs (`needs`: the call refuses a
call without one, naming why), the parts of its aggregation (`parts`: the rows it sums and the counts it divides
them by; the step's count counts what they declare) and its per-token value (`evaluate`). Its hyperparameters are
fields of every algorithm, declared in the term's own file by its `Options` mixin.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from torch import Tensor

from ..core.batch import TokenBatch
from ..core.metrics import Stat
from ..core.row_set import Part
from ..correction.rollout import Corrected


@dataclass(frozen=True)
class TermValue:
    """A term's value on one call: its metrics, and its per-token value (0 at masked positions) when it adds to
    the loss (None: the term only reports, as the KL with `kl_coef=0`)."""

    metrics: dict[str, Stat] = field(default_factory=dict)
    per_token: Tensor | None = None


class Term(Protocol):
    """A declared term of an objective, built from an algorithm's fields (`Options.term`)."""

    @property
    def coef(self) -> float:
        """c_k: the term adds c_k · Agg(v) to the loss (negative for a bonus)."""
        ...

    @property
    def loss_metric(self) -> str | None:
        """The metric that reports Agg(v) (a loss `Stat`), or None."""
        ...

    def needs(self) -> dict[str, str]:
        """The optional inputs the term cannot do without -> why, for the error of a call without one."""
        ...

    def parts(self) -> tuple[Part, ...] | None:
        """Its aggregation; None: the objective's own (every row, `loss_agg_mode`)."""
        ...

    def evaluate(self, batch: TokenBatch, corrected: Corrected | None) -> TermValue:
        """Its metrics and per-token value on a prepared, corrected batch."""
        ...
