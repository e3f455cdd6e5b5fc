"""REINFORCE-style estimators from the return-to-go, `[B, T]`: REINFORCE++ (whitened returns), its
group-baseline variant, and ReMax (the greedy response's reward as the baseline)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from .group import _group_center, _scores, group_index
from .returns import discounted_returns, whiten


def reinforce_pp_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    *,
    gamma: float = 1.0,
    convention: str = "verl",
    process_group=None,
    reduce: bool = True,
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): the discounted return G_t, whitened over the
    batch's tokens (`whiten`). Returns (advantages, returns), `[B, T]`; verl `reinforce_plus_plus`,
    OpenRLHF `reinforce`."""
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return whiten(returns, mask, convention=convention, process_group=process_group, reduce=reduce), returns


def reinforce_pp_baseline_advantages(
    scores: Tensor,
    group_ids: Tensor,
    mask: Tensor,
    *,
    convention: str = "verl",
    process_group=None,
    reduce: bool = True,
) -> Tensor:
    """REINFORCE++-baseline: Â_{i,t} = whiten(s_i - μ_g) over the batch's tokens, `[B, T]`
    (verl `reinforce_plus_plus_baseline`, OpenRLHF `reinforce_baseline`; a group of one: μ = 0)."""
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups)
    centered = torch.where(size > 1, centered, work)
    mask = check_tensor("mask", mask, ndim=(2,), floating=False)
    if mask.shape[0] != work.shape[0]:
        raise ValueError(f"mask must have {work.shape[0]} rows (one per score), got {tuple(mask.shape)}")
    check_device("mask", mask, work.device, "scores")
    token = centered[:, None].expand(mask.shape)
    return whiten(token, mask, convention=convention, process_group=process_group, reduce=reduce).to(scores.dtype)


def remax_advantages(token_rewards: Tensor, mask: Tensor, baseline: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax (Li et al. 2023, arXiv 2310.10505): Â_{i,t} = G_{i,t} - b_i with G the undiscounted
    return-to-go and b_i the reward of the greedy response to the same prompt. Returns
    (advantages, returns), `[B, T]` (verl `remax`)."""
    returns = discounted_returns(token_rewards, mask, gamma=1.0)
    baseline = check_tensor("baseline", baseline, ndim=(1,))
    if baseline.shape[0] != returns.shape[0]:
        raise ValueError(f"baseline must have shape [{returns.shape[0]}], got {tuple(baseline.shape)}")
    check_device("baseline", baseline, returns.device, "token_rewards")
    valid = check_mask(mask, returns.shape, returns.device, "token_rewards")
    adv = torch.where(valid, returns - baseline.detach().to(returns.dtype)[:, None], 0.0)
    return adv, returns
