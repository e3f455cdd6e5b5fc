"""The entropy bonus: - c_H · Agg(H_t), H_t = H(π_θ(·|s_t)) given with its gradient (`entropy`).

Aggregated like the policy term, over every row. The metric `entropy` reports its token mean whenever it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..core.batch import TokenBatch
from ..core.metrics import token_mean
from ..core.row_set import Part
from ..correction.rollout import Corrected
from .term import TermValue


@dataclass(frozen=True, kw_only=True)
class Options:
    """The entropy bonus's field, shared by every algorithm."""

    coef_field: ClassVar[str] = "entropy_coef"
    """The field of the term's coefficient (0: the term is off)."""

    entropy_coef: float = 0.0
    """Weight of the entropy bonus; the entropy gets a gradient only when this is non-zero."""

    def entropy_bonus(self) -> EntropyBonus:
        """The term this field configures."""
        return EntropyBonus(self.entropy_coef)


@dataclass(frozen=True)
class EntropyBonus:
    entropy_coef: float
    loss_metric: str | None = None

    @property
    def coef(self) -> float:
        return -self.entropy_coef

    def needs(self) -> dict[str, str]:
        return {"entropy": f"entropy_coef={self.entropy_coef}"} if self.entropy_coef != 0 else {}

    def parts(self) -> tuple[Part, ...] | None:
        return None

    def evaluate(self, batch: TokenBatch, corrected: Corrected | None) -> TermValue:
        if batch.entropy is None:
            return TermValue()
        metrics = {"entropy": token_mean(batch.entropy, batch.mask)}
        return TermValue(metrics, batch.entropy if self.entropy_coef != 0 else None)
