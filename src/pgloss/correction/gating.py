"""Rollout gating on probabilities: rejections whose statistic compares p_train = exp(log π_train) with
p_rollout = exp(log π_rollout) of the sampled token, beside the ratio rules of `pgloss.correction.rejection`.

Per valid token, with π_train = π_old (decoupled mode) or sg(π_θ) (bypass mode):

    statistic   per token                                                   source
    binary_kl   p_r log(p_r / p_t) + (1 − p_r) log((1 − p_r) / (1 − p_t))   OpenRLHF `is_correction_gating="binary_kl"`
    tv          |p_r − p_t|                                                 OpenRLHF `is_correction_gating="tv"`
    diff        p_t − p_r                                                   ROLL `diff_enabled` filters

with p_r = clamp(p_rollout, 1e-6, 1 − 1e-6) and p_t = clamp(p_train, 1e-6, 1 − 1e-6) for binary_kl and tv (OpenRLHF's
clamp keeps the logs finite), the raw probabilities for diff (ROLL). At level

    token         the token's own statistic
    seq_mean      the mean over the sequence's valid tokens   (OpenRLHF `is_correction_level="seq"`, ROLL `geometric`)
    seq_sum       the sum over the sequence's valid tokens    (ROLL `sequence`)
    segment_mean  the mean over the token's segment           (ROLL `segment`)

a `Gate` keeps a token (a whole sequence, a whole segment) when lower ≤ statistic ≤ upper (either bound may be None).
A segment is a maximal run of consecutive valid tokens of the mask (a turn of a multi-turn response whose tool and
environment tokens are masked), as ROLL's `compute_segment_masked_mean` reads the response mask.

`RolloutCorrection(gates=...)` applies them as its rejections: ANDed with the ratio rules, each statistic over the
original mask, known before the step in decoupled mode (counted by `keep_mask` / `Algorithm.count_step`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.checks import check_number
from ..core.sequence_parallel import SequenceParallel, row_mean, row_sum

__all__ = ["GATE_LEVELS", "GATE_STATISTICS", "PROBABILITY_CLAMP", "Gate", "segment_mean"]

GATE_STATISTICS = ("binary_kl", "tv", "diff")
GATE_LEVELS = ("token", "seq_mean", "seq_sum", "segment_mean")
PROBABILITY_CLAMP = 1e-6
"""binary_kl and tv read probabilities clamped to [1e-6, 1 − 1e-6] (OpenRLHF `PolicyLoss.forward`)."""


@dataclass(frozen=True)
class Gate:
    """One probability gate: keep lower ≤ statistic ≤ upper, the statistic (binary_kl, tv or diff) at
    `level` (token, seq_mean, seq_sum or segment_mean). See the module docstring for the formulas."""

    statistic: str
    level: str = "token"
    upper: float | None = None
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.statistic not in GATE_STATISTICS:
            raise ValueError(f"Gate statistic must be one of {GATE_STATISTICS}, got {self.statistic!r}")
        if self.level not in GATE_LEVELS:
            raise ValueError(f"Gate level must be one of {GATE_LEVELS}, got {self.level!r}")
        upper = check_number("Gate upper", self.upper, optional=True)
        lower = check_number("Gate lower", self.lower, optional=True)
        if upper is None and lower is None:
            raise ValueError(f"Gate {self.statistic} needs a bound: upper, lower or both")
        if lower is not None and upper is not None and lower > upper:
            raise ValueError(f"Gate {self.statistic} needs lower <= upper, got lower={lower}, upper={upper}")
        if self.statistic != "diff" and upper is not None and upper < 0:
            raise ValueError(f"Gate {self.statistic} is >= 0: need upper >= 0, got {upper}")
        object.__setattr__(self, "upper", upper)
        object.__setattr__(self, "lower", lower)

    def statistic_per_token(self, train: Tensor, rollout: Tensor, mask: Tensor) -> Tensor:
        """The token statistic `[B, T]` from log π_train and log π_rollout (0 at masked positions)."""
        if self.statistic == "diff":
            stat = train.exp() - rollout.exp()
        else:
            p = rollout.exp().clamp(PROBABILITY_CLAMP, 1 - PROBABILITY_CLAMP)
            q = train.exp().clamp(PROBABILITY_CLAMP, 1 - PROBABILITY_CLAMP)
            if self.statistic == "binary_kl":
                stat = p * (p / q).log() + (1 - p) * ((1 - p) / (1 - q)).log()
            else:
                stat = (p - q).abs()
        return torch.where(mask, stat, 0.0)

    def keep(
        self, train: Tensor, rollout: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None
    ) -> Tensor:
        """Bool `[B, T]`: the tokens this gate keeps (whole rows at the sequence levels, over the whole sequence
        under a `sequence_parallel` group; whole segments at segment_mean)."""
        stat = self.statistic_per_token(train, rollout, mask)
        if self.level == "seq_sum":
            stat = row_sum(stat, sequence_parallel, keepdim=True)
        elif self.level == "seq_mean":
            stat = row_mean(stat, mask, sequence_parallel, keepdim=True)
        elif self.level == "segment_mean":
            stat = segment_mean(stat, mask, sequence_parallel)
        keep = torch.ones_like(stat, dtype=torch.bool)
        if self.upper is not None:
            keep = keep & (stat <= self.upper)
        if self.lower is not None:
            keep = keep & (stat >= self.lower)
        return keep.expand(mask.shape)


def segment_mean(values: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None) -> Tensor:
    """`[B, T]`: at each valid token the mean of `values` over its segment (the maximal run of consecutive valid
    tokens it lies in), 0 at masked positions. A segment cut by a sequence-parallel split would be read in pieces,
    so a `sequence_parallel` group is refused."""
    if sequence_parallel is not None:
        raise ValueError(
            "segment_mean (ROLL's per-turn level) reads runs of consecutive valid tokens, which a sequence-parallel "
            "split cuts: use it without sequence_parallel"
        )
    previous = torch.cat([mask.new_zeros(mask.shape[0], 1), mask], dim=-1)[:, :-1]
    segment = torch.cumsum((mask & ~previous).long(), dim=-1)  # 1, 2, ... along the row; 0 before the first
    index = (segment - 1).clamp(min=0)
    values = torch.where(mask, values, 0.0)
    totals = torch.zeros_like(values).scatter_add(-1, index, values)
    counts = torch.zeros_like(values).scatter_add(-1, index, mask.to(values.dtype))
    mean = totals.gather(-1, index) / counts.gather(-1, index).clamp(min=1)
    return torch.where(mask, mean, 0.0)
