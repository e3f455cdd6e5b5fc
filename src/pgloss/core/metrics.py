"""Diagnostics of a loss call, computed with the loss's own mask, and how a step combines them.

Every value is a detached 0-d tensor and never synchronises with the host, so a trainer can collect
them every micro-batch and turn them into numbers once per step. They are means (or extremes) over
this call's valid tokens. Over no valid token (an empty or all-masked call) they are NaN: undefined,
as the mean of an empty tensor, never a made-up 0 or 1.

Each metric is built as a `Stat`: its value with what it averages over (its weight) and how a step
combines it (`reduce`). `pgloss.StepMetrics` reads them to give a step's metrics over micro-batches
and ranks; a metric cannot be made without saying how it reduces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

MEAN, MAX, MIN, LOSS = "mean", "max", "min", "loss"
REDUCTIONS = (MEAN, MAX, MIN, LOSS)
"""How a step combines a metric over its calls (`Stat.reduce`)."""


@dataclass(frozen=True)
class Stat:
    """One metric of one loss call and how a step combines it over micro-batches and ranks (`pgloss.StepMetrics`).

    `reduce`:
      "mean"      Σ_k w_k·x_k / Σ_k w_k over the calls k, `weight` w_k the tokens (or rows) x_k is a mean over;
                  a call with w_k = 0 (its x_k is NaN) adds nothing, and the step is NaN over no weight at all.
                  A metric that is a function f of such means (the effective sample size E[w]²/E[w²]) carries
                  the means as `parts` and f as `finish`: the step's value is f of the step's means.
      "max", "min"  the extreme over the calls with `weight` (their count of valid tokens or rows) > 0; NaN
                  over none.
      "loss"      Σ_k x_k over micro-batches, averaged over ranks: a term of the loss (`pg_loss`, `kl_loss`),
                  whose step value is the loss the step's gradient is the gradient of (micro-batch gradients
                  accumulate, DDP averages over ranks), when every call was given the step's `Normalizer`.
    """

    value: Tensor
    reduce: str
    weight: Tensor | None = None
    parts: tuple[Tensor, ...] | None = None
    finish: Callable[..., Tensor] | None = None

    @classmethod
    def mean(
        cls,
        value: Tensor,
        weight: Tensor,
        parts: tuple[Tensor, ...] | None = None,
        finish: Callable[..., Tensor] | None = None,
    ) -> Stat:
        """A mean over `weight` tokens or rows (`finish(*parts)` when it is a function of the means `parts`)."""
        return cls(value, MEAN, weight, parts, finish)

    @classmethod
    def max(cls, value: Tensor, count: Tensor) -> Stat:
        """The largest of `count` values (NaN when `count` is 0)."""
        return cls(value, MAX, count)

    @classmethod
    def min(cls, value: Tensor, count: Tensor) -> Stat:
        """The smallest of `count` values (NaN when `count` is 0)."""
        return cls(value, MIN, count)

    @classmethod
    def loss(cls, value: Tensor) -> Stat:
        """A term of the loss: summed over micro-batches, averaged over ranks."""
        return cls(value.detach(), LOSS)


def masked_mean(values: Tensor, mask: Tensor, count: Tensor | None = None) -> Tensor:
    """Σ m·x / Σ m, detached, in the values' dtype; NaN when nothing is valid. `count` = mask.sum() when
    known. Each term is divided before the sum, so a mean of finite values is finite (a float32 sum of
    log-ratios near its largest value would overflow)."""
    values = values.detach().expand_as(mask)
    if values.numel() == 0:  # the sum of nothing is 0, not NaN: the one case that needs its own answer
        return values.new_full((), torch.nan)
    count = mask.sum() if count is None else count
    # Over no valid position every term is 0/0, so the sum is NaN already: no guard on `count` to launch.
    return torch.where(mask, values, 0.0).div_(count).sum()


def masked_fraction(flags: Tensor, mask: Tensor, count: Tensor | None = None) -> Tensor:
    """Share of valid tokens where the bool `flags` hold; NaN when nothing is valid."""
    count = mask.sum() if count is None else count
    return (flags & mask).sum() / count


def masked_fractions(flags: Sequence[Tensor], mask: Tensor, count: Tensor | None = None) -> Tensor:
    """`masked_fraction` of each of the bool `flags`, `[len(flags)]`: the flags stacked, one `&`, one
    count and one division for all of them (the same integer counts, so the same values)."""
    count = mask.sum() if count is None else count
    *stacked, mask = torch.broadcast_tensors(*flags, mask)
    return (torch.stack(stacked) & mask).sum(dim=tuple(range(1, mask.ndim + 1))) / count


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
    some = mask.any() if count is None else count > 0
    both = torch.where(some, torch.stack((low, high)), torch.nan)  # one guard for the two
    return both[0], both[1]


def token_mean(values: Tensor, mask: Tensor, count: Tensor | None = None) -> Stat:
    """`masked_mean` as a step metric: a mean over the valid positions (tokens; rows for a `[B, 1]` mask),
    `count` = mask.sum() when known."""
    count = mask.sum() if count is None else count
    return Stat.mean(masked_mean(values, mask, count), count)


def token_fraction(flags: Tensor, mask: Tensor, count: Tensor | None = None) -> Stat:
    """`masked_fraction` as a step metric: a share of the valid tokens."""
    count = mask.sum() if count is None else count
    return Stat.mean(masked_fraction(flags, mask, count), count)


def token_extremes(values: Tensor, mask: Tensor, count: Tensor | None = None) -> tuple[Stat, Stat]:
    """`masked_extremes` as step metrics: (smallest, largest) valid value."""
    count = mask.sum() if count is None else count
    low, high = masked_extremes(values, mask, count)
    return Stat.min(low, count), Stat.max(high, count)


def effective_sample_size(weight: Tensor, mask: Tensor, count: Tensor | None = None) -> Stat:
    """Kish's effective sample size as a share of the sample, (Σw)² / (n Σw²) = E[w]² / E[w²] ∈ (0, 1] over the
    valid positions; it carries E[w] and E[w²], so that a step's is that of the step's weights."""
    count = mask.sum() if count is None else count
    mean, square = masked_mean(weight, mask, count), masked_mean(weight.square(), mask, count)
    return Stat.mean(_share(mean, square), count, parts=(mean, square), finish=_share)


def _share(mean: Tensor, square_mean: Tensor) -> Tensor:
    """E[w]² / E[w²] from the two means."""
    return mean.square() / square_mean


def ratio_metrics(ratio: Tensor, token_log_ratio: Tensor, mask: Tensor, count: Tensor | None = None) -> dict[str, Stat]:
    """ratio_mean / ratio_max / ratio_min of the ratio the loss used, and ppo_kl = mean(log π_old - log π_θ);
    `count` = mask.sum() when known."""
    count = mask.sum() if count is None else count
    low, high = token_extremes(ratio, mask, count)
    return {
        "ppo_kl": Stat.mean(-masked_mean(token_log_ratio, mask, count), count),
        "ratio_mean": token_mean(ratio, mask, count),
        "ratio_max": high,
        "ratio_min": low,
    }


def clip_metrics(
    clipped_high: Tensor,
    clipped_low: Tensor,
    mask: Tensor,
    clipped_dual: Tensor | None = None,
    count: Tensor | None = None,
) -> dict[str, Stat]:
    """pg_clipfrac (either bound), its high / low split and, for dual clip, pg_clipfrac_lower;
    `count` = mask.sum() when known."""
    count = mask.sum() if count is None else count
    flags = (clipped_high, clipped_low) + (() if clipped_dual is None else (clipped_dual,))
    shares = masked_fractions(flags, mask, count)
    high, low = shares[0], shares[1]
    out = {
        "pg_clipfrac": Stat.mean(high + low, count),
        "pg_clipfrac_high": Stat.mean(high, count),
        "pg_clipfrac_low": Stat.mean(low, count),
    }
    if clipped_dual is not None:
        out["pg_clipfrac_lower"] = Stat.mean(shares[2], count)
    return out
