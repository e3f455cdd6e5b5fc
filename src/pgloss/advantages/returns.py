"""The token-level pieces of the return-based estimators: the discounted return-to-go and the whitening
over the batch's valid tokens (global over ranks). REINFORCE++, ReMax, the optimal token baseline and
verl's GDPO build on them."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_mask, check_tensor
from ..core.checks import check_number
from ..core.distributed import all_reduce


def discounted_returns(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """G_t = r_t + γ G_{t+1} over valid tokens (masked positions are skipped and get 0), `[B, T]`."""
    if not 0.0 <= check_number("gamma", gamma) <= 1.0:
        raise ValueError(f"gamma must lie in [0, 1], got {gamma}")
    rewards = check_tensor("token_rewards", token_rewards, ndim=(2,))
    mask = check_mask(mask, rewards.shape, rewards.device, "token_rewards")
    work = torch.where(mask, rewards.detach().to(torch.float64), 0.0)
    out = torch.zeros_like(work)
    running = work.new_zeros(work.shape[0])
    for t in reversed(range(work.shape[1])):
        running = torch.where(mask[:, t], work[:, t] + gamma * running, running)
        out[:, t] = torch.where(mask[:, t], running, 0.0)
    return out.to(rewards.dtype)


def whiten(
    values: Tensor, mask: Tensor, *, convention: str = "verl", process_group=None, reduce: bool = True
) -> Tensor:
    """(x - μ) / σ over the valid tokens of the whole batch, 0 at masked positions, `[B, T]`.

    verl `masked_whiten`: σ² with Bessel, (x - μ)·rsqrt(σ² + 1e-8). OpenRLHF: σ² without Bessel,
    (x - μ)·rsqrt(max(σ², 1e-8)). Global over ranks (two all-reduces)."""
    if convention not in ("verl", "openrlhf"):
        raise ValueError(f"convention must be 'verl' or 'openrlhf', got {convention!r}")
    values = check_tensor("values", values, ndim=(2,))
    mask = check_mask(mask, values.shape, values.device, "values")
    work = torch.where(mask, values.detach().to(torch.float64), 0.0)
    totals = all_reduce(torch.stack([work.sum(), mask.sum().to(torch.float64)]), process_group, reduce)
    mean = totals[0] / totals[1].clamp(min=1)
    sq = all_reduce(torch.where(mask, work - mean, 0.0).square().sum().reshape(1), process_group, reduce)[0]
    if convention == "verl":
        var = sq / (totals[1] - 1).clamp(min=1)
        out = (work - mean) * torch.rsqrt(var + 1e-8)
    else:
        var = sq / totals[1].clamp(min=1)
        out = (work - mean) * torch.rsqrt(var.clamp(min=1e-8))
    return torch.where(mask, out, 0.0).to(values.dtype)
