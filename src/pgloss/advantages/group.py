"""GRPO's group-relative advantages and the group statistics every estimator shares.

`grpo_advantages` is the one implementation of the group advantage (s - μ_g)/(σ_g + ε), with each
framework's std convention by name; `group_advantages` is pgloss's convention of it (and Dr.GRPO's
unscaled form). DAPO's sampling-side rules, dynamic sampling and the overlong penalty, sit beside it.

GRPO's std conventions differ between frameworks (docs/reference.md has the table):

    name       std                 ε      a group of one
    pgloss     Bessel (n - 1)      1e-6   Â = 0 (no relative signal)
    verl       Bessel              1e-6   μ = 0, σ = 1: Â = s / (1 + ε)
    trl        Bessel (nanstd)     1e-4   Â = 0 (σ = 0, s - μ = 0)
    ms-swift   Bessel (torch.std)  1e-4   Â = 0
    openrlhf   Bessel (torch.std)  1e-9   undefined there (NaN); 0 here

Statistics over the whole batch (TRL's batch std) are global: with `process_group` (or the default
group, when torch.distributed is initialised and `reduce=True`) they are all-reduced.

Rows without a sampled token. An estimator that reads rewards per group takes the step's `mask`
(`[B, T]`, or `[B]` row flags): a row with no valid token is then left out of its group's statistics
(count, mean, std, baseline) and gets Â = 0, as prime-rl, which scores only the traces that hold
sampled tokens (`iter_trainable_traces`). verl, TRL, ms-swift, OpenRLHF, SkyRL and Trinity-RFT count
such a row's reward in its group (and give it 0 through the mask); their named conventions do the same
(`StdConvention.counts_empty_rows`). Without a mask every row counts. One group, rewards [1, 0, 0],
the third row empty: GRPO (pgloss) [0.707, -0.707, 0] against verl's [1.155, -0.577, 0].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from ..core.checks import check_flag, check_number, is_integer
from ..core.distributed import all_reduce


@dataclass(frozen=True)
class StdConvention:
    """How a framework divides GRPO's centred scores: (s - μ_g) / (σ_g + eps)."""

    bessel: bool
    """σ with n - 1 (torch.std's default) rather than n."""
    eps: float
    """Added to σ."""
    singleton: str
    """A group of one: 'zero' (Â = 0) or 'raw' (μ = 0, σ = 1, as verl)."""
    counts_empty_rows: bool = False
    """Given a mask: whether a row without a valid token still counts in its group's statistics (its
    trainer counts every reward) or is left out (pgloss, prime-rl); it gets Â = 0 either way."""


STD_CONVENTIONS = {
    "pgloss": StdConvention(bessel=True, eps=1e-6, singleton="zero"),
    "verl": StdConvention(bessel=True, eps=1e-6, singleton="raw", counts_empty_rows=True),
    "trl": StdConvention(bessel=True, eps=1e-4, singleton="zero", counts_empty_rows=True),
    "ms-swift": StdConvention(bessel=True, eps=1e-4, singleton="zero", counts_empty_rows=True),
    "openrlhf": StdConvention(bessel=True, eps=1e-9, singleton="zero", counts_empty_rows=True),
}


SCALES = ("group", "batch", "none")


def _scores(scores: object, name: str = "scores") -> Tensor:
    scores = check_tensor(name, scores, ndim=(1,))
    return scores.detach()


def _positive(name: str, value: object) -> float:
    """A hyperparameter that must be a finite real > 0 (an ε that keeps a division finite, a scale)."""
    value = check_number(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _group_sum(values: Tensor, index: Tensor, n_groups: int) -> Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, index, values)


def _check_convention(convention: str) -> StdConvention:
    if convention not in STD_CONVENTIONS:
        raise ValueError(f"convention must be one of {tuple(STD_CONVENTIONS)}, got {convention!r}")
    return STD_CONVENTIONS[convention]


