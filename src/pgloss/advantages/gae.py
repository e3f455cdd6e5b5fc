"""Generalised advantage estimation: the value-based, per-token estimator (PPO with a critic)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from ..core.checks import check_number


def gae(rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, https://arxiv.org/abs/1506.02438).

        δ_t = r_t + γ V_{t+1} - V_t,     A_t = δ_t + γ λ A_{t+1},     returns_t = A_t + V_t

    the recursion of the loss blog post (2025-10-21) (with λ = 1 it is the discounted return minus V_t). Positions with
    m_t = 0 (padding, tool output) are skipped: the recursion carries V and A across them, as in
    verl's `compute_gae_advantage_return`, and they get A = 0. Past the last token V = 0.
    Inputs `[B, T]`; returns (advantages, returns), `[B, T]`, detached.
    """
    if not (0.0 <= check_number("gamma", gamma) <= 1.0 and 0.0 <= check_number("lam", lam) <= 1.0):
        raise ValueError(f"gamma and lam must lie in [0, 1], got gamma={gamma}, lam={lam}")
    rewards = check_tensor("rewards", rewards, ndim=(2,))
    values = check_tensor("values", values, ndim=(2,))
    if rewards.shape != values.shape or rewards.shape != mask.shape:
        raise ValueError(
            f"rewards, values and mask must share one [B, T] shape, got {tuple(rewards.shape)}, "
            f"{tuple(values.shape)}, {tuple(mask.shape)}"
        )
    check_device("values", values, rewards.device, "rewards")
    valid = check_mask(mask, rewards.shape, rewards.device, "rewards")
    # Values at masked positions (NaN and inf included) never enter the recursion.
    rewards = torch.where(valid, rewards.detach(), 0.0)
    values = torch.where(valid, values.detach(), 0.0)
    next_value = rewards.new_zeros(rewards.shape[0])
    last = rewards.new_zeros(rewards.shape[0])
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        current = delta + gamma * lam * last
        m = valid[:, t]
        next_value = torch.where(m, values[:, t], next_value)
        last = torch.where(m, current, last)
        advantages[:, t] = torch.where(m, current, 0.0)
    return advantages, torch.where(valid, advantages + values, 0.0)
