"""GVPO: Group Variance Policy Optimization (Zhang et al. 2025, https://arxiv.org/abs/2504.19599).

Within each group g (the k completions of one prompt), with the implicit reward
R_θ,i = β·Σ_t (log π_θ - log π_old) over completion i's valid tokens and its advantage Â_i (the token
mean of A):

    c_i = (R_θ,i - mean_{j∈g} sg[R_θ,j]) - (Â_i - mean_{j∈g} Â_j)
    L_g = 1/(k - 1) · Σ_{i∈g} ½ c_i²

a squared loss fitting the centred implicit rewards to the centred rewards. Its gradient,
Σ_i c_i·β·∇log π_θ(y_i)/(k - 1), has zero-sum weights over the group (Σ_i c_i = 0), which is what
cancels the partition function of the KL-constrained optimum; detaching the mean of R_θ changes
neither value nor gradient then. The loss is the mean of L_g over the step's groups (L_g copied onto
its tokens and reduced with group-mean-token-mean). π_θ' of the paper is π_old, the policy of the
previous step. A group of one contributes 0; a row without valid tokens belongs to no group.

Reference: verl-recipe `compute_policy_loss_gvpo` (gvpo/gvpo_core_algos.py), β = `gvpo_beta` = 0.1,
advantages from GRPO without the std division (run_qwen2-7b_math_gvpo.sh,
`norm_adv_by_std_in_grpo=False`). Deliberate differences: verl-recipe sums L_g over the groups of a
micro-batch and divides by the gradient-accumulation steps, which is G_mb (groups per micro-batch)
times our mean over the step's groups; it divides by the configured group size n - 1, we by the
group's valid rows k - 1 (equal for full groups); it uses Â as given, we centre it within the group
(`gvpo_center_advantages=False` for verl-recipe's form; identical for GRPO's group-centred advantages).
L_g couples the rows of group g: a call must hold every row of the groups it sees.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.output import check
from ..core.ratios import sequence_log_ratio
from .group_contrast import GroupContrast


def gvpo_group_loss(
    implicit_reward: Tensor,
    seq_advantages: Tensor,
    valid_rows: Tensor,
    group_ids: Tensor,
    *,
    center_advantages: bool = True,
) -> Tensor:
    """L_{g(i)} for every row i, `[B]` (0 for empty rows).

    Args:
        implicit_reward: R_θ,i = β·Σ_t m·δ, `[B]`, with gradient.
        seq_advantages: Â_i, `[B]`.
        valid_rows: bool `[B]`, rows with at least one valid token.
        group_ids: integer `[B]`.
        center_advantages: subtract the group mean of Â (the paper); False uses Â as given (verl-recipe).
    """
    # Row i's group as a [B, B] membership map over valid rows, so the groups need not be counted on the host.
    members = (group_ids[:, None] == group_ids[None, :]) & valid_rows[None, :] & valid_rows[:, None]
    weights = members.to(implicit_reward.dtype)
    size = weights.sum(-1)
    mean = lambda x: (weights @ x) / size.clamp(min=1)  # noqa: E731  the group mean of x, per row
    advantages = seq_advantages - mean(seq_advantages) if center_advantages else seq_advantages
    c = implicit_reward - mean(implicit_reward.detach()) - advantages
    half_squares = torch.where(valid_rows, 0.5 * c.square(), 0.0)
    loss = (weights @ half_squares) / (size - 1).clamp(min=1)
    return torch.where(valid_rows & (size > 1), loss, 0.0)


@dataclass(frozen=True, kw_only=True)
class GVPO(GroupContrast):
    """ℓ_{i,t} = L_{g(i)} (`gvpo_group_loss`): a `GroupContrast`, Σ_g L_g / N_groups over the step's groups."""

    gvpo_beta: float = 0.1
    """β, the KL coefficient of the implicit reward β·log(π_θ/π_old) (verl-recipe `gvpo_beta`)."""
    gvpo_center_advantages: bool = True
    """Centre Â within its group (the paper's R - R̄); False: Â as given (verl-recipe)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.gvpo_beta > 0, f"gvpo_beta must be > 0, got {self.gvpo_beta}")

    def group_loss(self, delta: Tensor, batch: TokenBatch, group_ids: Tensor) -> Tensor:
        implicit = self.gvpo_beta * sequence_log_ratio(
            delta, batch.mask, length_normalized=False, sequence_parallel=batch.sequence_parallel
        ).squeeze(-1)
        return gvpo_group_loss(
            implicit,
            batch.row_advantages,
            batch.valid_rows,
            group_ids,
            center_advantages=self.gvpo_center_advantages,
        )
