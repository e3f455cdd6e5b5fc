"""A*-PO: policy optimization via the optimal advantage (Brantley et al. 2025, https://arxiv.org/abs/2505.20686).

Two stages. Offline, for each prompt x, N samples y_j ~ π_ref scored r_j give the optimal value of the
KL-regularised objective,

    V*(x) = β₁·log (1/N) Σ_j exp(r_j/β₁)                                   (`a2po_optimal_value`)

and online, one sample y_i per prompt from π_θ, scored r_i, is fitted by least squares:

    L = mean_i ( β₂·Σ_t (log π_θ(y_t) - log π_ref(y_t)) - (r_i - V*(x_i)) )²

pgloss takes the optimal advantage Â_i = r_i - V*(x_i) as the call's `advantages` (`a2po_advantages` computes it;
`[B, T]` advantages count as their mean over the row) and `ref_log_prob`; the squared error of row i is copied
onto its tokens and the step's mean over rows is `seq-mean-token-mean` (a row without a valid token leaves the
mean). The loss reads no π_old: the regression is against the reference, whatever policy sampled.

Reference: TRL 1.16 `A2POTrainer` (trl/experimental/a2po/a2po_trainer.py): `_estimate_optimal_values`
(V* = β₁·(logsumexp(r/β₁) - log N), `num_value_samples` N = 8) and `compute_loss`
(((β₂·(Σ log π_θ - Σ log π_ref)) - (r - V*))².mean()), `beta1` β₁ = 0.5, `beta2` β₂ = 1e-3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio, sequence_log_ratio
from .closed_form import GradientFactor


def a2po_optimal_value(reference_rewards: Tensor, *, beta1: float = 0.5) -> Tensor:
    """V* = β₁·log mean_j exp(r_j/β₁) over the last dimension (the N reference samples of each prompt), `[...]`."""
    if beta1 <= 0:
        raise ValueError(f"beta1 must be > 0, got {beta1}")
    n = reference_rewards.shape[-1]
    if n == 0:
        raise ValueError("reference_rewards needs at least one reference sample per prompt (last dimension)")
    return beta1 * (torch.logsumexp(reference_rewards / beta1, dim=-1) - math.log(n))


def a2po_advantages(scores: Tensor, reference_rewards: Tensor, *, beta1: float = 0.5) -> Tensor:
    """Â_i = r_i - V*(x_i), `[B]`: `scores` `[B]` of the policy's samples, `reference_rewards` `[B, N]` the rewards
    of the N reference samples of each row's prompt (`a2po_optimal_value`)."""
    if reference_rewards.dim() != 2 or reference_rewards.shape[0] != scores.shape[0]:
        raise ValueError(
            f"reference_rewards must be [B, N] with B = {scores.shape[0]} (scores), got {tuple(reference_rewards.shape)}"
        )
    return scores - a2po_optimal_value(reference_rewards, beta1=beta1)


def a2po_row_loss(implicit_reward: Tensor, seq_advantages: Tensor) -> Tensor:
    """(β₂·Σ_t log(π_θ/π_ref) - Â_i)² per row, `[B]`."""
    return (implicit_reward - seq_advantages).square()


@dataclass(frozen=True, kw_only=True)
class A2PO(Algorithm):
    """ℓ_{i,t} = (β₂·Σ_t log(π_θ/π_ref) - Â_i)² on every token of row i (`a2po_row_loss`). Needs `ref_log_prob`."""

    a2po_beta2: float = 1e-3
    """β₂, the scale of the implicit reward β₂·log(π_θ/π_ref) (TRL `beta2`); β₁ belongs to V* (`a2po_optimal_value`)."""

    required_inputs = ("ref_log_prob",)
    required_input_reasons = {
        "ref_log_prob": "log π_ref(y_t), the reference model's: A*-PO fits β₂·Σ_t log(π_θ/π_ref) to r - V*"
    }

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.a2po_beta2 > 0, f"a2po_beta2 must be > 0, got {self.a2po_beta2}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        if batch.ref_log_prob is None:
            raise ValueError(f"{self.name} regresses log(π_θ/π_ref) and needs ref_log_prob=[B, T] in the call")
        to_ref = log_ratio(batch.log_prob, batch.ref_log_prob)
        implicit = self.a2po_beta2 * sequence_log_ratio(
            to_ref, batch.mask, length_normalized=False, sequence_parallel=batch.sequence_parallel
        ).squeeze(-1)
        per_row = a2po_row_loss(implicit, batch.row_advantages)
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        metrics = ratio_metrics(ratio, delta, batch.mask)
        metrics["a2po_implicit_reward"] = token_mean(implicit.detach()[:, None], batch.valid_rows[:, None])  # over rows
        return PolicyTerms(per_row[:, None].expand_as(delta), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        return GradientFactor(None, "A*-PO: a least-squares fit of β₂·log(π_θ/π_ref) to Â, not a factor of Â")
