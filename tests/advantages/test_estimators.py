"""Advantage estimators against plain float64 loops (tests/loops/advantages.py), bad input, and the
global statistics over two gloo ranks (`on_rank`, `check_ranks`: run by properties/test_two_ranks_step_statistics.py)."""

import loops
import pytest
import torch

from pgloss import advantages as est
from pgloss.vocab.entropy import sum_pi_squared

F64 = dict(dtype=torch.float64)


def sample(seed=0, batch=12):
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(batch, generator=gen, **F64)
    scores[torch.rand(batch, generator=gen) < 0.3] = 0.0  # some zero rewards (GPG's α counts them)
    ids = torch.tensor([5, 5, 5, 5, 2, 2, 2, 9, 9, 9, 9, 7][:batch])  # the last group has one member
    lengths = torch.randint(1, 9, (batch,), generator=gen)
    mask = torch.arange(8)[None, :] < lengths[:, None]
    return scores, ids, lengths, mask


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, **F64), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("convention", list(est.STD_CONVENTIONS))
@pytest.mark.parametrize("scale", est.SCALES)
def test_grpo_conventions_match_loop(convention, scale):
    scores, ids, _, _ = sample()
    conv = est.STD_CONVENTIONS[convention]
    expected = loops.grpo(scores.tolist(), ids.tolist(), eps=conv.eps, singleton=conv.singleton, scale=scale)
    if scale != "group" and conv.singleton == "raw":  # verl has no batch / none scaling: μ = 0 only
        expected[-1] = scores[-1].item()
    close(est.grpo_advantages(scores, ids, convention=convention, scale=scale), expected)


def test_conventions_give_different_advantages():
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0], **F64)
    ids = torch.zeros(4, dtype=torch.long)
    verl, trl = (est.grpo_advantages(scores, ids, convention=c) for c in ("verl", "trl"))
    assert not torch.allclose(verl, trl, rtol=1e-6, atol=0)  # 1e-6 vs 1e-4 in the divisor
    torch.testing.assert_close(verl, est.grpo_advantages(scores, ids, convention="pgloss"))
    from pgloss.advantages.group import group_advantages

    torch.testing.assert_close(est.grpo_advantages(scores, ids), group_advantages(scores, ids))


def test_rloo_matches_loop_and_equals_scaled_group_centering():
    scores, ids, _, _ = sample(1)
    close(est.rloo_advantages(scores, ids), loops.rloo(scores.tolist(), ids.tolist()))
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1])
    centered = est.grpo_advantages(scores, group, scale="none")
    sizes = torch.tensor([4.0] * 4 + [8.0] * 8, **F64)
    torch.testing.assert_close(est.rloo_advantages(scores, group), centered * sizes / (sizes - 1))


@pytest.mark.parametrize("gamma", [1.0, 0.9])
@pytest.mark.parametrize("convention", ["verl", "openrlhf"])
def test_reinforce_pp_matches_loop(gamma, convention):
    _, _, _, mask = sample(2)
    mask[:, 3] &= torch.arange(12) % 3 != 0  # holes: tool output inside a response
    rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(3), **F64)
    adv, ret = est.reinforce_pp_advantages(rewards, mask, gamma=gamma, convention=convention)
    expected_ret = loops.returns(rewards.tolist(), mask.tolist(), gamma)
    close(ret, expected_ret)
    close(adv, loops.whiten(expected_ret, mask.tolist(), openrlhf=convention == "openrlhf"))


def test_reinforce_pp_baseline_matches_loop():
    scores, ids, _, mask = sample(4)
    centered = loops.grpo(scores.tolist(), ids.tolist(), eps=0, singleton="raw", scale="none")
    token = [[c] * mask.shape[1] for c in centered]
    close(est.reinforce_pp_baseline_advantages(scores, ids, mask), loops.whiten(token, mask.tolist()))


def test_remax_is_return_minus_greedy_reward():
    _, _, _, mask = sample(5)
    rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6), **F64)
    baseline = torch.randn(12, generator=torch.Generator().manual_seed(7), **F64)
    adv, ret = est.remax_advantages(rewards, mask, baseline)
    expected = loops.returns(rewards.tolist(), mask.tolist(), 1.0)
    close(ret, expected)
    close(
        adv,
        [
            [g - b if m else 0.0 for g, m in zip(row, mrow, strict=True)]
            for row, mrow, b in zip(expected, mask.tolist(), baseline.tolist(), strict=True)
        ],
    )


