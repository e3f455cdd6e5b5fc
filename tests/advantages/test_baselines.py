"""MaxRL, AsymRE, OPMD, RAE's role baseline and the multi-turn optimal token baseline against the plain
float64 loops (tests/loops/advantages.py), their special cases as equivalences, and bad input."""

import loops
import pytest
import torch

from pgloss import advantages as est
from pgloss.vocab.entropy import sum_pi_squared

F64 = dict(dtype=torch.float64)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, **F64), rtol=1e-12, atol=1e-12)


def binary(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([4, 4, 4, 4, 1, 1, 1, 8, 8, 8, 8, 8, 6, 2, 2])  # 6: a group of one; 2: no success
    scores = torch.randint(0, 2, (15,), generator=gen).double()
    scores[13:] = 0.0
    scores[:2] = torch.tensor([1.0, 0.0])
    return scores, ids


@pytest.mark.parametrize("convention", ["pgloss", "skyrl"])
def test_maxrl_matches_loop(convention):
    scores, ids = binary()
    skyrl = convention == "skyrl"
    expected = loops.maxrl_adv(scores.tolist(), ids.tolist(), eps=1e-6 if skyrl else 0.0, skyrl=skyrl)
    close(est.maxrl_advantages(scores, ids, convention=convention), expected)
    assert est.maxrl_advantages(scores, ids)[13:].tolist() == [0.0, 0.0]  # no success: no signal


def test_maxrl_is_the_success_mean_score_function_and_grpo_rescaled():
    # Σ_i Â_i / n = 0 and, for 0/1 rewards, Â_i / n = 1/K on a success minus 1/n on every row: the
    # estimator (1/K) Σ_{success} ∇log π minus the mean score function.
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0, 0.0], **F64)
    ids = torch.zeros(6, dtype=torch.long)
    adv = est.maxrl_advantages(scores, ids)
    close(adv / 6, [1 / 2 - 1 / 6, -1 / 6, -1 / 6, 1 / 2 - 1 / 6, -1 / 6, -1 / 6])
    # Dr.GRPO's centred scores divided by the group mean
    torch.testing.assert_close(adv, est.grpo_advantages(scores, ids, scale="none") / (2 / 6), rtol=1e-12, atol=1e-12)
    # prime-rl's test values
    close(est.maxrl_advantages(torch.tensor([1.0, 0, 0, 0], **F64), torch.zeros(4, dtype=torch.long)), [3, -1, -1, -1])


def test_maxrl_skyrl_differs_by_its_epsilon():
    scores, ids = binary(1)
    multi = torch.tensor([i not in (12,) for i in range(15)])
    paper, skyrl = est.maxrl_advantages(scores, ids), est.maxrl_advantages(scores, ids, convention="skyrl")
    rel = ((paper - skyrl)[multi].abs() / paper[multi].abs().clamp(min=1e-300)).max()
    assert 0 < rel < 1e-5  # ε/μ with μ ≥ 1/n
    assert skyrl[12] == scores[12] and paper[12] == 0  # a group of one
    torch.testing.assert_close(est.maxrl_advantages(scores, ids, eps=1e-6)[multi], skyrl[multi], rtol=1e-15, atol=0)


@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_asymre_matches_loop_and_delta_zero_is_group_mean(singleton):
    gen = torch.Generator().manual_seed(2)
    scores, ids = torch.randn(15, generator=gen, **F64), binary()[1]
    close(
        est.asymre_advantages(scores, ids, baseline_shift=-0.3, singleton=singleton),
        loops.asymre_adv(scores.tolist(), ids.tolist(), -0.3, raw_singleton=singleton == "raw"),
    )
    torch.testing.assert_close(
        est.asymre_advantages(scores, ids, baseline_shift=0.0),
        est.grpo_advantages(scores, ids, scale="none"),
        rtol=1e-12,
        atol=1e-12,
    )
    # a negative shift adds |δ| to every member of a group of two or more
    multi = ids != 6
    torch.testing.assert_close(
        (est.asymre_advantages(scores, ids) - est.opmd_advantages(scores, ids))[multi],
        torch.full((14,), 0.1, **F64),
        rtol=0,
        atol=1e-12,
    )


