"""REINFORCE-style estimators from the return-to-go, `[B, T]`: REINFORCE++ (whitened returns), its
group-baseline variant, ReMax (the greedy response's reward as the baseline) and FlashREINFORCE (the
batch's mean reward as the baseline)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from ..core.distributed import all_reduce
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


FLASH_REINFORCE_CONVENTIONS = ("pgloss", "openrlhf")


def flash_reinforce_advantages(
    scores: Tensor,
    mask: Tensor,
    *,
    token_rewards: Tensor | None = None,
    convention: str = "pgloss",
    process_group=None,
    reduce: bool = True,
) -> Tensor:
    """FlashREINFORCE's advantage (OpenRLHF 0.11.2 `advantage.estimator="flash_reinforce"`), `[B, T]`: the
    score minus the mean score of the whole rollout batch, with no prompt groups and no whitening, on
    every valid token (the undiscounted return-to-go of a reward on the last valid token):

        Â_{i,t} = s_i - (1/B) Σ_j s_j                       + Σ_{t' ≥ t} k_{i,t'}  with `token_rewards` k

    OpenRLHF `trainer/ppo_utils/experience_maker.py` `compute_advantages_and_returns` (`rewards -
    rewards.mean()`, then `compute_reward` and `get_cumulative_returns` with γ = 1; advantages = returns).
    It is the estimator for one sample per prompt (`n_samples_per_prompt=1`), where a group baseline has
    no group. `token_rewards` (`[B, T]`) adds per-token rewards before the return-to-go, as OpenRLHF's
    KL-in-reward `-kl_coef · KL`; OpenRLHF also clamps the centred score to `reward.clip_range` (default
    (-10, 10)) first, which pgloss leaves to the caller. The mean is over all ranks (`process_group`).

    `convention`: "pgloss" leaves a row without a valid token out of the mean (it gets 0); "openrlhf"
    counts its score, as OpenRLHF does (it gets 0 through the mask either way)."""
    if convention not in FLASH_REINFORCE_CONVENTIONS:
        raise ValueError(f"convention must be one of {FLASH_REINFORCE_CONVENTIONS}, got {convention!r}")
    scores = _scores(scores)
    work = scores.to(torch.float64)
    mask = check_tensor("mask", mask, ndim=(2,), floating=False)
    if mask.shape[0] != work.shape[0]:
        raise ValueError(f"mask must have {work.shape[0]} rows (one per score), got {tuple(mask.shape)}")
    valid = check_mask(mask, mask.shape, work.device, "scores")
    counted = torch.ones_like(valid[:, 0]) if convention == "openrlhf" else valid.any(dim=-1)
    totals = all_reduce(
        torch.stack([torch.where(counted, work, 0.0).sum(), counted.sum().to(work.dtype)]), process_group, reduce
    )
    centered = work - totals[0] / totals[1].clamp(min=1)
    adv = torch.where(valid, centered[:, None], 0.0)  # the return-to-go (γ = 1) of the score on the last token
    if token_rewards is not None:
        token_rewards = check_tensor("token_rewards", token_rewards, ndim=(2,))
        if token_rewards.shape != valid.shape:
            raise ValueError(f"token_rewards must have shape {tuple(valid.shape)}, got {tuple(token_rewards.shape)}")
        check_device("token_rewards", token_rewards, work.device, "scores")
        adv = adv + discounted_returns(token_rewards.detach().to(torch.float64), valid, gamma=1.0)
    return adv.to(scores.dtype)
