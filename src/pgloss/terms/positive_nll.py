"""VAPO's positive-example NLL (arXiv 2504.05118, eq. 10; NeMo-RL `positive_example_nll_weight`):

    + μ · ( -Σ_{i: s_i > 0} Σ_t m_{i,t} log π_θ(y_{i,t}) / N_rew )

the token mean of the NLL over the step's rewarded sequences (score > 0), N_rew their valid tokens over the whole
step (every micro-batch and rank): one `Part`, token-mean over the rows of `REWARDED`, counted apart by the step's
count. Needs `scores`; `positive_nll_loss` reports the aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.batch import TokenBatch
from ..core.output import check
from ..core.row_set import Part, RowSet
from ..correction.rollout import Corrected
from .term import TermValue

REWARDED = RowSet("rewarded", "scores", "rewarded sequences", lambda scores: scores > 0)
"""The rows whose sequence reward is > 0."""


@dataclass(frozen=True, kw_only=True)
class Options:
    """The positive-example NLL's field, shared by every algorithm."""

    coef_field: ClassVar[str] = "positive_nll_coef"
    """The field of the term's coefficient (0: the term is off)."""

    positive_nll_coef: float = 0.0
    """μ of VAPO's positive-example NLL (arXiv 2504.05118, eq. 10; NeMo-RL `positive_example_nll_weight`):
    + μ·(-Σ_{i: s_i>0} Σ_t m log π / N_rew), N_rew the step's tokens of rewarded sequences; needs `scores`."""

    def positive_nll(self) -> PositiveNLL:
        """The term this field configures (its check runs here)."""
        check(self.positive_nll_coef >= 0, f"positive_nll_coef must be >= 0, got {self.positive_nll_coef}")
        return PositiveNLL(self.positive_nll_coef)


@dataclass(frozen=True)
class PositiveNLL:
    coef: float
    loss_metric: str = "positive_nll_loss"

    def needs(self) -> dict[str, str]:
        if self.coef == 0:
            return {}
        return {
            "scores": f"[B], the sequence rewards: positive_nll_coef={self.coef} trains on the rewarded "
            "(reward > 0) sequences"
        }

    def parts(self) -> tuple[Part, ...] | None:
        return (Part("token-mean", REWARDED),) if self.coef != 0 else ()

    def evaluate(self, batch: TokenBatch, corrected: Corrected | None) -> TermValue:
        if self.coef == 0:
            return TermValue()
        return TermValue({}, torch.where(batch.mask, -batch.log_prob, 0.0))
