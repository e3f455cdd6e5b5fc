"""Step-wise GRPO and GiGPO against plain float64 loops (tests/loops/advantages.py), bad input, and Trinity-RFT
0.6.0's own `StepWiseGRPOAdvantageFn` and `GiGPOAdvantageFn` read from its source (PGLOSS_TRINITY_SRC,
trainer_sources.py; skipped when unset).

Measured (float64 inputs, max |Δ| over every step of the cases below; Trinity builds its group tensors in float32):

    Trinity 0.6.0 StepWiseGRPOAdvantageFn   singleton="raw": 1.4e-7 over std_cal_level group / batch, step norm
                                            on / off, 3 seeds; std_threshold 0, 1, 1e6: the same steps kept
    Trinity 0.6.0 GiGPOAdvantageFn          singleton="raw": 4.9e-7 over fnorm none / std, (ω, γ) ∈ {(1, 1),
                                            (0.5, 0.9), (2, 0.9)}, per-step rewards and the outcome-only
                                            fallback, steps without a state hash, 3 seeds

pgloss's default `singleton="zero"` gives a group of one episode Â = 0 where Trinity keeps its score (μ = 0).
"""

from types import SimpleNamespace

import loops
import pytest
import torch
from trainer_sources import load, source_file

from pgloss import advantages as est

F64 = dict(dtype=torch.float64)

# Three tasks: task 4 has three episodes (2, 3 and 1 steps), task 1 two, task 9 one (a group of one episode).
# An episode's rows are its steps in order; episodes interleave in the batch.
GROUPS = [4, 4, 1, 4, 4, 1, 4, 1, 4, 9, 9, 1]
EPISODES = [0, 1, 3, 0, 1, 3, 1, 4, 2, 5, 5, 4]


def episodes(seed):
    gen = torch.Generator().manual_seed(seed)
    n = len(GROUPS)
    rewards = torch.randn(n, generator=gen, **F64)
    states = torch.randint(0, 4, (n,), generator=gen)  # 4 states: anchors repeat within and across tasks
    anchored = torch.rand(n, generator=gen) > 0.2
    return rewards, torch.tensor(GROUPS), torch.tensor(EPISODES), states, anchored


def close(actual, expected, tol=1e-12):
    torch.testing.assert_close(actual, torch.tensor(expected, **F64), rtol=tol, atol=tol)


@pytest.mark.parametrize("scale", ["group", "batch"])
@pytest.mark.parametrize("step_norm", [False, True])
@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_step_wise_grpo_matches_loop(scale, step_norm, singleton):
    scores, groups, eps_, _, _ = episodes(0)
    ours = est.step_wise_grpo_advantages(scores, groups, eps_, scale=scale, step_norm=step_norm, singleton=singleton)
    expected = loops.step_wise_grpo(
        scores.tolist(), GROUPS, EPISODES, scale=scale, step_norm=step_norm, singleton=singleton
    )
    close(ours, expected)


def test_step_wise_grpo_reads_only_the_last_step():
    scores, groups, eps_, _, _ = episodes(1)
    moved = scores.clone()
    moved[[0, 1, 2, 9]] += 5.0  # steps that are not the last of their episode
    torch.testing.assert_close(
        est.step_wise_grpo_advantages(moved, groups, eps_), est.step_wise_grpo_advantages(scores, groups, eps_)
    )


def test_step_wise_grpo_keep():
    scores, groups, eps_, _, _ = episodes(2)
    keep = est.step_wise_grpo_keep(scores, groups, eps_, std_threshold=0.0)
    assert keep.tolist() == [g != 9 for g in GROUPS]  # the group of one episode is dropped
    assert not est.step_wise_grpo_keep(scores, groups, eps_, std_threshold=1e6).any()


@pytest.mark.parametrize(
    "fnorm, omega, gamma, singleton", [("none", 1.0, 1.0, "zero"), ("std", 0.5, 0.9, "raw"), ("none", 2.0, 0.5, "raw")]
)
@pytest.mark.parametrize("with_anchored", [False, True])
def test_gigpo_matches_loop(fnorm, omega, gamma, singleton, with_anchored):
    rewards, groups, eps_, states, anchored = episodes(3)
    anchored = anchored if with_anchored else None
    ours = est.gigpo_advantages(
        rewards, groups, eps_, states, omega=omega, gamma=gamma, fnorm=fnorm, singleton=singleton, anchored=anchored
    )
    expected = loops.gigpo(
        rewards.tolist(),
        GROUPS,
        EPISODES,
        states.tolist(),
        omega=omega,
        gamma=gamma,
        fnorm=fnorm,
        singleton=singleton,
        anchored=None if anchored is None else anchored.tolist(),
    )
    close(ours, expected)


