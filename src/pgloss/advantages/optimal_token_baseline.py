"""The optimal token baseline, `[B, T]`: the group's returns at each token weighted by the
variance proxy W, pooled by column (single turn) or by generated-token index (multi-turn,
tool output masked between turns)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor
from ..core.checks import check_flag, check_log_prob
from .group import _group_sum, _positive, group_index
from .returns import discounted_returns


def _otb_inputs(token_rewards, mask, group_ids, old_log_prob, sum_pi_sq, rollout_weights, zero_tail, eps):
    """Checked inputs of the optimal token baseline: (returns, valid, w, index, n_groups, zero_tail, eps)."""
    eps, zero_tail = _positive("eps", eps), check_flag("zero_tail", zero_tail)
    returns = discounted_returns(token_rewards, mask, gamma=1.0).to(torch.float64)
    valid = check_mask(mask, returns.shape, returns.device, "token_rewards")
    index, n_groups = group_index(group_ids, returns.shape[0], returns.device, "token_rewards")
    for name, value in (("old_log_prob", old_log_prob), ("sum_pi_sq", sum_pi_sq), ("rollout_weights", rollout_weights)):
        if value is None and name != "rollout_weights":
            raise TypeError(f"{name} must be a [B, T] tensor, got None")
        if value is not None and (check_tensor(name, value, ndim=(2,)).shape != returns.shape):
            raise ValueError(f"{name} must have shape {tuple(returns.shape)}, got {tuple(value.shape)}")
        if value is not None:
            check_device(name, value, returns.device, "token_rewards")
    check_log_prob("old_log_prob", old_log_prob, valid)
    pi = torch.where(valid, old_log_prob.detach().to(torch.float64), 0.0).exp()
    w = 1 - 2 * pi + torch.where(valid, sum_pi_sq.detach().to(torch.float64), 0.0)
    if rollout_weights is not None:
        w = w * torch.where(valid, rollout_weights.detach().to(torch.float64), 0.0).square()
    return returns, valid, torch.where(valid, w, 0.0), index, n_groups, zero_tail, eps


def _otb_baseline(returns, valid, w, index, n_groups, size, zero_tail, eps) -> Tensor:
    """B_t = Σ_{i∈g} G_it W_it m_it / (Σ_{i∈g} W_it m_it + ε) at each column t, with W the running sum of
    w; 0 for a group of `size` 1, and past the second-longest response of a group's single longest one
    (`zero_tail`)."""
    cum = w.cumsum(dim=-1)
    m = valid.to(torch.float64)
    width = returns.shape[1]
    num = torch.zeros(n_groups, width, dtype=torch.float64, device=returns.device)
    num = num.index_add_(0, index, returns * cum * m)
    den = torch.zeros_like(num).index_add_(0, index, cum * m) + eps
    baseline = torch.where(size[:, None] > 1, (num / den)[index], 0.0)
    if zero_tail and returns.shape[0]:
        lengths = valid.sum(dim=-1)
        longest = torch.zeros(n_groups, dtype=lengths.dtype, device=lengths.device).scatter_reduce(
            0, index, lengths, reduce="amax", include_self=False
        )
        at_max = lengths == longest[index]
        n_at_max = torch.zeros_like(longest).index_add_(0, index, at_max.to(lengths.dtype))
        second = torch.zeros_like(longest).scatter_reduce(
            0, index, torch.where(at_max, 0, lengths), reduce="amax", include_self=False
        )
        tail_row = at_max & (n_at_max[index] == 1) & (size > 1)
        tail = tail_row[:, None] & (torch.arange(width, device=returns.device)[None, :] >= second[index][:, None])
        baseline = torch.where(tail, 0.0, baseline)
    return baseline


def optimal_token_baseline_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    old_log_prob: Tensor,
    sum_pi_sq: Tensor,
    *,
    rollout_weights: Tensor | None = None,
    zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """The optimal token baseline (verl `optimal_token_baseline`), `[B, T]` (advantages, returns):

        w_t = 1 - 2π_t + Σ_v π_v²  (× ρ_t² with rollout weights),   W_t = Σ_{j≤t} m_j w_j,
        B_t = Σ_{i∈g} G_it W_it m_it / (Σ_{i∈g} W_it m_it + ε),       Â_t = G_t - B_t

    with G the undiscounted return-to-go and π_t = exp(old_log_prob). A group of one has B = 0.
    `zero_tail`: where a group's single longest response runs past the second longest, its baseline
    is 0 there (no other trajectory estimates it). `sum_pi_sq` from `pgloss.vocab.entropy.sum_pi_squared(logits)`.
    The baseline pools the group's tokens at the same column t (`tir_optimal_token_baseline_advantages`
    pools the same generated-token index instead, for multi-turn responses with tool output inside)."""
    returns, valid, w, index, n_groups, zero_tail, eps = _otb_inputs(
        token_rewards, mask, group_ids, old_log_prob, sum_pi_sq, rollout_weights, zero_tail, eps
    )
    size = _group_sum(torch.ones(returns.shape[0], dtype=torch.float64, device=returns.device), index, n_groups)[index]
    baseline = _otb_baseline(returns, valid, w, index, n_groups, size, zero_tail, eps)
    adv = torch.where(valid, returns - baseline, 0.0)
    return adv.to(token_rewards.dtype), returns.to(token_rewards.dtype)


def tir_optimal_token_baseline_advantages(
    token_rewards: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    old_log_prob: Tensor,
    sum_pi_sq: Tensor,
    *,
    rollout_weights: Tensor | None = None,
    zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """The multi-turn (tool-integrated reasoning) optimal token baseline (verl 0.9.1
    `tir_optimal_token_baseline`, `compute_multi_turn_optimal_token_baseline_advantage`), `[B, T]`
    (advantages, returns).

    The formula of `optimal_token_baseline_advantages`, with the tokens of a group aligned by their
    index k among each response's valid (generated) tokens rather than by column: in a multi-turn
    response the tool output between turns is masked, and the k-th generated token of each response
    sits at a different column. With k the generated-token index, t_i(k) its column in row i:

        B_k = Σ_{i∈g, k<|y_i|} G_{i,t_i(k)} W_{i,t_i(k)} / (Σ_{i∈g, k<|y_i|} W_{i,t_i(k)} + ε),
        Â_{i,t_i(k)} = G_{i,t_i(k)} - B_k

    Rows without a valid token are left out of their group (its size counts the others), as verl.
    Without holes in the mask it equals `optimal_token_baseline_advantages`. The returns are 0 at
    masked positions (verl's carry the next valid return there; the advantages agree)."""
    returns, valid, w, index, n_groups, zero_tail, eps = _otb_inputs(
        token_rewards, mask, group_ids, old_log_prob, sum_pi_sq, rollout_weights, zero_tail, eps
    )
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices  # the valid columns first, in order
    compact_valid = torch.gather(valid, 1, order)
    compact = [torch.gather(x, 1, order) for x in (returns, w)]
    nonempty = valid.any(dim=-1).to(torch.float64)
    size = _group_sum(nonempty, index, n_groups)[index]
    baseline = _otb_baseline(compact[0], compact_valid, compact[1], index, n_groups, size, zero_tail, eps)
    baseline = torch.zeros_like(baseline).scatter_(1, order, baseline)  # back to the columns
    adv = torch.where(valid, returns - baseline, 0.0)
    return adv.to(token_rewards.dtype), returns.to(token_rewards.dtype)