@pytest.mark.parametrize("tau", [None, 0.3, 2.0])
def test_opmd_matches_loop(tau):
    gen = torch.Generator().manual_seed(3)
    scores, ids = torch.randn(15, generator=gen, **F64), binary()[1]
    kw = dict(baseline="mean") if tau is None else dict(baseline="logavgexp", tau=tau)
    close(est.opmd_advantages(scores, ids, **kw), loops.opmd_adv(scores.tolist(), ids.tolist(), tau=tau))
    close(
        est.opmd_advantages(scores, ids, singleton="raw", **kw),
        loops.opmd_adv(scores.tolist(), ids.tolist(), tau=tau, raw_singleton=True),
    )


def test_opmd_logavgexp_limits():
    scores = torch.tensor([0.0, 1.0, 3.0, 0.5], **F64)
    ids = torch.zeros(4, dtype=torch.long)
    # τ → ∞: the mean; τ → 0: the max (the best response gets 0); large scores: no overflow
    torch.testing.assert_close(
        est.opmd_advantages(scores, ids, baseline="logavgexp", tau=1e7),
        est.opmd_advantages(scores, ids),
        rtol=0,
        atol=1e-6,
    )
    low = est.opmd_advantages(scores, ids, baseline="logavgexp", tau=1e-3)
    assert abs(low[2]) < 2e-3 and torch.isfinite(est.opmd_advantages(scores * 1e4, ids, baseline="logavgexp")).all()


# -- RAE ------------------------------------------------------------------------------------------------


def rae_steps(seed=4, n_steps=4, num_keys=3):
    gen = torch.Generator().manual_seed(seed)
    steps = []
    for s in range(n_steps):
        n = 5 + 3 * s
        keys = torch.randint(0, num_keys - 1, (n,), generator=gen)  # the last key never appears
        steps.append((torch.randn(n, generator=gen, **F64), keys))
    return steps


@pytest.mark.parametrize("update", ["trace", "step", "sequential"])
def test_role_baseline_matches_loop_over_steps(update):
    steps = rae_steps()
    rae = est.RoleBaseline(3, decay=0.8, update=update)
    got = [rae(r, k) for r, k in steps]
    plain = [(r.tolist(), k.tolist()) for r, k in steps]
    if update == "sequential":
        expected, final = loops.rae_sequential(plain, 0.8, 3)
    else:
        expected, final = loops.rae_per_step(plain, 0.8, 3, per_trace=update == "trace")
    for g, e in zip(got, expected, strict=True):
        close(g, e)
    close(rae.baseline, final)
    assert rae.baseline[2] == 0  # an absent key keeps its baseline


def test_role_baseline_trace_equals_sequential_with_one_row_per_key_or_equal_rewards():
    a, b = est.RoleBaseline(2, decay=0.9), est.RoleBaseline(2, decay=0.9, update="sequential")
    for r in ([1.0, -1.0], [0.5, 0.25]):
        torch.testing.assert_close(
            a(torch.tensor(r, **F64), torch.tensor([0, 1])),
            b(torch.tensor(r, **F64), torch.tensor([0, 1])),
            rtol=1e-14,
            atol=1e-14,
        )
    keys = torch.tensor([0, 0, 0, 1])
    a(torch.tensor([1.0, 1.0, 1.0, 2.0], **F64), keys)
    b(torch.tensor([1.0, 1.0, 1.0, 2.0], **F64), keys)
    torch.testing.assert_close(a.baseline, b.baseline, rtol=1e-14, atol=1e-14)
    # unequal rewards within a step: the recursion weighs the later one more; the two differ
    a(torch.tensor([0.0, 1.0], **F64), torch.tensor([0, 0]))
    b(torch.tensor([0.0, 1.0], **F64), torch.tensor([0, 0]))
    assert not torch.allclose(a.baseline, b.baseline)


def test_role_baseline_does_not_depend_on_row_order_or_pieces():
    r, k = rae_steps()[2]
    perm = torch.randperm(r.shape[0], generator=torch.Generator().manual_seed(0))
    a, b, c = (est.RoleBaseline(3, decay=0.9) for _ in range(3))
    a(r, k), b(r[perm], k[perm])
    torch.testing.assert_close(a.baseline, b.baseline, rtol=1e-14, atol=1e-15)
    first = c.advantages(r, k)
    torch.testing.assert_close(first, r)  # starts at 0
    c.update(r, k)
    torch.testing.assert_close(c.baseline, a.baseline)


def test_role_baseline_state_dict_round_trip():
    steps = rae_steps()
    a = est.RoleBaseline(3, decay=0.8)
    a(*steps[0])
    b = est.RoleBaseline(3, decay=0.8)
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(a(*steps[1]), b(*steps[1]))
    with pytest.raises(ValueError, match="decay"):
        est.RoleBaseline(3, decay=0.5).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match=r"shape \[2\]"):
        est.RoleBaseline(2, decay=0.8).load_state_dict(a.state_dict())


