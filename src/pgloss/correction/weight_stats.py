"""The statistics of a rollout correction's weight: its metrics over a call's tokens or sequences, a row's largest
value (a sequence weight is the same on each of its tokens), and the mean of a step's (Σ w, n) sums."""

from __future__ import annotations

from torch import Tensor

from ..core.metrics import Stat, effective_sample_size, token_extremes, token_mean


def mean_of(totals: Tensor) -> Tensor:
    """Σ w / max(n, 1) of a (Σ w, n) pair."""
    return totals[0] / totals[1].clamp(min=1)


def row_max(values: Tensor) -> Tensor:
    """Each row's largest value, `[B, 1]` (0 for rows of width 0)."""
    if values.shape[-1] == 0:
        return values.new_zeros(values.shape[0], 1)
    return values.amax(dim=-1, keepdim=True)


def weight_metrics(weight: Tensor, mask: Tensor, *, per_sequence: bool) -> dict[str, Stat]:
    """min / mean / max of the weight and its effective sample size (Σw)² / (n Σw²) ∈ (0, 1], over valid tokens,
    or over non-empty sequences for a per-sequence weight. NaN over nothing."""
    if per_sequence:
        mask = mask.any(dim=-1, keepdim=True)
        weight = row_max(weight)  # one value per row (0 at masked positions, w >= 0)
    count = mask.sum()
    low, high = token_extremes(weight, mask, count)
    return {
        "rollout_is_weight_min": low,
        "rollout_is_weight_mean": token_mean(weight, mask, count),
        "rollout_is_weight_max": high,
        "rollout_is_ess": effective_sample_size(weight, mask, count),
    }
