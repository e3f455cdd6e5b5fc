"""FlashREINFORCE's advantage against a plain float64 loop (tests/loops/advantages.py), bad input, and OpenRLHF
0.11.2's own `RemoteExperienceMaker.compute_advantages_and_returns` with `compute_reward` and
`get_cumulative_returns`, read from its source (PGLOSS_OPENRLHF_SRC, trainer_sources.py; skipped when unset).

Measured (float64 inputs, which OpenRLHF keeps in float64; max |Δ| on the valid tokens of the cases below):
0 (bit for bit), without a KL reward and with one (kl_coef 0.05), convention="openrlhf", over 3 seeds x
n_samples_per_prompt 1 and 4, two experiences with shuffled indices, holes in the mask and an empty row.
"""

import itertools
from types import SimpleNamespace

import loops
import pytest
import torch
from trainer_sources import load, source_file

from pgloss import advantages as est
from pgloss.conformance import sources

F64 = dict(dtype=torch.float64)


def sample(seed, batch=8, width=6):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, generator=gen, **F64)
    lengths = torch.randint(1, width + 1, (batch,), generator=gen)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    mask[1, 0] = False  # a hole before the last valid token
    mask[3] = False  # a row without a valid token
    kl = torch.randn(batch, width, generator=gen, **F64).abs()
    return scores, mask, kl


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, **F64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("convention", est.FLASH_REINFORCE_CONVENTIONS)
@pytest.mark.parametrize("with_kl", [False, True])
def test_matches_loop(convention, with_kl):
    scores, mask, kl = sample(0)
    token = -0.1 * kl if with_kl else None
    ours = est.flash_reinforce_advantages(scores, mask, token_rewards=token, convention=convention)
    expected = loops.flash_reinforce(
        scores.tolist(),
        mask.tolist(),
        token_rewards=None if token is None else token.tolist(),
        count_empty=convention == "openrlhf",
    )
    close(ours, expected)


def test_special_cases():
    scores, mask, _ = sample(1)
    mask[3] = True
    ours = est.flash_reinforce_advantages(scores, mask)
    # Without a KL reward: the batch-centred score on every valid token (REINFORCE++-baseline with one group,
    # before its whitening), whose valid tokens sum, weighted by row, to zero.
    torch.testing.assert_close(ours, torch.where(mask, (scores - scores.mean())[:, None], 0.0))
    assert est.flash_reinforce_advantages(scores.float(), mask).dtype == torch.float32
    # The conventions differ only through a row without a valid token.
    torch.testing.assert_close(ours, est.flash_reinforce_advantages(scores, mask, convention="openrlhf"))
    mask[3] = False
    assert not torch.allclose(
        est.flash_reinforce_advantages(scores, mask),
        est.flash_reinforce_advantages(scores, mask, convention="openrlhf"),
    )


def test_masked_values_do_not_reach_the_advantages():
    scores, mask, kl = sample(2)
    clean = est.flash_reinforce_advantages(scores, mask, token_rewards=-kl)
    scores[3] = torch.nan  # the row without a valid token
    kl[~mask] = torch.inf
    torch.testing.assert_close(est.flash_reinforce_advantages(scores, mask, token_rewards=-kl), clean)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda s, m: est.flash_reinforce_advantages(s[:-1], m), ValueError, "mask must have 7 rows"),
        (lambda s, m: est.flash_reinforce_advantages(s[:, None], m), ValueError, "scores must have 1"),
        (lambda s, m: est.flash_reinforce_advantages(s.long(), m), TypeError, "scores must be a floating"),
        (lambda s, m: est.flash_reinforce_advantages(s, m[0]), ValueError, "mask must have 2"),
        (lambda s, m: est.flash_reinforce_advantages(s, m.double() * 2), ValueError, "mask"),
        (lambda s, m: est.flash_reinforce_advantages(s, m, convention="trl"), ValueError, "convention must be"),
        (
            lambda s, m: est.flash_reinforce_advantages(s, m, token_rewards=m.double()[:, :2]),
            ValueError,
            "token_rewards must have shape",
        ),
        (
            lambda s, m: est.flash_reinforce_advantages(s, m, token_rewards=m.long()),
            TypeError,
            "token_rewards must be a floating",
        ),
    ],
)
def test_bad_input_is_named(call, error, match):
    scores, mask, _ = sample(0)
    with pytest.raises(error, match=match):
        call(scores, mask)


