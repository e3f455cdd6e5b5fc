"""REAL: a group-contrastive loss on sequence log-ratios (ms-swift `loss_type="real"`,
https://arxiv.org/abs/2602.05630).

Within each group (the completions of one prompt), with S_i = Σ_t m δ / |y_i| the mean log-ratio
δ = log π_θ - log π_old of completion i, P = {i: Â_i > 0}, N = {i: Â_i ≤ 0} and a temperature τ:

    L_g = log(1 + Σ_{i∈N} e^{S_i/τ}) + log(1 + Σ_{i∈P} e^{-S_i/τ})

a softplus-like push of positive completions up and negative ones down, relative to π_old.
A group without both a positive and a negative member gives L_g = 0 (it still counts). The loss is
the mean of L_g over the step's groups: L_g is copied onto its tokens and reduced with
group-mean-token-mean. Â_i is the sequence advantage (the token mean for `[B, T]` advantages).
Default τ = `real_tau` = 0.5. Both sums use logsumexp with a zero term: stable for any S.

Reference: ms-swift `GRPOTrainer._compute_loss_and_metrics`, branch `real`
(swift/rlhf_trainers/grpo_trainer.py). Deliberate differences: groups come from `group_ids` rather
than consecutive blocks of `num_generations` rows; a row with no valid token belongs to no set;
ms-swift divides by the number of groups of its micro-batch, we by the step's non-empty groups.
L_g couples the rows of group g: a call must hold every row of the groups it sees.

There is no REINFORCE identity at r = 1: the gradient of L_g there is
(1/τ)·[σ-weights of N]·∇S - (1/τ)·[σ-weights of P]·∇S, not -A·∇log π.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.output import check
from ..core.ratios import sequence_log_ratio
from .group_contrast import GroupContrast


def real_group_loss(
    seq_log_ratio: Tensor, seq_advantages: Tensor, valid_rows: Tensor, group_ids: Tensor, *, tau: float
) -> Tensor:
    """L_{g(i)} for every row i, `[B]` (0 for a group without both signs, and for empty rows).

    Args:
        seq_log_ratio: S_i = mean_t δ over the valid tokens, `[B]`, with gradient.
        seq_advantages: Â_i, `[B]`.
        valid_rows: bool `[B]`, rows with at least one valid token.
        group_ids: integer `[B]`.
        tau: τ > 0.
    """
    # Row i's group as a [B, B] membership map, so the groups need not be counted on the host.
    members = group_ids[:, None] == group_ids[None, :]
    scaled = seq_log_ratio / tau
    positive = valid_rows & (seq_advantages > 0)
    negative = valid_rows & (seq_advantages <= 0)
    neg_in = torch.where(members & negative, scaled, -torch.inf)
    pos_in = torch.where(members & positive, -scaled, -torch.inf)
    zero = scaled.new_zeros(scaled.shape[0], 1)
    loss = torch.logsumexp(torch.cat([neg_in, zero], 1), 1) + torch.logsumexp(torch.cat([pos_in, zero], 1), 1)
    both = (members & positive).any(1) & (members & negative).any(1)
    return torch.where(valid_rows & both, loss, 0.0)


@dataclass(frozen=True, kw_only=True)
class REAL(GroupContrast):
    """ℓ_{i,t} = L_{g(i)} (`real_group_loss`): a `GroupContrast`, Σ_g L_g / N_groups over the step's groups."""

    real_tau: float = 0.5
    """τ, the temperature of the sequence scores (ms-swift `real_tau`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.real_tau > 0, f"real_tau must be > 0, got {self.real_tau}")

    def group_loss(self, delta: Tensor, batch: TokenBatch, group_ids: Tensor) -> Tensor:
        seq = sequence_log_ratio(
            delta, batch.mask, length_normalized=True, sequence_parallel=batch.sequence_parallel
        ).squeeze(-1)
        return real_group_loss(seq, batch.row_advantages, batch.valid_rows, group_ids, tau=self.real_tau)
