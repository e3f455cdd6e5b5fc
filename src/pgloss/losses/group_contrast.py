"""The shape REAL and GVPO share: a loss L_g per group of completions (the rows of one prompt), copied
onto the group's tokens and reduced with group-mean-token-mean, so the step's loss is Σ_g L_g / N_groups.

L_g couples the rows of group g: a call must hold every row of the groups it sees (`couples_rows`),
and the call needs `group_ids`. A family says how its L_g comes from the per-token log-ratio
δ = log π_θ - log π_old and the sequence advantages Â_i (`group_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics
from ..core.output import PolicyTerms
from ..core.ratios import importance_ratio, log_ratio


@dataclass(frozen=True, kw_only=True)
class GroupContrast(Algorithm):
    """ℓ_{i,t} = L_{g(i)} (`group_loss`), reduced with group-mean-token-mean. Needs `group_ids`."""

    loss_agg_mode: str = "group-mean-token-mean"

    couples_rows = True
    required_inputs = ("group_ids",)
    required_input_reasons = {"group_ids": "[B], its loss contrasts the rows of a group"}

    @property
    def fixed_agg_mode(self) -> str | None:
        return "group-mean-token-mean"

    def group_loss(self, delta: Tensor, batch: TokenBatch, group_ids: Tensor) -> Tensor:
        """L_{g(i)} for every row i, `[B]`, from δ `[B, T]` (with gradient), the batch and its `group_ids`
        (`batch.group_ids`, checked present)."""
        raise NotImplementedError

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        if batch.group_ids is None:
            raise ValueError(f"{self.name} contrasts the completions of a prompt and needs group_ids=[B] in the call")
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        per_row = self.group_loss(delta, batch, batch.group_ids)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        return PolicyTerms(per_row[:, None].expand_as(delta), ratio_metrics(ratio, delta, batch.mask))
