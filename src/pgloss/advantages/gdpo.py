"""GDPO: several rewards per response, each normalised in its group, then summed with weights and
normalised over the batch (TRL's, ms-swift's and verl's conventions)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from ..core.distributed import all_reduce
from .group import StdConvention, _grpo, batch_std, grpo_advantages
from .returns import whiten

GDPO_EPS = {"trl": 1e-4, "ms-swift": 1e-8}
"""GDPO's ε, inside each reward's group normalisation and in the final batch normalisation."""


def gdpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    weights: Tensor | None = None,
    convention: str = "trl",
    mask: Tensor | None = None,
    process_group=None,
    reduce: bool = True,
) -> Tensor:
    """GDPO (arXiv 2601.05242): each reward is normalised within its group, then the weighted sum is
    normalised over the batch. `scores` `[B, K]`, one column per reward.

        trl   Â_i = z(Σ_k w_k (s_ik - μ_gk)/(σ_gk + ε)) with z(x) = (x - mean)/(std + ε) over
              sequences, ε = 1e-4 (TRL `multi_objective_aggregation="normalize_then_sum"`); `[B]`.
        ms-swift  the same with ε = 1e-8 (ms-swift `scale_rewards="gdpo"`).
        verl  the per-reward GRPO advantage of verl's convention, summed with the weights, then
              `whiten` over the batch's valid tokens (verl `gdpo`); needs `mask`, returns `[B, T]`.
    """
    scores = check_tensor("scores", scores, ndim=(2,)).detach()
    work = scores.to(torch.float64)
    k = work.shape[1]
    if weights is None:
        w = work.new_ones(k)
    else:
        w = check_tensor("weights", weights, ndim=(1,)).detach().to(torch.float64)
        if w.shape[0] != k:
            raise ValueError(f"weights must have one entry per reward ({k}), got {tuple(w.shape)}")
        check_device("weights", weights, scores.device, "scores")
    if convention in GDPO_EPS:
        eps = GDPO_EPS[convention]
        conv = StdConvention(bessel=True, eps=eps, singleton="zero")
        per_key = torch.stack([_grpo(work[:, j], group_ids, conv, "group", None, False) for j in range(k)], dim=1)
        total = (per_key * w).sum(dim=1)
        totals = all_reduce(torch.stack([total.sum(), total.new_tensor(total.numel())]), process_group, reduce)
        mean = totals[0] / totals[1].clamp(min=1)
        return ((total - mean) / (batch_std(total, process_group=process_group, reduce=reduce) + eps)).to(scores.dtype)
    if convention == "verl":
        if mask is None:
            raise ValueError("gdpo_advantages with convention='verl' needs mask (it whitens over tokens)")
        per_key = torch.stack([grpo_advantages(work[:, j], group_ids, convention="verl") for j in range(k)], dim=1)
        total = (per_key * w).sum(dim=1)
        mask = check_mask(mask, mask.shape, scores.device, "scores")
        if mask.shape[0] != work.shape[0]:
            raise ValueError(f"mask must have {work.shape[0]} rows, got {tuple(mask.shape)}")
        return whiten(total[:, None].expand(mask.shape), mask, process_group=process_group, reduce=reduce).to(
            scores.dtype
        )
    raise ValueError(f"convention must be one of {(*GDPO_EPS, 'verl')}, got {convention!r}")
