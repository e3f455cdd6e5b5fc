"""Advantage estimators: GAE, group-relative (GRPO, Dr.GRPO), and DAPO's sampling-side rules."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from ..core.checks import check_flag, check_number, is_integer


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
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


def group_index(group_ids: object, n: int, device: torch.device, reference: str = "scores") -> tuple[Tensor, int]:
    """The `[n]` integer `group_ids` renumbered 0..G-1 in id order, and G. Advantages are computed
    once per step, before the loss: reading G on the host is their one sync."""
    ids = check_tensor("group_ids", group_ids, ndim=(1,), floating=False)
    if ids.shape[0] != n or not is_integer(ids):
        raise ValueError(f"group_ids must be integers of shape [{n}], got {ids.dtype} {tuple(ids.shape)}")
    check_device("group_ids", ids, device, reference)
    _, index = torch.unique(ids, return_inverse=True)
    return index, (int(index.max()) + 1 if n else 0)


def group_advantages(scores: Tensor, group_ids: Tensor, *, scale: bool = True, eps: float = 1e-6) -> Tensor:
    """Group-relative advantages, one per sequence, `[B]`.

    GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300): Â_i = (r_i - mean_g r) / (std_g r + ε),
    with the unbiased (n - 1) standard deviation, as TRL and verl.
    Dr.GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783), `scale=False`: Â_i = r_i - mean_g r,
    which removes the question-difficulty bias of the std division.
    A group of one sequence carries no relative signal and gets Â = 0 (verl instead uses mean 0 and
    std 1 there, i.e. Â = r).
    """
    if check_number("eps", eps) <= 0:
        raise ValueError(f"eps must be > 0, got {eps}")
    check_flag("scale", scale)
    scores = check_tensor("scores", scores, ndim=(1,)).detach()
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, scores.shape[0], scores.device)
    count = torch.zeros(n_groups, dtype=work.dtype, device=work.device).index_add_(0, index, torch.ones_like(work))
    mean = torch.zeros_like(count).index_add_(0, index, work) / count
    centered = work - mean[index]
    if not scale:
        return centered.to(scores.dtype)
    var = torch.zeros_like(count).index_add_(0, index, centered.square()) / (count - 1).clamp(min=1)
    return (centered / (var.sqrt()[index] + eps)).to(scores.dtype)


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