def test_gigpo_special_cases():
    rewards, groups, eps_, states, _ = episodes(4)
    # ω = 0: the episode term alone is Dr.GRPO's centring of the episode returns (F = 1, ε = 0).
    a_e = est.gigpo_advantages(rewards, groups, eps_, states, omega=0.0, eps=0.0)
    returns = torch.zeros(6, **F64).index_add_(0, eps_, rewards)
    ep_group = torch.tensor([4, 4, 4, 1, 1, 9])
    torch.testing.assert_close(a_e, est.grpo_advantages(returns, ep_group, scale="none")[eps_])
    # Every step its own state: no anchor group, A = A_E.
    alone = torch.arange(len(GROUPS))
    torch.testing.assert_close(
        est.gigpo_advantages(rewards, groups, eps_, alone),
        est.gigpo_advantages(rewards, groups, eps_, states, omega=0.0),
    )
    assert est.gigpo_advantages(rewards.float(), groups, eps_, states).dtype == torch.float32


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e[:-1], s), ValueError, "episode_ids must be integers"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e.double(), s), ValueError, "episode_ids must be integers"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e, s[:3]), ValueError, "state_ids must be integers"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, torch.zeros_like(e), s), ValueError, "episode_ids: an episode"),
        (lambda r, g, e, s: est.gigpo_advantages(r.long(), g, e, s), TypeError, "step_rewards must be a floating"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e, s, fnorm="mean"), ValueError, "fnorm must be one of"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e, s, fnorm="std", eps=0.0), ValueError, "eps must be"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e, s, gamma=1.5), ValueError, "gamma must lie in"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e, s, omega="1"), TypeError, "omega must be a real"),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e, s, singleton="one"), ValueError, "singleton must be"),
        (
            lambda r, g, e, s: est.gigpo_advantages(r, g, e, s, anchored=(s > 0)[:3]),
            ValueError,
            "anchored must be bool",
        ),
        (lambda r, g, e, s: est.gigpo_advantages(r, g, e, s, anchored=s), ValueError, "anchored must be bool"),
        (lambda r, g, e, s: est.step_wise_grpo_advantages(r, g, e, scale="token"), ValueError, "scale must be"),
        (lambda r, g, e, s: est.step_wise_grpo_advantages(r, g, e, eps=0.0), ValueError, "eps must be > 0"),
        (lambda r, g, e, s: est.step_wise_grpo_advantages(r, g, e, step_norm=1), TypeError, "step_norm must be a bool"),
        (lambda r, g, e, s: est.step_wise_grpo_advantages(r[:, None], g, e), ValueError, "scores must have 1"),
        (lambda r, g, e, s: est.step_wise_grpo_keep(r, g, e, std_threshold=-1.0), ValueError, "std_threshold must"),
        (lambda r, g, e, s: est.step_wise_grpo_keep(r, g, e, std_threshold=None), TypeError, "std_threshold must"),
    ],
)
def test_bad_input_is_named(call, error, match):
    rewards, groups, eps_, states, _ = episodes(0)
    with pytest.raises(error, match=match):
        call(rewards, groups, eps_, states)


# -- Trinity-RFT 0.6.0 ---------------------------------------------------------------------------------------------

ADV_FN = "trinity/algorithm/advantage_fn/"


class EID:
    """Trinity's `common/experience.py` EID: the ids its `group_by` reads (task, run, step)."""

    def __init__(self, task, run, step):
        self.batch, self.task, self.run, self.step = 0, task, run, step

    tid = property(lambda self: f"{self.batch}/{self.task}")
    rid = property(lambda self: f"{self.batch}/{self.task}/{self.run}")


