"""MaxRL, AsymRE, OPMD, RAE, Clip_B / Clip_V and the multi-turn optimal token baseline against the
trainers' own functions on the same inputs (trainer_sources.py finds them; each test skips cleanly
when its source is absent; verl 0.9.1 is imported directly).

Measured (float64 inputs; max |Δ| over every row and case of the tests below):

    SkyRL compute_maxrl_advantage (skyrl 0.4.0 wheel,         convention="skyrl": 2.2e-16 (3 seeds x 15 rows:
      skyrl/backends/skyrl_train/utils/ppo_utils.py)          0/1 rewards, a group of one, a group without success)
    prime-rl MaxRLAlgorithm.score_group (prime-rl 559b44772)  convention="pgloss": 1.2e-7 (float32 there), same cases
    prime-rl RAEAlgorithm.score_group                         update="sequential": 2.2e-16 over 4 steps of 5-14
                                                              traces, 2 agents, decay 0.9 (and the final baselines)
    Trinity 0.6.0 ASYMREGroupAdvantage / ASYMREAdvantageFn    singleton="raw": 8.9e-8 / 4.4e-16, δ ∈ {-0.1, 0.2}, 3 seeds
    Trinity 0.6.0 OPMDGroupAdvantage / OPMDAdvantageFn        singleton="raw": 3.3e-7 / 3.2e-7 (float32 group
                                                              tensors there), mean and logavgexp τ ∈ {0.5, 1, 3}
    Trinity 0.6.0 ClipBAdvantageFn                            the same mask on 3 seeds x μ ∈ {0.3, 1, 2.5} (33
                                                              tokens clipped in all), its GRPO advantages 0 apart
    Trinity 0.6.0 ClipVAdvantageFn                            convention="trinity": the same mask on 3 seeds x 4
                                                              (μ, max_frac), with and without the cap (301 clipped)
    verl 0.9.1 compute_multi_turn_optimal_token_baseline_advantage   0 on the valid tokens: 3 seeds, holes in the
                                                              mask, an empty row, zero_tail on and off, ρ weights

The differences from the trainers' defaults (docs/reference.md): MaxRL's SkyRL ε moves Â by up to 6e-6 (groups
of two or more) and a group of one keeps its score there; Trinity's groups of one keep their score (Â = s,
0.86 apart on the case measured); RAE per step ("trace") is 0.32 from prime-rl's per-trace recursion on the
case above ("step": 0.27); Clip_V's pgloss convention keeps zero-advantage tokens that Trinity clips (231 of
924 tokens differ over the cases above, whose 0/1 rewards give whole zero-advantage groups).
"""

import asyncio
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from trainer_sources import load, prime_rl, source_file

from pgloss import advantages as est
from pgloss.correction.token_masks import clip_b_mask, clip_v_mask
from pgloss.vocab.entropy import sum_pi_squared

F64 = dict(dtype=torch.float64)


def binary(seed):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([4, 4, 4, 4, 1, 1, 1, 8, 8, 8, 8, 8, 6, 2, 2])  # 6: a group of one; 2: no success
    scores = torch.randint(0, 2, (15,), generator=gen).double()
    scores[13:] = 0.0
    scores[0] = 1.0
    return scores, ids


