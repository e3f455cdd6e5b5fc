"""What a rollout correction takes out of the loss's mask: KL-based rejection and off-policy sequence masking.

KL-based rejection (verl `rollout_rs`), chainable (AND, each rule's statistic over the original mask,
as verl), with k1 = -log ρ, k2 = ½(log ρ)², k3 = ρ - 1 - log ρ per token, at token level, as a
sequence's sum, mean or max, or as a segment's mean (`segment_mean`: over a maximal run of consecutive
valid tokens, a turn, as ROLL's `segment` level; `pgloss.correction.gating.segment_mean`): a `Rejection`
keeps a token (or the whole sequence, or segment) when the statistic passes; for k1 the bounds are on
exp(statistic) (a ratio π_rollout/π_train, lower defaulting to 1/upper), for k2 and k3 on the
statistic (upper only). `seq_min_k1` with `lower` = 1/H drops a sequence when any token's ρ_t > H (SkyRL
`outlier_token_is_threshold_high`); `seq_max_k1` with `upper` = 1/L and `lower` = 0+ (a tiny ratio: its default 1/upper would also drop the rows whose
every ρ_t > 1/L), when any ρ_t < L (`outlier_token_is_threshold_low`). Off-policy sequence masking (the DeepSeek-V3.2
technical report; TRL
`off_policy_mask_threshold`, ms-swift `off_policy_sequence_mask_delta`) drops sequence i when
Â_i < 0 and (1/|y_i|) Σ_t (log π_behave - sg log π_θ) > δ, π_behave = π_rollout (π_old without one).

`RolloutCorrection` (`pgloss.correction.rollout`) applies these rules: it chains the rejections and counts them in
the step's normaliser where they are known before the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.checks import check_number
from ..core.sequence_parallel import SequenceParallel, row_max, row_mean, row_sum
from .gating import segment_mean

__all__ = ["KL_STATISTICS", "REJECTION_LEVELS", "REJECTION_OPTIONS", "Rejection", "off_policy_sequence_mask"]

KL_STATISTICS = ("k1", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max", "segment_mean")
REJECTION_OPTIONS = (*(f"{level}_{k}" for level in REJECTION_LEVELS for k in KL_STATISTICS), "seq_min_k1")
"""The options; `seq_min_k1` (k1 only) bounds the sequence's smallest -log ρ, its largest ratio ρ = π_train/π_rollout."""


@dataclass(frozen=True)
class Rejection:
    """One KL-based rejection rule: `option` is `<level>_<k>` with level token, seq_sum, seq_mean,
    seq_max or segment_mean and k k1, k2 or k3 (verl's `rollout_rs` names; segment_mean: ROLL's per-turn
    level). For k1, keep lower ≤ exp(stat) ≤ upper
    (either bound may be None, lower defaults to 1/upper); for k2 and k3, keep stat ≤ upper."""

    option: str
    upper: float | None
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.option not in REJECTION_OPTIONS:
            raise ValueError(f"Rejection option must be one of {REJECTION_OPTIONS}, got {self.option!r}")
        upper = check_number("Rejection upper", self.upper, optional=True)
        lower = check_number("Rejection lower", self.lower, optional=True)
        if self.option.endswith("k1"):
            if upper is None and lower is None:
                raise ValueError(f"{self.option} needs a ratio bound: upper, lower or both")
            if upper is not None and upper <= 0 or lower is not None and lower <= 0:
                raise ValueError(f"{self.option} bounds are ratios and must be > 0, got lower={lower}, upper={upper}")
            if lower is None and upper is not None:
                lower = 1.0 / upper
            if upper is not None and lower is not None and lower > upper:
                raise ValueError(f"{self.option} needs lower <= upper, got lower={lower}, upper={upper}")
        else:
            if upper is None or upper < 0:
                raise ValueError(f"{self.option} needs upper >= 0 (a KL bound), got {upper!r}")
            if lower is not None:
                raise ValueError(f"{self.option} takes only an upper bound (k2 and k3 are >= 0), got lower={lower}")
        object.__setattr__(self, "upper", upper)
        object.__setattr__(self, "lower", lower)

    def keep(self, log_rho: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None) -> Tensor:
        """Bool `[B, T]`: the tokens this rule keeps (whole rows for the sequence levels, their statistic over
        the whole sequence under a `sequence_parallel` group)."""
        level, k = self.option.rsplit("_", 1)
        if k == "k1":
            stat = -log_rho
        elif k == "k2":
            stat = 0.5 * log_rho.square()
        else:
            stat = torch.expm1(log_rho) - log_rho
        stat = torch.where(mask, stat, 0.0)
        if level == "seq_sum":
            stat = row_sum(stat, sequence_parallel, keepdim=True)
        elif level == "seq_mean":
            stat = row_mean(stat, mask, sequence_parallel, keepdim=True)
        elif level == "seq_min":  # the smallest -log ρ_t: exp(stat) ≥ lower ⇔ every ρ_t ≤ 1/lower
            stat = -row_max(torch.where(mask, -stat, -torch.inf), sequence_parallel, keepdim=True).clamp(
                min=-torch.finfo(stat.dtype).max
            )
        elif level == "segment_mean":
            stat = segment_mean(stat, mask, sequence_parallel)
        elif level == "seq_max":
            stat = row_max(torch.where(mask, stat, -torch.inf), sequence_parallel, keepdim=True).clamp(
                min=-torch.finfo(stat.dtype).max
            )
        if k == "k1":  # bounds on the ratio, compared in log space
            keep = torch.ones_like(stat, dtype=torch.bool)
            if self.upper is not None:
                keep = keep & (stat <= math.log(self.upper))
            if self.lower is not None:
                keep = keep & (stat >= math.log(self.lower))
        else:
            assert self.upper is not None  # __post_init__: k2 and k3 require an upper bound
            keep = stat <= self.upper
        return keep.expand(mask.shape)


def off_policy_sequence_mask(
    log_prob: Tensor,
    behave_log_prob: Tensor,
    seq_advantages: Tensor,
    mask: Tensor,
    *,
    delta: float,
    sequence_parallel: SequenceParallel | None = None,
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask, bool `[B, T]`: False on the rows with Â_i < 0 and
    (1/|y_i|) Σ_t m (log π_behave - sg log π_θ) > δ (over the whole sequence under `sequence_parallel`)."""
    gap = row_mean(torch.where(mask, behave_log_prob.detach() - log_prob.detach(), 0.0), mask, sequence_parallel)
    drop = (seq_advantages < 0) & (gap > delta)
    return mask & ~drop[:, None]