def trinity(file, name):
    class AdvantageFn:  # AdvantageFn, ExperienceOperator: abstract bases without state
        pass

    class ExperienceOperator:
        pass

    ns = {
        "torch": torch,
        "AdvantageFn": AdvantageFn,
        "ExperienceOperator": ExperienceOperator,
        "aggregate_metrics": lambda *a, **k: {},  # its logging metrics only
    }
    load(source_file("PGLOSS_TRINITY_SRC", "trinity/common/experience.py"), ("group_by",), ns)
    return load(source_file("PGLOSS_TRINITY_SRC", ADV_FN + file), (name,), ns)[name]


def experiences(rewards, states=None, anchored=None, *, step_rewards=True):
    """One Trinity Experience per row: eid (task, run, step), the reward, and in `info` the step reward and the
    state hash (absent where not anchored); without `step_rewards`, the outcome reward on the last step only."""
    steps: dict[int, int] = {}
    last = {e: i for i, e in enumerate(EPISODES)}
    out = []
    for i, (g, e) in enumerate(zip(GROUPS, EPISODES, strict=True)):
        steps[e] = steps.get(e, -1) + 1
        info = {}
        if step_rewards:
            info["step_reward"] = float(rewards[i])
        if states is not None and (anchored is None or anchored[i]):
            info["env_state_hash"] = f"state-{int(states[i])}"
        reward = float(rewards[i]) if step_rewards or last[e] == i else None
        out.append(SimpleNamespace(eid=EID(g, e, steps[e]), reward=reward, info=info, action_mask=torch.ones(3)))
    return out


def read(exps):
    return torch.stack([x.advantages[0] for x in exps]).to(torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch"])
@pytest.mark.parametrize("step_norm", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_step_wise_grpo_matches_trinity(scale, step_norm, seed):
    fn = trinity("multi_step_grpo_advantage.py", "StepWiseGRPOAdvantageFn")(
        enable_step_norm=step_norm, std_cal_level=scale
    )
    scores, groups, eps_, _, _ = episodes(seed)
    exps = experiences(scores)
    kept, _ = fn(exps)
    assert len(kept) == len(exps)
    ours = est.step_wise_grpo_advantages(scores, groups, eps_, scale=scale, step_norm=step_norm, singleton="raw")
    torch.testing.assert_close(read(exps), ours, rtol=0, atol=1e-6)


@pytest.mark.parametrize("threshold", [0.0, 1.0, 1e6])  # all groups of two or more; one; none
def test_step_wise_grpo_keep_matches_trinity(threshold):
    fn = trinity("multi_step_grpo_advantage.py", "StepWiseGRPOAdvantageFn")(std_threshold=threshold)
    scores, groups, eps_, _, _ = episodes(5)
    exps = experiences(scores)
    kept, _ = fn(exps)
    theirs = torch.tensor([any(x is k for k in kept) for x in exps])
    assert torch.equal(theirs, est.step_wise_grpo_keep(scores, groups, eps_, std_threshold=threshold))


@pytest.mark.parametrize(
    "fnorm, omega, gamma", [("none", 1.0, 1.0), ("std", 1.0, 1.0), ("none", 0.5, 0.9), ("std", 2.0, 0.9)]
)
@pytest.mark.parametrize("step_rewards", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gigpo_matches_trinity(fnorm, omega, gamma, step_rewards, seed):
    fn = trinity("gigpo_advantage.py", "GiGPOAdvantageFn")(omega=omega, gamma=gamma, fnorm=fnorm)
    rewards, groups, eps_, states, anchored = episodes(seed)
    if not step_rewards:  # Trinity's fallback: the outcome reward on the last step, 0 on the others
        last = torch.tensor([i == max(j for j, f in enumerate(EPISODES) if f == e) for i, e in enumerate(EPISODES)])
        rewards = torch.where(last, rewards, 0.0)
    exps = experiences(rewards, states, anchored, step_rewards=step_rewards)
    fn(exps)
    ours = est.gigpo_advantages(
        rewards, groups, eps_, states, omega=omega, gamma=gamma, fnorm=fnorm, singleton="raw", anchored=anchored
    )
    torch.testing.assert_close(read(exps), ours, rtol=0, atol=1e-6)
    assert (
        ours - est.gigpo_advantages(rewards, groups, eps_, states, omega=omega, gamma=gamma, fnorm=fnorm)
    ).abs().max() > 1e-3
