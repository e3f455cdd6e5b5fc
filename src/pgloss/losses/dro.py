"""DRO, Kimi-1.5's policy loss: REINFORCE with a quadratic penalty on the log-ratio
(Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement Learning with LLMs", https://arxiv.org/abs/2501.12599,
sec. 2.3.2; Direct Reward Optimization, Richemond et al. 2024, https://arxiv.org/abs/2405.19107).

Per token (minimisation form), with δ = log π_θ(y_t) - log π_old(y_t):

    L = -A · log π_θ(y_t) + (β/2) · δ²

One loss under two names:
- verl `compute_policy_loss_dro` (verl/trainer/ppo/core_algos.py, policy loss `dro`):
  -(log π·A - ½β·δ²), with β = `policy_loss.dro_beta`, which verl requires (> 0) and does not default;
- ROLL `_compute_kimi15_loss` (roll/pipeline/rlvr/actor_pg_worker.py, `pg_variant: kimi15`):
  -A·log π + ½τ·δ², τ = 0.1.
They are identical with β = τ; the default here is ROLL's 0.1.

The penalty's gradient β·δ·∇log π_θ vanishes at δ = 0, so at r = 1 the gradient is REINFORCE's.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio


def dro_loss(log_prob: Tensor, token_log_ratio: Tensor, advantages: Tensor, *, beta: float) -> Tensor:
    """-A · log π_θ + (β/2)·δ² per token, `[B, T]`."""
    return -advantages * log_prob + 0.5 * beta * token_log_ratio.square()


@dataclass(frozen=True, kw_only=True)
class DRO(Algorithm):
    """ℓ_{i,t} = -Â·log π_θ + (β/2)·δ² (`dro_loss`)."""

    dro_beta: float = 0.1
    """β of the quadratic penalty (verl `policy_loss.dro_beta`, required there; ROLL's τ = 0.1)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.dro_beta > 0, f"dro_beta must be > 0, got {self.dro_beta}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        return PolicyTerms(
            dro_loss(batch.log_prob, delta, batch.advantages, beta=self.dro_beta),
            ratio_metrics(ratio, delta, batch.mask),
        )
