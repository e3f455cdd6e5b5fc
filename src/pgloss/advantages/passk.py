"""Pass@k training: only the best response of a group gets an advantage, `[B]`."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.checks import check_flag
from .group import _group_center, _group_sum, _positive, _scores, _std, group_index


def passk_advantages(scores: Tensor, group_ids: Tensor, *, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """Pass@k training (Chen et al. 2025, arXiv 2503.19595, as verl `grpo_passk`), `[B]`: only the
    best response of a group gets an advantage, Â = s_max - s_second (÷ (σ_g + ε), Bessel, when
    `scale`); the rest get 0. Ties go to the first row. Every group needs two members; ε > 0 keeps a
    group of equal scores at 0 / ε = 0."""
    eps, scale = _positive("eps", eps), check_flag("scale", scale)
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    size = _group_sum(torch.ones_like(work), index, n_groups)
    if work.numel() and bool((size < 2).any()):
        raise ValueError("passk_advantages needs at least two responses per group")
    top = torch.full((n_groups,), -torch.inf, dtype=work.dtype, device=work.device).scatter_reduce(
        0, index, work, reduce="amax"
    )
    rows = torch.arange(work.shape[0], device=work.device)
    first = torch.full((n_groups,), work.shape[0], device=work.device).scatter_reduce(
        0, index, torch.where(work == top[index], rows, work.shape[0]), reduce="amin"
    )
    is_best = rows == first[index]
    second = torch.full((n_groups,), -torch.inf, dtype=work.dtype, device=work.device).scatter_reduce(
        0, index, torch.where(is_best, -torch.inf, work), reduce="amax"
    )
    adv = top - second
    if scale:
        centered, _ = _group_center(work, index, n_groups)
        adv = adv / (_std(_group_sum(centered.square(), index, n_groups), size, True) + eps)
    return torch.where(is_best, adv[index], 0.0).to(scores.dtype)
