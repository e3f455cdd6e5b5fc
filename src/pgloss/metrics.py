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


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ m·x / Σ m, detached; NaN when nothing is valid."""
    values = values.detach().expand_as(mask)
    return (torch.where(mask, values, 0.0).sum() / mask.sum()).to(values.dtype)


def _masked_extreme(values: Tensor, mask: Tensor, largest: bool) -> Tensor:
    values = values.detach().expand_as(mask)
    if values.numel() == 0:  # amax/amin refuse empty tensors
        return values.new_full((), torch.nan)
    fill = -torch.inf if largest else torch.inf
    masked = torch.where(mask, values, fill)
    best = masked.amax() if largest else masked.amin()
    return torch.where(mask.any(), best, torch.nan)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Largest valid value, detached; NaN when nothing is valid."""
    return _masked_extreme(values, mask, largest=True)


def masked_min(values: Tensor, mask: Tensor) -> Tensor:
    """Smallest valid value, detached; NaN when nothing is valid."""
    return _masked_extreme(values, mask, largest=False)


def ratio_metrics(ratio: Tensor, token_log_ratio: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """ratio_mean / ratio_max / ratio_min of the ratio the loss used, and ppo_kl = mean(log π_old - log π_θ)."""
    return {
        "ppo_kl": masked_mean(-token_log_ratio, mask),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_max": masked_max(ratio, mask),
        "ratio_min": masked_min(ratio, mask),
    }


def clip_metrics(clipped_high: Tensor, clipped_low: Tensor, mask: Tensor, clipped_dual: Tensor | None = None) -> dict[str, Tensor]:
    """pg_clipfrac (either bound), its high / low split and, for dual clip, pg_clipfrac_lower."""
    high = clipped_high.float()
    low = clipped_low.float()
    out = {
        "pg_clipfrac": masked_mean(high + low, mask),
        "pg_clipfrac_high": masked_mean(high, mask),
        "pg_clipfrac_low": masked_mean(low, mask),
    }
    if clipped_dual is not None:
        out["pg_clipfrac_lower"] = masked_mean(clipped_dual.float(), mask)
    return out
