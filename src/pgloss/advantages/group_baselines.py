"""Sequence-level estimators that subtract a baseline computed from the rewards of the row's group,
`[B]`: RLOO (leave-one-out), OPO (length-weighted mean), GPG (group mean, scaled by the batch's share
of non-zero rewards), AsymRE (the mean shifted by δ) and OPMD (the mean or τ·logavgexp)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_tensor
from ..core.checks import check_number
from ..core.distributed import all_reduce
from .group import _counted, _group_center, _group_sum, _positive, _scores, group_index, rows_of


def rloo_advantages(scores: Tensor, group_ids: Tensor, *, mask: Tensor | None = None) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740), `[B]`:

        Â_i = s_i - (1/(n-1)) Σ_{j≠i} s_j = n/(n-1) · (s_i - μ_g)

    verl `rloo`, TRL's RLOOTrainer, OpenRLHF `rloo`. A group of one gets 0 (verl leaves s_i). With
    `mask` (`[B, T]` or `[B]` row flags) a row without a valid token is not one of the others j and
    gets 0 (verl, TRL, OpenRLHF count its reward: `group.py`'s docstring)."""
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    rows = rows_of(mask, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups, rows)
    out = torch.where(size > 1, centered * size / (size - 1).clamp(min=1), 0.0)
    return (out if rows is None else torch.where(rows, out, 0.0)).to(scores.dtype)


def opo_advantages(scores: Tensor, group_ids: Tensor, lengths: Tensor) -> Tensor:
    """On-policy RL with the optimal baseline (Hao et al. 2025, arXiv 2505.23585), `[B]`:

        b_g = Σ_{i∈g} |y_i| s_i / Σ_{i∈g} |y_i|,    Â_i = s_i - b_g

    (verl `opo`; a group of one: b = 0, as verl)."""
    scores = _scores(scores)
    work = scores.to(torch.float64)
    lengths = check_tensor("lengths", lengths, ndim=(1,), floating=False)
    if lengths.shape != work.shape:
        raise ValueError(f"lengths must have shape {tuple(work.shape)}, got {tuple(lengths.shape)}")
    check_device("lengths", lengths, work.device, "scores")
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    n = lengths.to(torch.float64)
    baseline = _group_sum(n * work, index, n_groups) / _group_sum(n, index, n_groups).clamp(min=1)
    size = _group_sum(torch.ones_like(work), index, n_groups)[index]
    return (work - torch.where(size > 1, baseline[index], 0.0)).to(scores.dtype)


def gpg_advantages(
    scores: Tensor, group_ids: Tensor, *, f_norm: float = 1.0, process_group=None, reduce: bool = True
) -> Tensor:
    """GPG (Chu et al. 2025, arXiv 2504.02546): Â_i = α (s_i - μ_g) / F_norm with α = B / #{i: s_i ≠ 0}
    (the batch's share of sequences with a non-zero reward, at least one), `[B]`; verl `gpg`
    (a group of one: μ = 0). B and the count are over all ranks."""
    f_norm = _positive("f_norm", f_norm)
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups)
    centered = torch.where(size > 1, centered, work)
    counts = all_reduce(
        torch.stack([work.new_tensor(work.numel()), (work != 0).sum().to(torch.float64)]), process_group, reduce
    )
    alpha = counts[0] / counts[1].clamp(min=1)
    return (alpha * centered / f_norm).to(scores.dtype)


SINGLETONS = ("zero", "raw")


def _singleton(singleton: str) -> str:
    if singleton not in SINGLETONS:
        raise ValueError(f"singleton must be one of {SINGLETONS}, got {singleton!r}")
    return singleton