def real(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(15, generator=gen, **F64), binary(seed)[1]


def outcome_batch(scores, width=4):
    """verl's batch of outcome rewards: the score on the last valid token."""
    mask = torch.ones(scores.shape[0], width, **F64)
    rewards = torch.zeros_like(mask)
    rewards[:, -1] = scores
    return rewards, mask


# -- SkyRL -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_maxrl_matches_skyrl(seed):
    path = source_file(
        "PGLOSS_SKYRL_SRC", "skyrl/backends/skyrl_train/utils/ppo_utils.py", "skyrl_train/utils/ppo_utils.py"
    )
    ns = load(path, ("compute_maxrl_advantage",), {"torch": torch, "np": np, "defaultdict": defaultdict})
    scores, ids = binary(seed)
    rewards, mask = outcome_batch(scores)
    adv, _ = ns["compute_maxrl_advantage"](rewards, mask, np.array(ids.tolist()))
    ours = est.maxrl_advantages(scores, ids, convention="skyrl")
    torch.testing.assert_close(adv, ours[:, None] * mask, rtol=0, atol=1e-15)


def test_maxrl_matches_skyrl_with_an_empty_row():
    """SkyRL counts a row without a valid token in its group's mean (and gives it 0 through the mask)."""
    path = source_file(
        "PGLOSS_SKYRL_SRC", "skyrl/backends/skyrl_train/utils/ppo_utils.py", "skyrl_train/utils/ppo_utils.py"
    )
    ns = load(path, ("compute_maxrl_advantage",), {"torch": torch, "np": np, "defaultdict": defaultdict})
    scores, ids = binary(0)
    rewards, mask = outcome_batch(scores)
    mask[[2, 8]] = 0.0
    adv, _ = ns["compute_maxrl_advantage"](rewards, mask, np.array(ids.tolist()))
    ours = est.maxrl_advantages(scores, ids, convention="skyrl", mask=mask)
    torch.testing.assert_close(adv, ours[:, None] * mask, rtol=0, atol=1e-15)
    assert not torch.allclose(ours, est.maxrl_advantages(scores, ids, mask=mask))  # pgloss leaves the rows out


# -- prime-rl ----------------------------------------------------------------------------------------------------


def trace(reward, agent="a"):
    node = SimpleNamespace(mask=[False, True, True], token_ids=[0, 1, 2], advantages=None)
    return SimpleNamespace(
        reward=float(reward), agent=SimpleNamespace(name=agent, trainable=True), has_error=False, nodes=[node], id=0
    )


def read(traces):
    return [t.nodes[0].advantages[0] for t in traces]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_maxrl_matches_prime_rl(seed):
    algo = prime_rl(("MaxRLAlgorithm", "max_rl.py"))["MaxRLAlgorithm"](None, None)
    scores, ids = binary(seed)
    got = torch.zeros(15, **F64)
    for g in ids.unique():  # prime-rl scores one group at a time
        rows = (ids == g).nonzero()[:, 0].tolist()
        traces = [trace(scores[i]) for i in rows]
        asyncio.run(algo.score_group([SimpleNamespace(traces=traces)]))
        got[rows] = torch.tensor(read(traces), **F64)
    torch.testing.assert_close(got, est.maxrl_advantages(scores, ids), rtol=0, atol=3e-7)


def test_rae_matches_prime_rl_sequential():
    ns = prime_rl(("RAEAlgorithm", "rae.py"))
    algo = ns["RAEAlgorithm"](SimpleNamespace(decay=0.9), None)
    ours = est.RoleBaseline(2, decay=0.9, update="sequential")
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        n = 5 + 3 * step
        keys = torch.randint(0, 2, (n,), generator=gen)
        rewards = torch.randn(n, generator=gen, **F64)
        traces = [trace(r, agent=("first", "second")[k]) for r, k in zip(rewards.tolist(), keys.tolist(), strict=True)]
        asyncio.run(algo.score_group([SimpleNamespace(traces=traces)]))
        torch.testing.assert_close(ours(rewards, keys), torch.tensor(read(traces), **F64), rtol=0, atol=1e-14)
    torch.testing.assert_close(
        ours.baseline, torch.tensor([algo.baselines["first"], algo.baselines["second"]], **F64), rtol=0, atol=1e-14
    )


# -- Trinity-RFT ---------------------------------------------------------------------------------------------------

ADV_FN = "trinity/algorithm/advantage_fn/"


def trinity(file, *names):
    class GroupAdvantage:
        def __init__(self, **kwargs):
            pass

    class AdvantageFn:
        pass

    ns = {
        "torch": torch,
        "np": np,
        "defaultdict": defaultdict,
        "GroupAdvantage": GroupAdvantage,
        "AdvantageFn": AdvantageFn,
        "Deprecated": lambda cls: cls,
        "Dict": dict,
        "List": list,
        "Tuple": tuple,
    }
    return load(source_file("PGLOSS_TRINITY_SRC", ADV_FN + file), names, ns)


def run_group_class(fn, scores, ids):
    out = torch.zeros_like(scores)
    for g in ids.unique():
        rows = (ids == g).nonzero()[:, 0].tolist()
        exps = [SimpleNamespace(reward=float(scores[i]), action_mask=torch.ones(3)) for i in rows]
        fn.calculate_group_advantage(int(g), exps)
        out[rows] = torch.stack([e.advantages[0] for e in exps]).to(out.dtype)
    return out


def run_batch_fn(fn, scores, ids, **extra):
    rewards, mask = outcome_batch(scores)
    batch = {"token_level_rewards": rewards, "response_mask": mask, **extra}
    exps = SimpleNamespace(batch=batch, non_tensor_batch={"uid": np.array(ids.tolist())})
    fn(exps)
    return exps.batch


@pytest.mark.parametrize("delta", [-0.1, 0.2])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_asymre_matches_trinity(delta, seed):
    ns = trinity("asymre_advantage.py", "ASYMREAdvantageFn", "ASYMREGroupAdvantage")
    scores, ids = real(seed)
    ours = est.asymre_advantages(scores, ids, baseline_shift=delta, singleton="raw")
    torch.testing.assert_close(
        run_group_class(ns["ASYMREGroupAdvantage"](baseline_shift=delta), scores, ids), ours, rtol=0, atol=5e-7
    )
    batch = run_batch_fn(ns["ASYMREAdvantageFn"](baseline_shift=delta), scores, ids)
    torch.testing.assert_close(batch["advantages"], ours[:, None] * batch["response_mask"], rtol=0, atol=5e-7)


@pytest.mark.parametrize("baseline, tau", [("mean", 1.0), ("logavgexp", 0.5), ("logavgexp", 1.0), ("logavgexp", 3.0)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_opmd_matches_trinity(baseline, tau, seed):
    ns = trinity("opmd_advantage.py", "OPMDAdvantageFn", "OPMDGroupAdvantage")
    scores, ids = real(seed)
    ours = est.opmd_advantages(scores, ids, baseline=baseline, tau=tau, singleton="raw")
    group = ns["OPMDGroupAdvantage"](opmd_baseline=baseline, tau=tau)
    torch.testing.assert_close(run_group_class(group, scores, ids), ours, rtol=0, atol=5e-7)
    batch = run_batch_fn(ns["OPMDAdvantageFn"](opmd_baseline=baseline, tau=tau), scores, ids)
    torch.testing.assert_close(batch["advantages"], ours[:, None] * batch["response_mask"], rtol=0, atol=5e-7)


def clip_inputs(seed, b=10, t=12, v=7):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=gen, **F64) * 2
    lp_all = torch.log_softmax(logits, -1)
    p = lp_all.exp()
    entropy = -(p * lp_all).sum(-1)
    log_prob = lp_all.gather(-1, torch.randint(0, v, (b, t), generator=gen)[..., None])[..., 0]
    necs = (p * p * (lp_all + entropy[..., None])).sum(-1)
    lengths = torch.randint(3, t + 1, (b,), generator=gen)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.float64)
    scores = torch.randint(0, 2, (b,), generator=gen).double()
    ids = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3])[:b]
    rewards = torch.zeros(b, t, **F64)
    rewards[torch.arange(b), lengths - 1] = scores
    return log_prob, entropy, necs, mask, rewards, scores, ids


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_b_matches_trinity(mu, seed):
    ns = trinity("clipb_advantage.py", "ClipBAdvantageFn")
    lp, h, _, mask, rewards, scores, ids = clip_inputs(seed)
    exps = SimpleNamespace(
        batch={"token_level_rewards": rewards, "response_mask": mask.clone(), "rollout_log_probs": lp, "entropys": h},
        non_tensor_batch={"uid": np.array(ids.tolist())},
    )
    ns["ClipBAdvantageFn"](mu=mu)(exps)
    adv = est.grpo_advantages(scores, ids, convention="verl")
    torch.testing.assert_close(exps.batch["advantages"], adv[:, None] * mask, rtol=0, atol=1e-15)
    assert torch.equal(exps.batch["response_mask"].bool(), clip_b_mask(lp, h, adv, mask.bool(), mu=mu))


