"""The diagnostics against plain computations over the valid tokens."""

import math

import pytest
import torch

from pgloss.core.metrics import (
    clip_metrics,
    masked_extremes,
    masked_fraction,
    masked_fractions,
    masked_mean,
    ratio_metrics,
)


@pytest.mark.parametrize("seed", range(5))
def test_masked_statistics_equal_those_of_the_valid_values(seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(6, 9, generator=gen, dtype=torch.float64)
    mask = torch.rand(6, 9, generator=gen) > 0.5
    mask[0, 0] = False  # the first position masked: its value must not leak into the extremes
    values[~mask] = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64).repeat(60)[: int((~mask).sum())]
    valid = values[mask]
    assert masked_mean(values, mask).item() == pytest.approx(valid.mean().item(), rel=1e-12)
    for count in (None, mask.sum()):
        low, high = masked_extremes(values, mask, count)
        assert (low.item(), high.item()) == (valid.min().item(), valid.max().item())
    flags = torch.rand(6, 9, generator=gen) > 0.3
    assert masked_fraction(flags, mask).item() == pytest.approx(flags[mask].double().mean().item())


@pytest.mark.parametrize("empty", [False, True])
def test_stacked_fractions_are_each_flags_own_fraction(empty):
    """`masked_fractions` (one count for several flags, as `clip_metrics` takes them) gives each flag's
    `masked_fraction` exactly, a `[B, 1]` flag broadcast over its row's tokens, NaN over no valid token."""
    gen = torch.Generator().manual_seed(3)
    mask = torch.zeros(5, 7, dtype=torch.bool) if empty else torch.rand(5, 7, generator=gen) > 0.4
    flags = (torch.rand(5, 7, generator=gen) > 0.5, torch.rand(5, 1, generator=gen) > 0.5, mask.clone())
    shares = masked_fractions(flags, mask)
    assert shares.shape == (3,)
    for share, flag in zip(shares, flags, strict=True):
        expected = (flag.expand_as(mask)[mask].sum() / mask.sum()).item()
        assert share.item() == expected or (math.isnan(expected) and math.isnan(share.item()))
        own = masked_fraction(flag, mask).item()
        assert share.item() == own or (empty and math.isnan(own) and math.isnan(share.item()))


def test_sequence_values_broadcast_over_their_tokens():
    ratio = torch.tensor([[0.5], [2.0], [7.0]])
    mask = torch.tensor([[True, True, False], [False, False, False], [True, False, False]])
    out = {k: stat.value for k, stat in ratio_metrics(ratio, torch.zeros(3, 3), mask).items()}
    assert out["ratio_max"].item() == 7.0 and out["ratio_min"].item() == 0.5  # row 1 has no valid token
    assert out["ratio_mean"].item() == pytest.approx((0.5 + 0.5 + 7.0) / 3)


def test_no_valid_token_gives_nan_everywhere():
    for mask in (
        torch.zeros(2, 3, dtype=torch.bool),
        torch.zeros(0, 3, dtype=torch.bool),
        torch.zeros(2, 0, dtype=torch.bool),
    ):
        values = torch.ones(mask.shape)
        metrics = ratio_metrics(values, values, mask) | clip_metrics(mask, mask, mask, mask)
        assert all(torch.isnan(stat.value) and stat.weight == 0 for stat in metrics.values()), metrics
