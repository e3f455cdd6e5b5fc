"""The train/rollout mismatch a rollout correction reports: verl's off-policy metrics over the valid tokens."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.metrics import Stat, masked_mean
from ..core.sequence_parallel import SequenceParallel, row_total_and_length

__all__ = ["mismatch_metrics"]


def mismatch_metrics(
    train: Tensor, rollout: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None
) -> dict[str, Stat]:
    """The train/rollout mismatch over valid tokens (verl's `compute_offpolicy_metrics`):

        rollout_kl        mean_t (log π_rollout - log π_train)          k1 of KL(π_rollout‖π_train)
        rollout_k3_kl     mean_t (ρ - 1 - log ρ)
        rollout_chi2_token  mean_t ρ² - 1;   rollout_chi2_seq  mean_i (Π_t ρ)² - 1 (log clamped at ±20)
        rollout_ppl_ratio mean_i PPL_train,i / PPL_rollout,i = mean_i exp(mean_t (log π_rollout - log π_train))
                          (the exponent clamped at ±20, as the others: finite for any finite input)

    The token means are over the call's tokens; the sequence ones over its rows with a token here, each
    row's Σ_t and mean_t over the whole sequence under `sequence_parallel` (one all-reduce).
    """
    train, rollout = train.detach(), rollout.detach()
    count = mask.sum()
    log_rho = torch.where(mask, train - rollout, 0.0)
    safe = log_rho.clamp(-20.0, 20.0)
    rows = mask.any(dim=-1)
    n_rows = rows.sum()
    seq_sum, length = row_total_and_length(log_rho, mask, sequence_parallel)
    seq_mean = seq_sum / length.clamp(min=1)
    row_mean = lambda v: torch.where(rows, v, 0.0).sum() / n_rows  # noqa: E731
    return {  # means over the tokens (count) or the non-empty rows (n_rows); m - 1 combines as m does
        "rollout_kl": Stat.mean(-masked_mean(log_rho, mask, count), count),
        "rollout_k3_kl": Stat.mean(masked_mean(torch.expm1(safe) - safe, mask, count), count),
        "rollout_chi2_token": Stat.mean(masked_mean(torch.exp(2 * safe), mask, count) - 1.0, count),
        "rollout_chi2_seq": Stat.mean(row_mean(torch.exp(2 * seq_sum.clamp(-20.0, 20.0))) - 1.0, n_rows),
        "rollout_ppl_ratio": Stat.mean(row_mean(torch.exp(-seq_mean.clamp(-20.0, 20.0))), n_rows),
    }