def _shifted_group_baseline(scores, group_ids, baseline_of, singleton: str, mask) -> Tensor:
    """Â_i = s_i - b_g with b_g = baseline_of(work, index, n_groups, counted) per row, over the rows
    with a valid token of `mask` (the others get 0); a group of one: Â = 0 (`singleton="zero"`) or
    Â = s (b = 0, `"raw"`, as Trinity)."""
    _singleton(singleton)
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    rows = rows_of(mask, work.shape[0], work.device)
    size = _group_sum(_counted(work, rows), index, n_groups)[index]
    out = work - baseline_of(work, index, n_groups, rows)
    out = torch.where(size > 1, out, work if singleton == "raw" else 0.0)
    return (out if rows is None else torch.where(rows, out, 0.0)).to(scores.dtype)


def asymre_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    baseline_shift: float = -0.1,
    singleton: str = "zero",
    mask: Tensor | None = None,
) -> Tensor:
    """AsymRE, asymmetric REINFORCE (Arnal et al. 2025, arXiv 2506.20520), `[B]`:

        Â_i = s_i - (μ_g + δ)

    with δ = `baseline_shift` (Trinity-RFT's default -0.1: a baseline below the group mean weights
    positive rewards more than negative ones, which keeps off-policy training stable; δ = 0 is the
    Dr.GRPO / group-mean baseline). Trinity-RFT 0.6.0 `algorithm/advantage_fn/asymre_advantage.py`.
    A group of one: Â = 0 (`singleton="zero"`, no group estimate of the mean) or Trinity's Â = s
    (baseline 0, `singleton="raw"`). With `mask` (`[B, T]` or `[B]` row flags) a row without a valid
    token leaves its group's mean and size and gets 0 (Trinity counts its reward)."""
    delta = check_number("baseline_shift", baseline_shift)

    def baseline(work, index, n_groups, counted):
        centered, _ = _group_center(work, index, n_groups, counted)
        return work - centered + delta

    return _shifted_group_baseline(scores, group_ids, baseline, singleton, mask)


OPMD_BASELINES = ("mean", "logavgexp")


def opmd_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    baseline: str = "mean",
    tau: float = 1.0,
    singleton: str = "zero",
    mask: Tensor | None = None,
) -> Tensor:
    """OPMD, online policy mirror descent (Trinity-RFT; arXiv 2509.24203 section 2.2, after Kimi k1.5,
    arXiv 2501.12599), `[B]`: Â_i = s_i - b_g with

        mean       b_g = μ_g
        logavgexp  b_g = τ · log( (1/n) Σ_{j∈g} exp(s_j / τ) )     (the mirror-descent normaliser;
                   → max_g s as τ → 0, → μ_g as τ → ∞)

    Trinity-RFT 0.6.0 `algorithm/advantage_fn/opmd_advantage.py` (`opmd_baseline`, `tau`). A group of
    one: Â = 0 (`singleton="zero"`) or Trinity's Â = s (`"raw"`). With `mask` (`[B, T]` or `[B]` row
    flags) a row without a valid token leaves its group's b_g and size and gets 0 (Trinity counts its
    reward)."""
    if baseline not in OPMD_BASELINES:
        raise ValueError(f"baseline must be one of {OPMD_BASELINES}, got {baseline!r}")
    tau = _positive("tau", tau)

    def mean(work, index, n_groups, counted):
        centered, _ = _group_center(work, index, n_groups, counted)
        return work - centered

    def logavgexp(work, index, n_groups, counted):
        weight = _counted(work, counted)
        x = torch.where(weight > 0, work / tau, -torch.inf)
        top = torch.full((n_groups,), -torch.inf, dtype=x.dtype, device=x.device).scatter_reduce(
            0, index, x, reduce="amax"
        )
        top = torch.where(top > -torch.inf, top, 0.0)  # a group without a counted row (its rows get 0)
        total = _group_sum((x - top[index]).exp(), index, n_groups)
        count = _group_sum(weight, index, n_groups)
        return (tau * (top + total.log() - count.log()))[index]

    return _shifted_group_baseline(scores, group_ids, mean if baseline == "mean" else logavgexp, singleton, mask)