@pytest.mark.parametrize("update", ["trace", "step", "sequential"])
def test_role_baseline_runs_on_meta_without_host_reads(update):
    rae = est.RoleBaseline(3, update=update)
    out = rae(torch.zeros(6, device="meta"), torch.zeros(6, dtype=torch.long, device="meta"))
    assert out.device.type == "meta" and rae.baseline.device.type == "meta"


def test_role_baseline_keeps_the_reward_dtype():
    out = est.RoleBaseline(2)(torch.tensor([1.0, 0.0], requires_grad=True), torch.tensor([0, 1]))
    assert out.dtype == torch.float32 and not out.requires_grad


# -- the multi-turn optimal token baseline ------------------------------------------------------------------


def tir_inputs(seed=5):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([3, 3, 3, 3, 1, 1, 1, 7, 7, 9, 9, 9])
    mask = torch.rand(12, 10, generator=gen) > 0.35  # holes: tool output between turns
    mask[8] = False  # an empty row: group 7 has one response left
    mask[9, 2:] = False
    logits = torch.randn(12, 10, 6, generator=gen, **F64)
    rewards = torch.where(mask, torch.randn(12, 10, generator=gen, **F64), 0.0)
    return rewards, mask, ids, torch.log_softmax(logits, -1)[..., 2], sum_pi_squared(logits)


@pytest.mark.parametrize("zero_tail", [True, False])
def test_tir_optimal_token_baseline_matches_loop(zero_tail):
    rewards, mask, ids, old, spp = tir_inputs()
    adv, ret = est.tir_optimal_token_baseline_advantages(rewards, mask, ids, old, spp, zero_tail=zero_tail)
    close(
        adv,
        loops.tir_optimal_token_baseline(
            rewards.tolist(), mask.tolist(), ids.tolist(), old.tolist(), spp.tolist(), zero_tail=zero_tail
        ),
    )
    close(ret, loops.returns(rewards.tolist(), mask.tolist(), 1.0))


def test_tir_equals_single_turn_without_holes():
    rewards, mask, ids, old, spp = tir_inputs(6)
    prefix = torch.arange(10)[None, :] < mask.sum(-1, keepdim=True).clamp(min=1)
    rewards = torch.where(prefix, rewards + 0.1, 0.0)
    for zero_tail in (True, False):
        tir = est.tir_optimal_token_baseline_advantages(rewards, prefix, ids, old, spp, zero_tail=zero_tail)
        single = est.optimal_token_baseline_advantages(rewards, prefix, ids, old, spp, zero_tail=zero_tail)
        torch.testing.assert_close(tir[0], single[0], rtol=1e-13, atol=1e-13)
    # with holes the two pool different tokens
    holes = est.tir_optimal_token_baseline_advantages(*tir_inputs()[:5])[0]
    assert not torch.allclose(holes, est.optimal_token_baseline_advantages(*tir_inputs()[:5])[0])


# -- bad input ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda s, i: est.maxrl_advantages(s, i, convention="verl"), ValueError, "convention must be one of"),
        (lambda s, i: est.maxrl_advantages(s, i, eps=-1.0), ValueError, "eps must be >= 0"),
        (lambda s, i: est.maxrl_advantages(s, i[:3]), ValueError, "group_ids must be integers"),
        (lambda s, i: est.asymre_advantages(s, i, baseline_shift="-0.1"), TypeError, "baseline_shift"),
        (lambda s, i: est.asymre_advantages(s, i, singleton="mean"), ValueError, "singleton must be one of"),
        (lambda s, i: est.opmd_advantages(s, i, baseline="max"), ValueError, "baseline must be one of"),
        (lambda s, i: est.opmd_advantages(s, i, baseline="logavgexp", tau=0.0), ValueError, "tau must be > 0"),
        (lambda s, i: est.RoleBaseline(0), ValueError, "num_keys"),
        (lambda s, i: est.RoleBaseline(2, decay=1.0), ValueError, "decay must lie in"),
        (lambda s, i: est.RoleBaseline(2, update="order"), ValueError, "update must be one of"),
        (lambda s, i: est.RoleBaseline(2)(s, i), ValueError, r"keys must lie in \[0, 2\)"),
        (lambda s, i: est.RoleBaseline(20)(s, i.double()), ValueError, "keys must be integers"),
        (lambda s, i: est.RoleBaseline(20, update="sequential").update(s, i), ValueError, "sequential"),
        (
            lambda s, i: est.tir_optimal_token_baseline_advantages(
                s[:, None], torch.ones(15, 1, dtype=torch.bool), i, s[:, None], None
            ),
            TypeError,
            "sum_pi_sq",
        ),
    ],
)
def test_bad_input_is_named(call, error, match):
    scores, ids = binary()
    with pytest.raises(error, match=match):
        call(scores, ids)


