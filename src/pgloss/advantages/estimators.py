"""Advantage estimators beside GRPO's (`group.py`): GAE, RLOO, REINFORCE++ (and its baseline
variant), ReMax, OPO, GPG, GDPO, pass@k and the optimal token baseline.

Sequence-level estimators take one score per sequence, `scores` `[B]`, and integer `group_ids`
`[B]` (the prompt of each sequence; every member of a group must be in the call, as in every
framework, where advantages are computed once per step on the whole rollout). Token-level ones
take `[B, T]` rewards and a mask. Everything returned is detached; arithmetic is in float64 and
the result comes back in the input's floating dtype.

Statistics over the whole batch (REINFORCE++'s whitening, TRL's batch std, GPG's α) are global:
with `process_group` (or the default group, when torch.distributed is initialized and
`reduce=True`) they are all-reduced, so a rollout spread over ranks gets the advantages of the
whole rollout on one process.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .group import (StdConvention, _counted, _group_center, _group_sum, _grpo, _positive, _scores, _std, batch_std,
                    group_index, grpo_advantages, rows_of)
from ..core.batch import check_device, check_mask, check_tensor
from ..core.checks import check_flag, check_log_prob, check_number
from ..core.distributed import all_reduce


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


GDPO_EPS = {"trl": 1e-4, "ms-swift": 1e-8}
"""GDPO's ε, inside each reward's group normalisation and in the final batch normalisation."""


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


def whiten(values: Tensor, mask: Tensor, *, convention: str = "verl", process_group=None,
           reduce: bool = True) -> Tensor:
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


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, *, gamma: float = 1.0, convention: str = "verl",
                            process_group=None, reduce: bool = True) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu et al. 2025, arXiv 2501.03262): the discounted return G_t, whitened over the
    batch's tokens (`whiten`). Returns (advantages, returns), `[B, T]`; verl `reinforce_plus_plus`,
    OpenRLHF `reinforce`."""
    returns = discounted_returns(token_rewards, mask, gamma=gamma)
    return whiten(returns, mask, convention=convention, process_group=process_group, reduce=reduce), returns


def reinforce_pp_baseline_advantages(scores: Tensor, group_ids: Tensor, mask: Tensor, *, convention: str = "verl",
                                     process_group=None, reduce: bool = True) -> Tensor:
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


def gpg_advantages(scores: Tensor, group_ids: Tensor, *, f_norm: float = 1.0, process_group=None,
                   reduce: bool = True) -> Tensor:
    """GPG (Chu et al. 2025, arXiv 2504.02546): Â_i = α (s_i - μ_g) / F_norm with α = B / #{i: s_i ≠ 0}
    (the batch's share of sequences with a non-zero reward, at least one), `[B]`; verl `gpg`
    (a group of one: μ = 0). B and the count are over all ranks."""
    f_norm = _positive("f_norm", f_norm)
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups)
    centered = torch.where(size > 1, centered, work)
    counts = all_reduce(torch.stack([work.new_tensor(work.numel()), (work != 0).sum().to(torch.float64)]),
                         process_group, reduce)
    alpha = counts[0] / counts[1].clamp(min=1)
    return (alpha * centered / f_norm).to(scores.dtype)


def gdpo_advantages(scores: Tensor, group_ids: Tensor, *, weights: Tensor | None = None, convention: str = "trl",
                    mask: Tensor | None = None, process_group=None, reduce: bool = True) -> Tensor:
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
        return whiten(total[:, None].expand(mask.shape), mask, process_group=process_group,
                      reduce=reduce).to(scores.dtype)
    raise ValueError(f"convention must be one of {(*GDPO_EPS, 'verl')}, got {convention!r}")


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
        0, index, work, reduce="amax")
    rows = torch.arange(work.shape[0], device=work.device)
    first = torch.full((n_groups,), work.shape[0], device=work.device).scatter_reduce(
        0, index, torch.where(work == top[index], rows, work.shape[0]), reduce="amin")
    is_best = rows == first[index]
    second = torch.full((n_groups,), -torch.inf, dtype=work.dtype, device=work.device).scatter_reduce(
        0, index, torch.where(is_best, -torch.inf, work), reduce="amax")
    adv = top - second
    if scale:
        centered, _ = _group_center(work, index, n_groups)
        adv = adv / (_std(_group_sum(centered.square(), index, n_groups), size, True) + eps)
    return torch.where(is_best, adv[index], 0.0).to(scores.dtype)


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
            0, index, lengths, reduce="amax", include_self=False)
        at_max = lengths == longest[index]
        n_at_max = torch.zeros_like(longest).index_add_(0, index, at_max.to(lengths.dtype))
        second = torch.zeros_like(longest).scatter_reduce(
            0, index, torch.where(at_max, 0, lengths), reduce="amax", include_self=False)
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
        token_rewards, mask, group_ids, old_log_prob, sum_pi_sq, rollout_weights, zero_tail, eps)
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
        token_rewards, mask, group_ids, old_log_prob, sum_pi_sq, rollout_weights, zero_tail, eps)
    order = torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices  # the valid columns first, in order
    compact_valid = torch.gather(valid, 1, order)
    compact = [torch.gather(x, 1, order) for x in (returns, w)]
    nonempty = valid.any(dim=-1).to(torch.float64)
    size = _group_sum(nonempty, index, n_groups)[index]
    baseline = _otb_baseline(compact[0], compact_valid, compact[1], index, n_groups, size, zero_tail, eps)
    baseline = torch.zeros_like(baseline).scatter_(1, order, baseline)  # back to the columns
    adv = torch.where(valid, returns - baseline, 0.0)
    return adv.to(token_rewards.dtype), returns.to(token_rewards.dtype)

