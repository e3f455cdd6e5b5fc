"""OPMD: online policy mirror descent as a REINFORCE loss (Kimi k1.5, https://arxiv.org/abs/2501.12599,
§2.3.2; reread as regularised REINFORCE in Yao et al. 2025, https://arxiv.org/abs/2509.24203).

Per token (minimisation form):

    L = -A · log π_θ(y_t) / (1 + τ)

The gradient of OPMD's KL-regularised surrogate at π_θ = π_old, with τ the mirror-descent
regularisation: the 1/(1 + τ) factor scales the REINFORCE step. The regularisation enters mainly
through the advantages: A = r - b with b the group mean (Trinity's default `opmd_baseline="mean"`) or
τ·log mean_j exp(r_j/τ) ("logavgexp"), computed once per step before the loss
(`pgloss.recipe("opmd")`: no std division). Kimi k1.5's squared form of the same objective is `dro`.

Reference: Trinity-RFT 0.6.0 `OPMDPolicyLossFn` (trinity/algorithm/policy_loss_fn/opmd_policy_loss.py),
τ = 1, token-mean; its `OPMDGroupAdvantage` (advantage_fn/opmd_advantage.py) for A. Trinity divides
the aggregated loss by 1 + τ; pgloss divides each token's term, which is the same number for every
aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from .closed_form import GradientFactor


def opmd_loss(log_prob: Tensor, advantages: Tensor, *, tau: float) -> Tensor:
    """-A·log π_θ / (1 + τ) per token, `[B, T]`."""
    return -advantages * log_prob / (1.0 + tau)


@dataclass(frozen=True, kw_only=True)
class OPMD(Algorithm):
    """ℓ_{i,t} = -Â·log π_θ / (1 + τ) (`opmd_loss`)."""

    opmd_tau: float = 1.0
    """τ, OPMD's regularisation strength (Trinity `tau`); the same τ belongs in the logavgexp baseline."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.opmd_tau >= 0, f"opmd_tau must be >= 0, got {self.opmd_tau}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        metrics = ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        return PolicyTerms(opmd_loss(batch.log_prob, batch.advantages, tau=self.opmd_tau), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = 1/(1 + τ): REINFORCE scaled."""
        return GradientFactor(
            torch.full_like(batch.log_prob, 1.0 / (1.0 + self.opmd_tau)), "OPMD: f = 1/(1 + τ), REINFORCE scaled"
        )