# -- RAE over two gloo ranks (run by tests/properties/test_two_ranks_step_statistics.py) -----------------

RANK_ROWS = {0: slice(0, 4), 1: slice(4, None)}


def _rae_states(rows):
    out = {}
    for update in ("trace", "step", "sequential"):
        rae = est.RoleBaseline(3, decay=0.8, update=update)
        out[update] = torch.cat([rae(r[rows], k[rows]) for r, k in rae_steps()] + [rae.baseline])
    return out


def on_rank(rank):
    return _rae_states(RANK_ROWS[rank])


def check_ranks(results):
    whole = _rae_states(slice(None))
    for update, expected in whole.items():
        got, offsets = [], [0, 0]
        for r, _ in rae_steps():  # each step: rank 0 holds the first 4 rows, rank 1 the rest
            for rank, n in ((0, 4), (1, r.shape[0] - 4)):
                got.append(results[rank][update][offsets[rank] : offsets[rank] + n])
                offsets[rank] += n
        torch.testing.assert_close(torch.cat(got), expected[:-3], rtol=1e-12, atol=1e-12, msg=update)
        for rank in (0, 1):  # every rank holds the same baseline
            torch.testing.assert_close(results[rank][update][-3:], expected[-3:], rtol=1e-12, atol=1e-12, msg=update)
    # one process on its own rows only would hold another baseline: the comparison can fail
    assert not torch.allclose(_rae_states(RANK_ROWS[0])["trace"][-3:], whole["trace"][-3:])


# -- rows without a sampled token ---------------------------------------------------------------------------------


def empty_rows(n, seed=0):
    """A token mask `[n, 5]` with some rows empty (a trace without sampled tokens), and its row flags."""
    gen = torch.Generator().manual_seed(seed + 50)
    lengths = torch.randint(0, 6, (n,), generator=gen)
    lengths[[i for i in (1, 5, 12) if i < n]] = 0  # row 12 is binary()'s group of one: no counted row there
    mask = torch.arange(5)[None, :] < lengths[:, None]
    return mask, mask.any(-1).tolist()


def test_maxrl_leaves_a_row_without_tokens_out_as_prime_rl_and_skyrl_counts_it():
    """One group, rewards [1, 0, 0], the third row empty: prime-rl's group mean is over [1, 0]."""
    scores, ids = torch.tensor([1.0, 0.0, 0.0], **F64), torch.zeros(3, dtype=torch.long)
    mask = torch.tensor([[True, True], [True, False], [False, False]])
    for convention in ("pgloss", "prime-rl"):
        close(est.maxrl_advantages(scores, ids, convention=convention, mask=mask), [1.0, -1.0, 0.0])
        close(est.maxrl_advantages(scores, ids, convention=convention, mask=mask.any(-1)), [1.0, -1.0, 0.0])
    close(est.maxrl_advantages(scores, ids), [2.0, -1.0, -1.0])  # no mask: every row counts
    close(
        est.maxrl_advantages(scores, ids, convention="skyrl", mask=mask),
        [(2 / 3) / (1 / 3 + 1e-6), (-1 / 3) / (1 / 3 + 1e-6), 0.0],
    )


@pytest.mark.parametrize("convention", ["pgloss", "skyrl"])
def test_maxrl_with_empty_rows_matches_loop(convention):
    scores, ids = binary()
    mask, rows = empty_rows(15)
    skyrl = convention == "skyrl"
    expected = loops.maxrl_adv(
        scores.tolist(), ids.tolist(), eps=1e-6 if skyrl else 0.0, skyrl=skyrl, rows=None if skyrl else rows
    )
    expected = [e if r else 0.0 for e, r in zip(expected, rows, strict=True)]
    close(est.maxrl_advantages(scores, ids, convention=convention, mask=mask), expected)