MAXRL_CONVENTIONS = {"pgloss": (0.0, "zero", False), "prime-rl": (0.0, "zero", False), "skyrl": (1e-6, "raw", True)}
"""convention: (ε, a group of one, whether a row without a valid token counts in its group given a mask)."""
SINGLETONS = ("zero", "raw")


def _singleton(singleton: str) -> str:
    if singleton not in SINGLETONS:
        raise ValueError(f"singleton must be one of {SINGLETONS}, got {singleton!r}")
    return singleton


def maxrl_advantages(scores: Tensor, group_ids: Tensor, *, convention: str = "pgloss",
                     eps: float | None = None, mask: Tensor | None = None) -> Tensor:
    """MaxRL, maximum-likelihood RL (Tajwar, Zeng et al. 2026, arXiv 2602.02710), `[B]`:

        Â_i = (s_i - μ_g) / μ_g        (0 when μ_g ≤ 0: a group without a success carries no signal)

    For binary rewards, Σ_i Â_i ∇log π(y_i) / n = (1/K) Σ_{i: s_i=1} ∇log π(y_i) - the mean score
    function: an unbiased gradient of the order-n truncation of log p (n the group size, K the
    successes), where GRPO's σ-scaling estimates the gradient of p. Low pass rates get ~1/p weight.

    `convention`:
        pgloss, prime-rl   the paper's division, ε = 0; μ_g ≤ 0 gives 0; a group of one gives 0
                           (prime-rl `orchestrator/algo/max_rl.py`)
        skyrl              Â_i = (s_i - μ_g)/(μ_g + ε), ε = 1e-6, whatever the sign of μ_g; a group
                           of one keeps Â = s (μ = 0) (SkyRL `ppo_utils.py compute_maxrl_advantage`)
    `eps` overrides the convention's ε. The rewards are meant to be non-negative (canonically 0/1);
    that is not checked (a check would read the host).

    `mask` (`[B, T]`, or `[B]` row flags): a row without a valid token gets Â = 0 and, under pgloss's and
    prime-rl's conventions, leaves its group's μ_g and size (prime-rl scores only the traces with
    sampled tokens); SkyRL counts its reward. One group, rewards [1, 0, 0], the third row empty:
    pgloss, prime-rl [1, -1, 0]; skyrl [2, -1, 0] (within ε); without a mask [2, -1, -1]."""
    if convention not in MAXRL_CONVENTIONS:
        raise ValueError(f"convention must be one of {tuple(MAXRL_CONVENTIONS)}, got {convention!r}")
    default_eps, singleton, counts_empty_rows = MAXRL_CONVENTIONS[convention]
    eps = default_eps if eps is None else check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    rows = rows_of(mask, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups, None if counts_empty_rows else rows)
    mean = work - centered
    if convention == "skyrl":
        out = centered / (mean + eps)
    else:
        out = torch.where(mean > 0, centered / torch.where(mean > 0, mean + eps, 1.0), 0.0)
    out = torch.where(size > 1, out, work if singleton == "raw" else 0.0)
    return (out if rows is None else torch.where(rows, out, 0.0)).to(scores.dtype)


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


def asymre_advantages(scores: Tensor, group_ids: Tensor, *, baseline_shift: float = -0.1,
                      singleton: str = "zero", mask: Tensor | None = None) -> Tensor:
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


def opmd_advantages(scores: Tensor, group_ids: Tensor, *, baseline: str = "mean", tau: float = 1.0,
                    singleton: str = "zero", mask: Tensor | None = None) -> Tensor:
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
            0, index, x, reduce="amax")
        top = torch.where(top > -torch.inf, top, 0.0)  # a group without a counted row (its rows get 0)
        total = _group_sum((x - top[index]).exp(), index, n_groups)
        count = _group_sum(weight, index, n_groups)
        return (tau * (top + total.log() - count.log()))[index]

    return _shifted_group_baseline(scores, group_ids, mean if baseline == "mean" else logavgexp, singleton, mask)
