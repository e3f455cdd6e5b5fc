"""Multi-step (agentic) estimators, one row per step of an episode (one turn of an agent's trajectory),
`[B]`: step-wise GRPO (the episode's final score, GRPO-normalised in its task group, on every step) and
GiGPO (an episode-level group advantage plus a step-level one within anchor-state groups).

Each row carries its task `group_ids` (the prompt or environment instance; the episodes of one task form
its group) and its `episode_ids` (one trajectory, which lies in one group). The rows of an episode, in
the order they appear in the call, are its steps in order. Every step of every episode of a group must be
in the call: Trinity-RFT computes these advantages once per step on the whole explored batch. The result
is one advantage per step; broadcast it over the step's response tokens (`adv[:, None]` with the mask).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_device, check_tensor
from ..core.checks import check_flag, check_number
from .group import _group_center, _group_sum, _positive, _scores, _std, group_index
from .group_baselines import _singleton
from .returns import discounted_returns

FNORMS = ("none", "std")


def _episodes(group_ids: object, episode_ids: object, n: int, device: torch.device, reference: str):
    """(episode of each row `[n]`, E, group of each episode `[E]`, G, step number of each row within its
    episode `[n]`, steps per episode `[E]`); an episode spread over two groups is refused."""
    group, n_groups = group_index(group_ids, n, device, reference)
    episode, n_episodes = group_index(episode_ids, n, device, reference, name="episode_ids")
    high = torch.full((n_episodes,), -1, dtype=group.dtype, device=device).scatter_reduce(
        0, episode, group, reduce="amax"
    )
    low = torch.full((n_episodes,), n_groups, dtype=group.dtype, device=device).scatter_reduce(
        0, episode, group, reduce="amin"
    )
    split = (high != low).nonzero()
    if split.numel():
        row = int((episode == split[0, 0]).nonzero()[0, 0])
        raise ValueError(
            f"episode_ids: an episode must lie in one group of group_ids; the episode of row {row} "
            f"({episode_ids[row].item()}) has rows in more than one group"  # type: ignore[index]
        )
    length = torch.bincount(episode, minlength=n_episodes)
    order = torch.sort(episode, stable=True).indices
    start = torch.cumsum(length, 0) - length
    step = torch.empty_like(episode)
    step[order] = torch.arange(n, device=device) - start[episode[order]]
    return episode, n_episodes, high, n_groups, step, length


def _final_scores(scores: Tensor, group_ids: object, episode_ids: object):
    """(each episode's last-step score `[E]` in float64, the episode of each row, the group of each episode,
    G, steps per episode)."""
    work = scores.to(torch.float64)
    n = work.shape[0]
    episode, n_episodes, ep_group, n_groups, _, length = _episodes(group_ids, episode_ids, n, work.device, "scores")
    last = torch.full((n_episodes,), -1, dtype=episode.dtype, device=work.device).scatter_reduce(
        0, episode, torch.arange(n, device=work.device), reduce="amax"
    )
    return work[last], episode, ep_group, n_groups, length


def step_wise_grpo_advantages(
    scores: Tensor,
    group_ids: Tensor,
    episode_ids: Tensor,
    *,
    scale: str = "group",
    eps: float = 1e-6,
    step_norm: bool = False,
    singleton: str = "zero",
) -> Tensor:
    """Step-wise GRPO, one advantage per step, `[B]`: the score of each episode's last step, R_e,
    GRPO-normalised among the episodes of its task group and given to every step of the episode:

        Â_{e,t} = (R_e - μ_g) / (σ + ε)        σ = σ_g (`scale="group"`), or the σ of every R_e in the
                                               call (`"batch"`; 1 with one episode); Bessel (n - 1)
        step_norm:  Â_{e,t} / |e|              |e| the episode's number of steps

    Trinity-RFT 0.6.0 `algorithm/advantage_fn/multi_step_grpo_advantage.py` `StepWiseGRPOAdvantageFn`
    (`step_wise_grpo`; `epsilon`, `std_cal_level`, `enable_step_norm`; after rLLM), which reads each
    step's `Experience.reward` and uses the run's last one. A group of one episode: Â = 0
    (`singleton="zero"`: no relative signal) or Trinity's μ = 0, σ = 1 (`"raw"`: R_e / (1 + ε), and
    R_e / (σ_batch + ε) with `scale="batch"`). Trinity's `std_threshold` drops whole groups:
    `step_wise_grpo_keep`.
    """
    if scale not in ("group", "batch"):
        raise ValueError(f"scale must be 'group' or 'batch', got {scale!r}")
    eps = _positive("eps", eps)
    step_norm = check_flag("step_norm", step_norm)
    _singleton(singleton)
    scores = _scores(scores)
    final, episode, ep_group, n_groups, length = _final_scores(scores, group_ids, episode_ids)
    n_episodes = final.shape[0]
    if scale == "group":
        out, kept = _normalised(final, ep_group, n_groups, "std", eps, None)
        single = torch.ones_like(final)
    else:
        centered, size = _group_center(final, ep_group, n_groups)
        kept = size > 1
        std = final.std() if n_episodes > 1 else final.new_ones(())
        out, single = centered / (std + eps), std.expand_as(final)
    out = torch.where(kept, out, final / (single + eps) if singleton == "raw" else 0.0)
    if step_norm:
        out = out / length.to(out.dtype)
    return out[episode].to(scores.dtype)


def step_wise_grpo_keep(scores: Tensor, group_ids: Tensor, episode_ids: Tensor, *, std_threshold: float) -> Tensor:
    """The steps Trinity-RFT's step-wise GRPO keeps with `std_threshold`, bool `[B]`: those of the task
    groups with more than one episode whose σ_g (Bessel) of the episodes' last-step scores exceeds
    `std_threshold`; the others are dropped from the batch (`StepWiseGRPOAdvantageFn.process`)."""
    threshold = check_number("std_threshold", std_threshold)
    if threshold < 0:
        raise ValueError(f"std_threshold must be >= 0, got {threshold}")
    final, episode, ep_group, n_groups, _ = _final_scores(_scores(scores), group_ids, episode_ids)
    centered, size = _group_center(final, ep_group, n_groups)
    std = _std(
        _group_sum(centered.square(), ep_group, n_groups), _group_sum(torch.ones_like(final), ep_group, n_groups), True
    )
    return ((size > 1) & (std[ep_group] > threshold))[episode]


def gigpo_advantages(
    step_rewards: Tensor,
    group_ids: Tensor,
    episode_ids: Tensor,
    state_ids: Tensor,
    *,
    omega: float = 1.0,
    gamma: float = 1.0,
    fnorm: str = "none",
    eps: float = 1e-6,
    singleton: str = "zero",
    anchored: Tensor | None = None,
) -> Tensor:
    """GiGPO, group-in-group policy optimisation (Feng et al. 2025, arXiv 2505.10978), one advantage per
    step, `[B]`:

        A = A_E + ω · A_S
        A_E(e)   = (R_e - μ_g) / (F_g + ε)         R_e = Σ_t r_t, the episode's return, among the
                                                   episodes of its task group g
        A_S(e,t) = (R_t - μ_s) / (F_s + ε)         R_t = Σ_{k≥t} γ^{k-t} r_k, the step's discounted return,
                                                   among the steps whose anchor state s is the same
        F = 1 (`fnorm="none"`) or the group's σ (`"std"`, Bessel)

    `step_rewards` are the immediate rewards r_t, one per step (with only an outcome reward: the reward
    on the episode's last step, 0 elsewhere, as Trinity-RFT does without per-step rewards); `state_ids`
    identify the environment state each step acts from (a hash of it), and `anchored` (bool `[B]`) says
    which steps recorded one: a step without one, and a state seen once, get A_S = 0.

    Trinity-RFT 0.6.0 `algorithm/advantage_fn/gigpo_advantage.py` `GiGPOAdvantageFn` (ω = 1, γ = 1,
    fnorm "none", ε = 1e-6 as there, ε added to F = 1 too; ε = 0 gives the paper's F_norm = 1). Trinity
    keys the anchor groups by the state hash over the whole batch; the paper's code forms them within each
    task group (verl-agent `gigpo/core_gigpo.py` `build_step_group`): give `state_ids` that tell tasks
    apart for that. A group of one episode: A_E = 0 (`singleton="zero"`) or Trinity's μ = 0, F = 1
    (`"raw"`: A_E = R_e / (1 + ε)).
    """
    omega = check_number("omega", omega)
    if fnorm not in FNORMS:
        raise ValueError(f"fnorm must be one of {FNORMS}, got {fnorm!r}")
    eps = check_number("eps", eps)
    if eps < 0 or (fnorm == "std" and eps == 0):
        raise ValueError(f"eps must be >= 0 (> 0 with fnorm='std', where σ may be 0), got {eps}")
    _singleton(singleton)
    rewards = _scores(step_rewards, "step_rewards")
    work = rewards.to(torch.float64)
    n, device = work.shape[0], work.device
    episode, n_episodes, ep_group, n_groups, step, length = _episodes(group_ids, episode_ids, n, device, "step_rewards")
    state, n_states = group_index(state_ids, n, device, "step_rewards", name="state_ids")
    if anchored is not None:
        anchored = check_tensor("anchored", anchored, ndim=(1,), floating=False)
        if anchored.dtype != torch.bool or anchored.shape[0] != n:
            raise ValueError(f"anchored must be bool of shape [{n}], got {anchored.dtype} {tuple(anchored.shape)}")
        check_device("anchored", anchored, device, "step_rewards")

    # R_t within each episode: the episodes as rows of a [E, L] table of steps.
    width = int(length.max()) if n else 0
    table = work.new_zeros(n_episodes, width).index_put_((episode, step), work)
    valid = torch.arange(width, device=device) < length[:, None]
    step_return = discounted_returns(table, valid, gamma=gamma)[episode, step]

    episode_return = _group_sum(work, episode, n_episodes)
    a_e, kept = _normalised(episode_return, ep_group, n_groups, fnorm, eps, None)
    a_e = torch.where(kept, a_e, episode_return / (1.0 + eps) if singleton == "raw" else 0.0)
    a_s, kept = _normalised(step_return, state, n_states, fnorm, eps, anchored)
    return (a_e[episode] + omega * torch.where(kept, a_s, 0.0)).to(rewards.dtype)


def _normalised(
    values: Tensor, index: Tensor, n_groups: int, fnorm: str, eps: float, counted: Tensor | None
) -> tuple[Tensor, Tensor]:
    """((v - μ) / (F + ε) within the groups `index` over the rows `counted` (None: all), and where that
    holds: a counted row whose group counts more than one row; the caller decides the others)."""
    centered, size = _group_center(values, index, n_groups, counted)
    if fnorm == "std":
        weight = torch.ones_like(values) if counted is None else counted.to(values.dtype)
        squares = _group_sum(torch.where(weight > 0, centered.square(), 0.0), index, n_groups)
        scale = _std(squares, _group_sum(weight, index, n_groups), True)[index]
    else:
        scale = torch.ones_like(values)
    kept = size > 1 if counted is None else (size > 1) & counted
    return centered / (scale + eps), kept
