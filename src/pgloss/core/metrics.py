"""Diagnostics of a loss call, computed with the loss's own mask.

Every function returns a detached 0-d tensor and never synchronises with the host, so a trainer
can collect them every micro-batch and turn them into numbers once per step. They are means (or
extremes) over this call's valid tokens. Over no valid token (an empty or all-masked call) they are
NaN: undefined, as the mean of an empty tensor, never a made-up 0 or 1. Average a step's
micro-batches with `torch.nanmean`, or weight each call's value by its token count.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor, count: Tensor | None = None) -> Tensor:
    """Σ m·x / Σ m, detached; NaN when nothing is valid. `count` = mask.sum() when known. Each term
    is divided before the sum, so a mean of finite values is finite (a float32 sum of log-ratios
    near its largest value would overflow)."""
    values = values.detach().expand_as(mask)
    count = mask.sum() if count is None else count
    total = torch.where(mask, values, 0.0).div_(count).sum()
    return torch.where(count > 0, total, torch.nan).to(values.dtype)


def masked_fraction(flags: Tensor, mask: Tensor, count: Tensor | None = None) -> Tensor:
    """Share of valid tokens where the bool `flags` hold; NaN when nothing is valid."""
    count = mask.sum() if count is None else count
    return (flags & mask).sum() / count


def masked_extremes(values: Tensor, mask: Tensor, count: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(smallest, largest) valid value, detached; NaN when nothing is valid (`count` = mask.sum()
    when known). Masked positions take +inf for the minimum and -inf for the maximum, which change
    neither extreme: two plain reductions and no index read (not an argmax over the mask viewed as
    uint8, which inductor's CUDA split reduction refused at B = 64, T = 4096)."""
    values = values.detach().expand_as(mask)
    if values.numel() == 0:  # amin and amax refuse empty tensors
        nan = values.new_full((), torch.nan)
        return nan, nan
    low = torch.where(mask, values, torch.inf).amin()
    high = torch.where(mask, values, -torch.inf).amax()
    none = ~mask.any() if count is None else count == 0
    return torch.where(none, torch.nan, low), torch.where(none, torch.nan, high)


def ratio_metrics(ratio: Tensor, token_log_ratio: Tensor, mask: Tensor, count: Tensor | None = None) -> dict[str, Tensor]:
    """ratio_mean / ratio_max / ratio_min of the ratio the loss used, and ppo_kl = mean(log π_old - log π_θ);
    `count` = mask.sum() when known."""
    count = mask.sum() if count is None else count
    low, high = masked_extremes(ratio, mask, count)
    return {
        "ppo_kl": -masked_mean(token_log_ratio, mask, count),
        "ratio_mean": masked_mean(ratio, mask, count),
        "ratio_max": high,
        "ratio_min": low,
    }


def clip_metrics(clipped_high: Tensor, clipped_low: Tensor, mask: Tensor, clipped_dual: Tensor | None = None,
                 count: Tensor | None = None) -> dict[str, Tensor]:
    """pg_clipfrac (either bound), its high / low split and, for dual clip, pg_clipfrac_lower;
    `count` = mask.sum() when known."""
    count = mask.sum() if count is None else count
    high = masked_fraction(clipped_high, mask, count)
    low = masked_fraction(clipped_low, mask, count)
    out = {"pg_clipfrac": high + low, "pg_clipfrac_high": high, "pg_clipfrac_low": low}
    if clipped_dual is not None:
        out["pg_clipfrac_lower"] = masked_fraction(clipped_dual, mask, count)
    return out
