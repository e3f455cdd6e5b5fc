"""sPPO: the policy gradient on the log-ratio, kept inside a ratio band (arXiv 2108.05828, as cited by
Trinity-RFT's `sPPOPolicyLossFn`).

Per token (minimisation form), with δ = log π_θ - log π_old and r = e^δ:

    L = -A · δ · 1[1/(1 + ε) ≤ r ≤ 1 + ε]

Inside the band the gradient is REINFORCE's -A·∇log π_θ (no ratio weight), outside it is zero. The
band is symmetric in log space: |δ| ≤ log(1 + ε).

Reference: Trinity-RFT 0.6.0 `sPPOPolicyLossFn` (trinity/algorithm/policy_loss_fn/sppo_loss_fn.py),
ε = 0.3, token-mean, with OPMD's advantages (`sPPOAlgorithm`: advantage_fn "opmd", no std division).
Trinity's docstring writes the objective as A·log clip(r, 1/(1+ε), 1+ε); its code (followed here)
zeroes the out-of-band tokens instead. Both give the same gradient; their values differ by
A·log(1 + ε) on each out-of-band token.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import clip_metrics, ratio_metrics
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from .closed_form import GradientFactor


def sppo_band(ratio: Tensor, *, epsilon: float) -> Tensor:
    """1[1/(1+ε) ≤ r ≤ 1+ε], bool `[B, T]` (r read detached)."""
    r = ratio.detach()
    return (r >= 1.0 / (1.0 + epsilon)) & (r <= 1.0 + epsilon)


def sppo_loss(token_log_ratio: Tensor, advantages: Tensor, inside: Tensor) -> Tensor:
    """-A·δ·1[inside] per token, `[B, T]`."""
    return -advantages * token_log_ratio * inside.to(token_log_ratio.dtype)


@dataclass(frozen=True, kw_only=True)
class SPPO(Algorithm):
    """ℓ_{i,t} = -Â·(log π_θ - log π_old)·1[1/(1+ε) ≤ r ≤ 1+ε] (`sppo_loss`)."""

    sppo_epsilon: float = 0.3
    """ε: tokens with r outside [1/(1+ε), 1+ε] get no gradient (Trinity `epsilon`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.sppo_epsilon > 0, f"sppo_epsilon must be > 0, got {self.sppo_epsilon}")

    def _band(self, batch: TokenBatch) -> tuple[Tensor, Tensor, Tensor]:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        return delta, ratio, sppo_band(ratio, epsilon=self.sppo_epsilon)

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta, ratio, inside = self._band(batch)
        r = ratio.detach()
        metrics = clip_metrics(r > 1.0 + self.sppo_epsilon, r < 1.0 / (1.0 + self.sppo_epsilon), batch.mask)
        metrics |= ratio_metrics(ratio, delta, batch.mask)
        return PolicyTerms(sppo_loss(delta, batch.advantages, inside), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = 1 inside the band, 0 outside."""
        _, _, inside = self._band(batch)
        return GradientFactor(inside.to(batch.log_prob.dtype), "sPPO: f = 1[1/(1+ε) ≤ r ≤ 1+ε]")