# -- OpenRLHF 0.11.2 -----------------------------------------------------------------------------------------------


def openrlhf():
    root = "openrlhf/trainer/ppo_utils/experience_maker.py"
    ns = {
        "torch": torch,
        "itertools": itertools,
        "apply_length_penalties": lambda experiences, args: None,  # DAPO / ProRL penalties: off (options unset)
        "logger": SimpleNamespace(warning=lambda *a: None, info=lambda *a: None),
    }
    load(source_file("PGLOSS_OPENRLHF_SRC", "openrlhf/models/utils.py"), ("compute_reward",), ns)
    return sources.load(  # the methods of its class (trainer_sources.load reads top-level names)
        source_file("PGLOSS_OPENRLHF_SRC", root),
        ("compute_advantages_and_returns", "get_cumulative_returns"),
        ns,
        within="RemoteExperienceMaker",
    )


def run_openrlhf(scores, mask, kl, *, kl_coef, n_samples, clip_range=None):
    """OpenRLHF's experience maker on two experiences holding the rollout's samples in a shuffled order."""
    ns = openrlhf()
    args = SimpleNamespace(
        rollout=SimpleNamespace(n_samples_per_prompt=n_samples),
        reward=SimpleNamespace(clip_range=clip_range),
        algo=SimpleNamespace(advantage=SimpleNamespace(estimator="flash_reinforce", gamma=1.0, no_std_norm=False)),
    )
    maker = SimpleNamespace(strategy=SimpleNamespace(args=args), advantage_estimator="flash_reinforce")
    maker.kl_ctl = SimpleNamespace(value=kl_coef)
    maker.get_cumulative_returns = lambda *a: ns["get_cumulative_returns"](maker, *a)
    order = torch.randperm(scores.shape[0], generator=torch.Generator().manual_seed(3))
    parts = [order[:3], order[3:]]
    exps = [
        SimpleNamespace(index=p.tolist(), rewards=scores[p], action_mask=mask[p].long(), kl=kl[p], info={})
        for p in parts
    ]
    ns["compute_advantages_and_returns"](maker, exps)
    adv = torch.zeros(mask.shape, **F64)
    for p, x in zip(parts, exps, strict=True):
        torch.testing.assert_close(x.advantages, x.returns)
        adv[p] = x.advantages.to(torch.float64)
    return adv


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
@pytest.mark.parametrize("n_samples", [1, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_openrlhf(kl_coef, n_samples, seed):
    scores, mask, kl = sample(seed)
    theirs = run_openrlhf(scores, mask, kl, kl_coef=kl_coef, n_samples=n_samples)
    ours = est.flash_reinforce_advantages(scores, mask, token_rewards=-kl_coef * kl, convention="openrlhf")
    torch.testing.assert_close(torch.where(mask, theirs, 0.0), ours, rtol=0, atol=1e-15)


def test_matches_openrlhf_with_its_default_clip_range():
    """OpenRLHF clamps the centred score to reward.clip_range, (-10, 10) by default: the same below it."""
    scores, mask, kl = sample(4)
    theirs = run_openrlhf(scores, mask, kl, kl_coef=0.0, n_samples=1, clip_range=(-10, 10))
    torch.testing.assert_close(
        torch.where(mask, theirs, 0.0), est.flash_reinforce_advantages(scores, mask, convention="openrlhf")
    )