def test_opo_matches_loop_and_is_rloo_free_length_weighting():
    scores, ids, lengths, _ = sample(8)
    close(est.opo_advantages(scores, ids, lengths), loops.opo(scores.tolist(), ids.tolist(), lengths.tolist()))
    # equal lengths: the baseline is the plain group mean
    equal = torch.full_like(lengths, 4)
    multi = ids != 7
    torch.testing.assert_close(
        est.opo_advantages(scores, ids, equal)[multi], est.grpo_advantages(scores, ids, scale="none")[multi]
    )


def test_gpg_matches_loop():
    scores, ids, _, _ = sample(9)
    assert 0 < int((scores != 0).sum()) < 12
    close(est.gpg_advantages(scores, ids, f_norm=2.0), loops.gpg_advantages(scores.tolist(), ids.tolist(), 2.0))


@pytest.mark.parametrize("scale", [True, False])
def test_passk_matches_loop(scale):
    scores, ids, _, _ = sample(10, batch=11)
    close(est.passk_advantages(scores, ids, scale=scale), loops.passk(scores.tolist(), ids.tolist(), scale=scale))
    ties = est.passk_advantages(torch.tensor([1.0, 1.0, 0.0], **F64), torch.zeros(3, dtype=torch.long), scale=False)
    assert ties.tolist() == [0.0, 0.0, 0.0]  # the best and the second best are equal: no advantage


@pytest.mark.parametrize("convention", ["trl", "ms-swift"])
def test_gdpo_matches_loop(convention):
    gen = torch.Generator().manual_seed(11)
    scores = torch.stack([torch.randint(0, 2, (12,), generator=gen).double(), torch.rand(12, generator=gen, **F64)], 1)
    _, ids, _, _ = sample()
    weights = torch.tensor([1.0, 0.5], **F64)
    out = est.gdpo_advantages(scores, ids, weights=weights, convention=convention)
    if convention == "trl":
        close(out, loops.gdpo_trl(scores.tolist(), ids.tolist(), weights.tolist()))
    else:  # ε = 1e-8 instead of 1e-4
        assert not torch.allclose(
            out, est.gdpo_advantages(scores, ids, weights=weights, convention="trl"), rtol=1e-7, atol=0
        )


def test_gdpo_verl_whitens_per_reward_group_scores_over_tokens():
    gen = torch.Generator().manual_seed(12)
    scores = torch.rand(12, 2, generator=gen, **F64)
    _, ids, _, mask = sample()
    out = est.gdpo_advantages(scores, ids, convention="verl", mask=mask)
    per_key = [loops.grpo(scores[:, j].tolist(), ids.tolist(), eps=1e-6, singleton="raw") for j in range(2)]
    total = [[per_key[0][i] + per_key[1][i]] * mask.shape[1] for i in range(12)]
    close(out, loops.whiten(total, mask.tolist()))


def test_outputs_are_detached_and_keep_dtype():
    scores, ids, lengths, mask = sample()
    s32 = scores.float().requires_grad_(True)
    outs = [
        est.grpo_advantages(s32, ids),
        est.rloo_advantages(s32, ids),
        est.gpg_advantages(s32, ids),
        est.opo_advantages(s32, ids, lengths),
        est.passk_advantages(s32[:11], ids[:11]),
        est.reinforce_pp_baseline_advantages(s32, ids, mask),
    ]
    for out in outs:
        assert out.dtype == torch.float32 and not out.requires_grad


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda s, i: est.grpo_advantages(s, i, convention="nemo"), ValueError, "convention must be one of"),
        (lambda s, i: est.grpo_advantages(s, i, scale="token"), ValueError, "scale must be one of"),
        (lambda s, i: est.grpo_advantages(s[:, None], i), ValueError, "scores must have 1 dimensions"),
        (lambda s, i: est.rloo_advantages(s, i.double()), ValueError, "group_ids must be integers"),
        (lambda s, i: est.rloo_advantages(s, i[:3]), ValueError, r"group_ids must be integers of shape \[12\]"),
        (lambda s, i: est.rloo_advantages(s.tolist(), i), TypeError, "scores must be a torch.Tensor"),
        (lambda s, i: est.passk_advantages(s, i), ValueError, "two responses per group"),
        (lambda s, i: est.gpg_advantages(s, i, f_norm=0.0), ValueError, "f_norm"),
        (lambda s, i: est.opo_advantages(s, i, torch.ones(3, dtype=torch.long)), ValueError, "lengths"),
        (lambda s, i: est.gdpo_advantages(s[:, None], i, convention="verl"), ValueError, "needs mask"),
        (lambda s, i: est.gdpo_advantages(s[:, None], i, convention="x"), ValueError, "convention"),
        (lambda s, i: est.gdpo_advantages(s[:, None], i, weights=torch.ones(2)), ValueError, "one entry per reward"),
        (
            lambda s, i: est.discounted_returns(s[:, None], torch.ones(12, 1, dtype=torch.bool), gamma=1.5),
            ValueError,
            "gamma",
        ),
        (
            lambda s, i: est.whiten(s[:, None], torch.ones(12, 1, dtype=torch.bool), convention="x"),
            ValueError,
            "convention",
        ),
        (
            lambda s, i: est.remax_advantages(s[:, None], torch.ones(12, 1, dtype=torch.bool), s[:3]),
            ValueError,
            "baseline",
        ),
        (lambda s, i: sum_pi_squared(s[:, None], temperature=0.0), ValueError, "temperature"),
        (
            lambda s, i: est.optimal_token_baseline_advantages(
                s[:, None], torch.ones(12, 1, dtype=torch.bool), i, s[:, None], s[:3, None]
            ),
            ValueError,
            "sum_pi_sq must have",
        ),
    ],
)
def test_bad_input_is_named(call, error, match):
    scores, ids, _, _ = sample()
    with pytest.raises(error, match=match):
        call(scores, ids)