@pytest.mark.parametrize("singleton", ["zero", "raw"])
def test_asymre_and_opmd_with_empty_rows_match_loop(singleton):
    scores, ids = binary()
    scores = scores + torch.linspace(0, 1, 15, **F64)  # distinct rewards, so that every left-out row matters
    mask, rows = empty_rows(15, seed=1)
    raw = singleton == "raw"
    close(
        est.asymre_advantages(scores, ids, baseline_shift=0.2, singleton=singleton, mask=mask),
        loops.asymre_adv(scores.tolist(), ids.tolist(), 0.2, raw_singleton=raw, rows=rows),
    )
    for tau in (None, 0.5):
        kw = {} if tau is None else dict(baseline="logavgexp", tau=tau)
        close(
            est.opmd_advantages(scores, ids, singleton=singleton, mask=mask, **kw),
            loops.opmd_adv(scores.tolist(), ids.tolist(), tau=tau, raw_singleton=raw, rows=rows),
        )


def test_rloo_and_grpo_with_empty_rows_match_loop():
    scores, ids = binary()
    scores = scores + torch.linspace(0, 1, 15, **F64)
    mask, rows = empty_rows(15, seed=2)
    close(est.rloo_advantages(scores, ids, mask=mask), loops.rloo(scores.tolist(), ids.tolist(), rows=rows))
    for name, conv in est.STD_CONVENTIONS.items():
        for scale in est.SCALES:
            counted = None if conv.counts_empty_rows else rows
            expected = loops.grpo(
                scores.tolist(), ids.tolist(), eps=conv.eps, singleton=conv.singleton, scale=scale, rows=counted
            )
            if scale != "group" and conv.singleton == "raw":  # verl has no batch / none scaling: μ = 0 only
                expected[12] = scores[12].item()
            expected = [e if r else 0.0 for e, r in zip(expected, rows, strict=True)]
            close(est.grpo_advantages(scores, ids, convention=name, scale=scale, mask=mask), expected)
    one = torch.tensor([1.0, 0.0, 0.0], **F64), torch.zeros(3, dtype=torch.long), torch.tensor([True, True, False])
    close(est.grpo_advantages(*one[:2], mask=one[2]), [0.5 / (0.5**0.5 + 1e-6), -0.5 / (0.5**0.5 + 1e-6), 0.0])
    close(
        est.grpo_advantages(*one[:2], convention="verl", mask=one[2]),
        [(2 / 3) / ((1 / 3) ** 0.5 + 1e-6), (-1 / 3) / ((1 / 3) ** 0.5 + 1e-6), 0.0],
    )


def test_role_baseline_leaves_a_trace_without_tokens_out_as_prime_rl():
    """Decay 0.9, one role, rewards [1, 2], the first trace empty: prime-rl scores the second alone."""
    rewards, keys, mask = torch.tensor([1.0, 2.0], **F64), torch.zeros(2, dtype=torch.long), torch.tensor([False, True])
    for update in ("sequential", "trace", "step"):
        rae = est.RoleBaseline(1, decay=0.9, update=update)
        close(rae(rewards, keys, mask=mask), [0.0, 2.0])
        close(rae.baseline, [0.2])
    rae = est.RoleBaseline(1, decay=0.9, update="sequential")
    close(rae(rewards, keys), [1.0, 1.9])  # without the mask the empty trace counts
    close(rae.baseline, [0.29])


@pytest.mark.parametrize("update", ["trace", "step", "sequential"])
def test_role_baseline_with_empty_rows_matches_loop(update):
    steps = rae_steps()
    masks = [empty_rows(len(r), seed=s)[0][:, :3] for s, (r, _) in enumerate(steps)]
    rows = [m.any(-1).tolist() for m in masks]
    assert not all(all(r) for r in rows)
    rae = est.RoleBaseline(3, decay=0.8, update=update)
    got = [rae(r, k, mask=m) for (r, k), m in zip(steps, masks, strict=True)]
    plain = [(r.tolist(), k.tolist()) for r, k in steps]
    if update == "sequential":
        expected, final = loops.rae_sequential(plain, 0.8, 3, rows=rows)
    else:
        expected, final = loops.rae_per_step(plain, 0.8, 3, per_trace=update == "trace", rows=rows)
    for g, e in zip(got, expected, strict=True):
        close(g, e)
    close(rae.baseline, final)


def test_mask_of_the_wrong_shape_is_refused():
    scores, ids = binary()
    with pytest.raises(ValueError, match=r"mask must have 15 rows \(one per score\), got shape \(14, 5\)"):
        est.maxrl_advantages(scores, ids, mask=torch.ones(14, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        est.rloo_advantages(scores, ids, mask=torch.full((15,), 2.0))