def _counted(work: Tensor, counted: Tensor | None) -> Tensor:
    """Each row's weight in its group's statistics: 1, or 0 for a row left out (`counted` False)."""
    return torch.ones_like(work) if counted is None else counted.to(work.dtype)


def _group_center(work: Tensor, index: Tensor, n_groups: int, counted: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(s - μ_g, group sizes per row), over the rows `counted` (bool `[B]`; None: all)."""
    weight = _counted(work, counted)
    count = _group_sum(weight, index, n_groups)
    mean = _group_sum(torch.where(weight > 0, work, 0.0), index, n_groups) / count.clamp(min=1)
    return work - mean[index], count[index]


def rows_of(mask: object, n: int, device: torch.device, reference: str = "scores") -> Tensor | None:
    """The rows that hold a sampled token, bool `[n]`, from the step's `[n, T]` token mask (bool or 0/1)
    or `[n]` row flags; None when `mask` is None (every row counts)."""
    if mask is None:
        return None
    mask = check_tensor("mask", mask, ndim=(1, 2), floating=False)
    token = mask if mask.ndim == 2 else mask[:, None]
    if token.shape[0] != n:
        raise ValueError(f"mask must have {n} rows (one per score), got shape {tuple(mask.shape)}")
    return check_mask(token, token.shape, device, reference).any(dim=-1)


def _std(centered_sq_sum: Tensor, count: Tensor, bessel: bool) -> Tensor:
    return (centered_sq_sum / (count - 1 if bessel else count).clamp(min=1)).sqrt()


def group_index(
    group_ids: object, n: int, device: torch.device, reference: str = "scores", *, name: str = "group_ids"
) -> tuple[Tensor, int]:
    """The `[n]` integer `group_ids` renumbered 0..G-1 in id order, and G. Advantages are computed
    once per step, before the loss: reading G on the host is their one sync. `name` is the argument's
    name in the errors (the multi-step estimators number episodes and states with it too)."""
    ids = check_tensor(name, group_ids, ndim=(1,), floating=False)
    if ids.shape[0] != n or not is_integer(ids):
        raise ValueError(f"{name} must be integers of shape [{n}], got {ids.dtype} {tuple(ids.shape)}")
    check_device(name, ids, device, reference)
    _, index = torch.unique(ids, return_inverse=True)
    return index, (int(index.max()) + 1 if n else 0)


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    convention: str = "pgloss",
    scale: str = "group",
    mask: Tensor | None = None,
    process_group: dist.ProcessGroup | None = None,
    reduce: bool = True,
) -> Tensor:
    """GRPO's group-relative advantage (Shao et al. 2024, arXiv 2402.03300) with a framework's
    std convention (`STD_CONVENTIONS`), `[B]`:

        group  Â_i = (s_i - μ_g) / (σ_g + ε)                      GRPO; verl, TRL `scale_rewards="group"`
        batch  Â_i = (s_i - μ_g) / (σ_batch(s) + ε)               TRL `scale_rewards="batch"` (σ of the raw scores)
        none   Â_i = s_i - μ_g                                    Dr.GRPO (arXiv 2503.20783)

    `mask` (`[B, T]` or `[B]` row flags): rows without a valid token get Â = 0 and, under pgloss's
    convention, leave their group's μ_g, σ_g and size (and σ_batch); the trainers' conventions count
    them, as their trainers do (module docstring).
    """
    return _grpo(scores, group_ids, _check_convention(convention), scale, process_group, reduce, mask)


def _grpo(
    scores, group_ids, conv: StdConvention, scale: str, process_group, reduce: bool, mask: Tensor | None = None
) -> Tensor:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    rows = rows_of(mask, work.shape[0], work.device)
    counted = None if conv.counts_empty_rows else rows
    centered, size = _group_center(work, index, n_groups, counted)
    single = size == 1
    if scale == "none":
        out = centered
    elif scale == "group":
        weight = _counted(work, counted)
        std = _std(
            _group_sum(torch.where(weight > 0, centered.square(), 0.0), index, n_groups),
            _group_sum(weight, index, n_groups),
            conv.bessel,
        )[index]
        out = centered / (std + conv.eps)
    else:
        std = batch_std(work, bessel=conv.bessel, mask=counted, process_group=process_group, reduce=reduce)
        out = centered / (std + conv.eps)
    if conv.singleton == "raw":
        out = torch.where(single, work / (1.0 + conv.eps) if scale == "group" else work, out)
    else:
        out = torch.where(single, 0.0, out)
    if rows is not None:
        out = torch.where(rows, out, 0.0)
    return out.to(scores.dtype)


def group_advantages(
    scores: Tensor, group_ids: Tensor, *, scale: bool = True, eps: float = 1e-6, mask: Tensor | None = None
) -> Tensor:
    """Group-relative advantages, one per sequence, `[B]`: `grpo_advantages` with pgloss's convention.

    GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300): Â_i = (r_i - mean_g r) / (std_g r + ε),
    with the unbiased (n - 1) standard deviation, as TRL and verl.
    Dr.GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783), `scale=False`: Â_i = r_i - mean_g r,
    which removes the question-difficulty bias of the std division.
    A group of one sequence carries no relative signal and gets Â = 0 (verl instead uses mean 0 and
    std 1 there, i.e. Â = r). With `mask`, rows without a valid token leave their group and get 0.
    """
    convention = StdConvention(bessel=True, eps=_positive("eps", eps), singleton="zero")
    return _grpo(scores, group_ids, convention, "group" if check_flag("scale", scale) else "none", None, False, mask)


def batch_std(
    values: Tensor, *, bessel: bool = True, mask: Tensor | None = None, process_group=None, reduce: bool = True
) -> Tensor:
    """The std of `[N]` values over the whole batch (all ranks): two passes, mean then Σ(x - μ)²; over
    the values where `mask` (bool `[N]`) is True when given."""
    work = values.detach().to(torch.float64)
    weight = _counted(work, rows_of(mask, work.shape[0], work.device, "values"))
    work = torch.where(weight > 0, work, 0.0)
    totals = all_reduce(torch.stack([work.sum(), weight.sum()]), process_group, reduce)
    mean = totals[0] / totals[1].clamp(min=1)
    sq = all_reduce(torch.where(weight > 0, work - mean, 0.0).square().sum().reshape(1), process_group, reduce)[0]
    return _std(sq, totals[1], bessel)


def dynamic_sampling_keep(scores: Tensor, group_ids: Tensor) -> Tensor:
    """DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476, eq. 11): keep a group only when
    its rewards are not all equal, i.e. 0 < #correct < G for 0/1 rewards. Such groups have zero
    advantage everywhere and contribute no gradient. Returns bool `[B]`.
    """
    scores = check_tensor("scores", scores, ndim=(1,)).detach()
    index, n_groups = group_index(group_ids, scores.shape[0], scores.device)
    high = torch.full((n_groups,), -torch.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(
        0, index, scores, reduce="amax"
    )
    low = torch.full((n_groups,), torch.inf, dtype=scores.dtype, device=scores.device).scatter_reduce(
        0, index, scores, reduce="amin"
    )
    return (high > low)[index]


def overlong_penalty(lengths: Tensor, *, max_length: int, cache_length: int) -> Tensor:
    """DAPO's soft overlong punishment (eq. 13), added to the reward; `[B]`:

    0                                   |y| ≤ L_max - L_cache
    ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| ≤ L_max
    -1                                  |y| > L_max
    """
    for name, value in (("max_length", max_length), ("cache_length", cache_length)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if not 0 < cache_length <= max_length:
        raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length} and {max_length}")
    lengths = check_tensor("lengths", lengths, ndim=(1,), floating=False).to(torch.float32)
    soft = ((max_length - cache_length) - lengths) / cache_length
    penalty = torch.where(lengths <= max_length - cache_length, 0.0, soft)
    return torch.where(lengths > max_length, -1.0, penalty)
