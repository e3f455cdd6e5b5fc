"""Diagnostics of a loss call, computed with the loss's own mask.

Every function returns a detached 0-d tensor and never synchronises with the host, so a trainer
can collect them every micro-batch and turn them into numbers once per step. They are means over
this call's valid tokens; an all-masked call gives 0, not NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Σ m·x / max(Σ m, 1), detached."""
    values = values.detach().expand_as(mask)
    return (torch.where(mask, values, 0.0).sum() / mask.sum().clamp(min=1)).to(values.dtype)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Largest valid value (0 when nothing is valid), detached."""
    values = values.detach().expand_as(mask)
    best = torch.where(mask, values, -torch.inf).amax()
    return torch.where(mask.any(), best, 0.0)


def masked_min(values: Tensor, mask: Tensor) -> Tensor:
    """Smallest valid value (0 when nothing is valid), detached."""
    values = values.detach().expand_as(mask)
    best = torch.where(mask, values, torch.inf).amin()
    return torch.where(mask.any(), best, 0.0)


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