@pytest.mark.parametrize("mu, max_frac", [(0.3, 1.0), (1.0, 1.0), (0.3, 0.02), (2.5, 1e-4)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_v_matches_trinity(mu, max_frac, seed):
    ns = trinity("clipv_advantage.py", "ClipVAdvantageFn")
    lp, h, necs, mask, rewards, scores, ids = clip_inputs(seed)
    exps = SimpleNamespace(
        batch={
            "token_level_rewards": rewards,
            "response_mask": mask.clone(),
            "old_log_probs": lp,
            "entropys": h,
            "necs": necs,
        },
        non_tensor_batch={"uid": np.array(ids.tolist())},
    )
    ns["ClipVAdvantageFn"](mu=mu, max_frac=max_frac)(exps)
    adv = est.grpo_advantages(scores, ids, convention="verl")
    ours = clip_v_mask(lp, h, necs, adv, mask.bool(), mu=mu, max_frac=max_frac, convention="trinity")
    assert torch.equal(exps.batch["response_mask"].bool(), ours)


# -- verl ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_tail", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tir_optimal_token_baseline_matches_verl(zero_tail, seed):
    pytest.importorskip("verl")
    from verl.trainer.ppo.core_algos import compute_multi_turn_optimal_token_baseline_advantage as verl_tir

    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([3, 3, 3, 3, 1, 1, 1, 7, 7, 9, 9, 9])
    mask = torch.rand(12, 10, generator=gen) > 0.35
    mask[8] = False
    logits = torch.randn(12, 10, 6, generator=gen, **F64)
    rewards = torch.where(mask, torch.randn(12, 10, generator=gen, **F64), 0.0)
    old, spp = torch.log_softmax(logits, -1)[..., 2], sum_pi_squared(logits)
    weights = 0.8 + 0.4 * torch.rand(12, 10, generator=gen, **F64)
    for w in (None, weights):
        adv, _ = verl_tir(
            rewards, mask.double(), np.array(ids.tolist()), old, spp, rollout_is_weights=w, handle_zero_tail=zero_tail
        )
        ours, _ = est.tir_optimal_token_baseline_advantages(
            rewards, mask, ids, old, spp, rollout_weights=w, zero_tail=zero_tail
        )
        torch.testing.assert_close(ours, adv, rtol=0, atol=1e-14)