# -- global statistics over two gloo ranks (run by tests/properties/test_two_ranks_step_statistics.py) ----------

ROWS = {0: slice(0, 4), 1: slice(4, 12)}  # whole groups per rank, uneven on purpose


def _global_statistics(rows):
    scores, ids, _, mask = sample(13)
    rewards = torch.randn(mask.shape, generator=torch.Generator().manual_seed(14), **F64)
    p = rows
    return {
        "batch": est.grpo_advantages(scores[p], ids[p], convention="trl", scale="batch"),
        "gpg": est.gpg_advantages(scores[p], ids[p]),
        "rpp": est.reinforce_pp_advantages(rewards[p], mask[p], gamma=0.95)[0],
        "rppb": est.reinforce_pp_baseline_advantages(scores[p], ids[p], mask[p]),
        "gdpo": est.gdpo_advantages(torch.stack([scores[p], scores[p].abs()], 1), ids[p]),
        "flash": est.flash_reinforce_advantages(scores[p], mask[p], token_rewards=rewards[p]),
    }


def on_rank(rank):
    return _global_statistics(ROWS[rank])


def check_ranks(results):
    whole = _global_statistics(slice(None))
    for name, expected in whole.items():
        got = torch.cat([results[0][name], results[1][name]])
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=name)
    # a per-rank statistic would differ: the comparison can fail
    local = _global_statistics(ROWS[0])
    assert not torch.allclose(local["rpp"], whole["rpp"][:4]) and not torch.allclose(local["gpg"], whole["gpg"][:4])
    assert not torch.allclose(local["flash"], whole["flash"][:4])


def otb_inputs(seed=15):
    gen = torch.Generator().manual_seed(seed)
    _, ids, lengths, mask = sample(seed)
    logits = torch.randn(12, 8, 5, generator=gen, **F64)
    rewards = torch.where(mask, torch.randn(12, 8, generator=gen, **F64), 0.0)
    old = torch.log_softmax(logits, -1)[..., 0]
    return rewards, mask, ids, old, logits


def test_sum_pi_squared_is_exact():
    *_, logits = otb_inputs()
    for tau in (1.0, 0.7):
        expected = torch.softmax(logits / tau, -1).square().sum(-1)
        torch.testing.assert_close(
            sum_pi_squared(logits, temperature=tau, chunk_size=7), expected, rtol=1e-12, atol=1e-14
        )


@pytest.mark.parametrize("zero_tail", [True, False])
def test_optimal_token_baseline_matches_loop(zero_tail):
    rewards, mask, ids, old, logits = otb_inputs()
    spp = sum_pi_squared(logits)
    adv, ret = est.optimal_token_baseline_advantages(rewards, mask, ids, old, spp, zero_tail=zero_tail)
    exp_adv, exp_ret = loops.optimal_token_baseline(
        rewards.tolist(), mask.tolist(), ids.tolist(), old.tolist(), spp.tolist(), zero_tail=zero_tail
    )
    close(ret, exp_ret)
    close(adv, exp_adv)
