"""Advantage estimators beyond GAE and plain GRPO: RLOO, REINFORCE++ (and its baseline variant),
ReMax, OPO, GPG, GDPO, pass@k, batch-std scaling, and GRPO's std conventions by name.

Sequence-level estimators take one score per sequence, `scores` `[B]`, and integer `group_ids`
`[B]` (the prompt of each sequence; every member of a group must be in the call, as in every
framework, where advantages are computed once per step on the whole rollout). Token-level ones
take `[B, T]` rewards and a mask. Everything returned is detached; arithmetic is in float64 and
the result comes back in the input's floating dtype.

Statistics over the whole batch (REINFORCE++'s whitening, TRL's batch std, GPG's α) are global:
with `process_group` (or the default group, when torch.distributed is initialized and
`reduce=True`) they are all-reduced, so a rollout spread over ranks gets the advantages of the
whole rollout on one process.

GRPO's std conventions differ between frameworks (docs/reference.md has the table):

    name       std                 ε      a group of one
    pgloss     Bessel (n - 1)      1e-6   Â = 0 (no relative signal)
    verl       Bessel              1e-6   μ = 0, σ = 1: Â = s / (1 + ε)
    trl        Bessel (nanstd)     1e-4   Â = 0 (σ = 0, s - μ = 0)
    ms-swift   Bessel (torch.std)  1e-4   Â = 0
    openrlhf   Bessel (torch.std)  1e-9   undefined there (NaN); 0 here
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .group import group_index
from ..core.batch import check_device, check_mask, check_tensor
from ..core.checks import check_flag, check_log_prob, check_number


@dataclass(frozen=True)
class StdConvention:
    """How a framework divides GRPO's centred scores: (s - μ_g) / (σ_g + eps)."""

    bessel: bool
    """σ with n - 1 (torch.std's default) rather than n."""
    eps: float
    """Added to σ."""
    singleton: str
    """A group of one: 'zero' (Â = 0) or 'raw' (μ = 0, σ = 1, as verl)."""


STD_CONVENTIONS = {
    "pgloss": StdConvention(bessel=True, eps=1e-6, singleton="zero"),
    "verl": StdConvention(bessel=True, eps=1e-6, singleton="raw"),
    "trl": StdConvention(bessel=True, eps=1e-4, singleton="zero"),
    "ms-swift": StdConvention(bessel=True, eps=1e-4, singleton="zero"),
    "openrlhf": StdConvention(bessel=True, eps=1e-9, singleton="zero"),
}
GDPO_EPS = {"trl": 1e-4, "ms-swift": 1e-8}
"""GDPO's ε, inside each reward's group normalisation and in the final batch normalisation."""
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


def _distributed(reduce: bool) -> bool:
    return reduce and dist.is_available() and dist.is_initialized()


def _all_reduce(t: Tensor, process_group, reduce: bool) -> Tensor:
    if _distributed(reduce):
        dist.all_reduce(t, group=process_group)
    return t


def _check_convention(convention: str) -> StdConvention:
    if convention not in STD_CONVENTIONS:
        raise ValueError(f"convention must be one of {tuple(STD_CONVENTIONS)}, got {convention!r}")
    return STD_CONVENTIONS[convention]


def _group_center(work: Tensor, index: Tensor, n_groups: int) -> tuple[Tensor, Tensor]:
    """(s - μ_g, group sizes per row)."""
    count = _group_sum(torch.ones_like(work), index, n_groups)
    mean = _group_sum(work, index, n_groups) / count
    return work - mean[index], count[index]


def _std(centered_sq_sum: Tensor, count: Tensor, bessel: bool) -> Tensor:
    return (centered_sq_sum / (count - 1 if bessel else count).clamp(min=1)).sqrt()


def grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    convention: str = "pgloss",
    scale: str = "group",
    process_group: "dist.ProcessGroup | None" = None,
    reduce: bool = True,
) -> Tensor:
    """GRPO's group-relative advantage (Shao et al. 2024, arXiv 2402.03300) with a framework's
    std convention (`STD_CONVENTIONS`), `[B]`:

        group  Â_i = (s_i - μ_g) / (σ_g + ε)                      GRPO; verl, TRL `scale_rewards="group"`
        batch  Â_i = (s_i - μ_g) / (σ_batch(s) + ε)               TRL `scale_rewards="batch"` (σ of the raw scores)
        none   Â_i = s_i - μ_g                                    Dr.GRPO (arXiv 2503.20783)
    """
    return _grpo(scores, group_ids, _check_convention(convention), scale, process_group, reduce)


def _grpo(scores, group_ids, conv: StdConvention, scale: str, process_group, reduce: bool) -> Tensor:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups)
    single = size == 1
    if scale == "none":
        out = centered
    elif scale == "group":
        std = _std(_group_sum(centered.square(), index, n_groups), _group_sum(torch.ones_like(work), index, n_groups),
                   conv.bessel)[index]
        out = centered / (std + conv.eps)
    else:
        std = batch_std(work, bessel=conv.bessel, process_group=process_group, reduce=reduce)
        out = centered / (std + conv.eps)
    if conv.singleton == "raw":
        out = torch.where(single, work / (1.0 + conv.eps) if scale == "group" else work, out)
    else:
        out = torch.where(single, 0.0, out)
    return out.to(scores.dtype)


def batch_std(values: Tensor, *, bessel: bool = True, process_group=None, reduce: bool = True) -> Tensor:
    """The std of `[N]` values over the whole batch (all ranks): two passes, mean then Σ(x - μ)²."""
    work = values.detach().to(torch.float64)
    totals = _all_reduce(torch.stack([work.sum(), work.new_tensor(work.numel())]), process_group, reduce)
    mean = totals[0] / totals[1].clamp(min=1)
    sq = _all_reduce((work - mean).square().sum().reshape(1), process_group, reduce)[0]
    return _std(sq, totals[1], bessel)


def rloo_advantages(scores: Tensor, group_ids: Tensor) -> Tensor:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv 2402.14740), `[B]`:

        Â_i = s_i - (1/(n-1)) Σ_{j≠i} s_j = n/(n-1) · (s_i - μ_g)

    verl `rloo`, TRL's RLOOTrainer, OpenRLHF `rloo`. A group of one gets 0 (verl leaves s_i)."""
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups)
    return torch.where(size > 1, centered * size / (size - 1).clamp(min=1), 0.0).to(scores.dtype)


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
    totals = _all_reduce(torch.stack([work.sum(), mask.sum().to(torch.float64)]), process_group, reduce)
    mean = totals[0] / totals[1].clamp(min=1)
    sq = _all_reduce(torch.where(mask, work - mean, 0.0).square().sum().reshape(1), process_group, reduce)[0]
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
    counts = _all_reduce(torch.stack([work.new_tensor(work.numel()), (work != 0).sum().to(torch.float64)]),
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
        totals = _all_reduce(torch.stack([total.sum(), total.new_tensor(total.numel())]), process_group, reduce)
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
    is 0 there (no other trajectory estimates it). `sum_pi_sq` from `pgloss.vocab.entropy.sum_pi_squared(logits)`."""
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
    cum = torch.where(valid, w, 0.0).cumsum(dim=-1)
    m = valid.to(torch.float64)
    width = returns.shape[1]
    num = torch.zeros(n_groups, width, dtype=torch.float64, device=returns.device)
    num = num.index_add_(0, index, returns * cum * m)
    den = torch.zeros_like(num).index_add_(0, index, cum * m) + eps
    baseline = (num / den)[index]
    size = _group_sum(torch.ones(returns.shape[0], dtype=torch.float64, device=returns.device), index, n_groups)[index]
    baseline = torch.where(size[:, None] > 1, baseline, 0.0)
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
    adv = torch.where(valid, returns - baseline, 0.0)
    return adv.to(token_rewards.dtype), returns.to(token_rewards.dtype)
