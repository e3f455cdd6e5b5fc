"""On-policy distillation (losses/opd.py: `opd`, `iw_opd`) against the float64 loop of tests/loops/losses.py,
gradcheck, the policy-gradient identity at ratio one, and parity with TRL 1.16's IW-OPD loss.

Measured against TRL's `IWOPDTrainer._compute_iw_opd_loss` (6 seeds × γ ∈ {0, 0.5, 2}; sampled-token
log-probs from 6 × 7 × 13 logits, TRL's rollout log-probs as pgloss's old_log_prob): the gradient with
respect to the logits is identical (0) in float64 and float32; the value differs by 1.1e-15 (float64)
and 3.7e-6 (float32) relative to it, a token mean of terms of both signs.
"""

import types
from collections import defaultdict

import loops
import pytest
import torch
from conftest import make_batch

import pgloss


def call(alg, data, lp=None):
    lp = data["log_prob"] if lp is None else lp
    return alg(lp, data["old_log_prob"], data["advantages"], data["mask"], teacher_log_prob=data["teacher_log_prob"])


@pytest.mark.parametrize("surrogate", ["ratio", "log_prob"])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("discount", [0.0, 0.9])
def test_opd_matches_loop(surrogate, gamma, mode, discount):
    data = make_batch(batch=7, length=6, seed=3, spread=0.5, per_token_adv=True)
    lp, old, adv, mask = loops.lists(data)
    values = loops.opd(
        lp,
        old,
        data["teacher_log_prob"].tolist(),
        adv,
        mask,
        coef=0.7,
        gamma=gamma,
        surrogate=surrogate,
        discount=discount,
    )
    alg = pgloss.get(
        "opd",
        opd_coef=0.7,
        opd_position_gamma=gamma,
        opd_surrogate=surrogate,
        loss_agg_mode=mode,
        opd_discount=discount,
    )
    assert call(alg, data).loss.item() == pytest.approx(loops.aggregate(values, mask, mode), rel=1e-12, abs=1e-14)


def test_the_discount_runs_over_valid_tokens():
    """A multi-turn mask (tool output between the turns): γ_KL counts the valid tokens between two, not the columns."""
    data = make_batch(batch=5, length=7, seed=5, spread=0.5)
    data["mask"][:, 2:4] = False
    lp, old, adv, mask = loops.lists(data)
    assert sum(map(sum, mask)) > 10 and any(row[1] and row[4] for row in mask)
    values = loops.opd(lp, old, data["teacher_log_prob"].tolist(), adv, mask, discount=0.8)
    out = call(pgloss.get("opd", opd_discount=0.8), data)
    expected = torch.tensor(values, dtype=torch.float64)[data["mask"]]
    torch.testing.assert_close(out.per_token[data["mask"]], expected, rtol=1e-12, atol=1e-14)


PRIME_RL = dict(opd_advantage_policy="current", opd_trust_region=0.05)


@pytest.mark.parametrize("trust_region", [None, 0.05])
@pytest.mark.parametrize("gamma", [0.0, 0.5])
def test_prime_rl_conventions_match_loop(gamma, trust_region):
    """The advantage against the current policy and the trust region (prime-rl's conventions)."""
    data = make_batch(batch=7, length=6, seed=4, spread=0.5, per_token_adv=True)
    lp, old, adv, mask = loops.lists(data)
    values = loops.opd(
        lp,
        old,
        data["teacher_log_prob"].tolist(),
        adv,
        mask,
        coef=0.7,
        gamma=gamma,
        current=True,
        trust_region=trust_region,
    )
    alg = pgloss.get("opd", opd_coef=0.7, opd_position_gamma=gamma, **dict(PRIME_RL, opd_trust_region=trust_region))
    out = call(alg, data)
    assert out.loss.item() == pytest.approx(loops.aggregate(values, mask, "token-mean"), rel=1e-12, abs=1e-14)
    dropped = sum(
        v == 0.0 and m for row, mrow in zip(values, mask, strict=True) for v, m in zip(row, mrow, strict=True)
    )
    assert (dropped > 0) == (trust_region is not None)  # the case drops tokens: the rule is exercised
    if trust_region is not None:
        assert out.metrics["opd_trust_region_frac"].item() == pytest.approx(dropped / sum(map(sum, mask)))


def test_iw_opd_is_trls_configuration():
    alg = pgloss.get("iw_opd")
    assert (alg.opd_position_gamma, alg.opd_position_eps, alg.opd_surrogate, alg.loss_agg_mode) == (
        0.5,
        1e-8,
        "log_prob",
        "token-mean",
    )


@pytest.mark.parametrize(
    "name, options", [("opd", {}), ("iw_opd", {}), ("opd", dict(opd_trust_region=0.05, opd_discount=0.9))]
)
def test_gradcheck(name, options):
    data = make_batch(batch=5, length=4, seed=6, spread=0.3)
    x = data["log_prob"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: call(pgloss.get(name, **options), data, y).loss, (x,))


def test_the_advantage_against_the_current_policy_is_detached():
    """With prime-rl's conventions ∂L/∂log π_θ = -keep·r·(log π_T - log π_θ)/N: the advantage reads the current
    log-probs without being differentiated (gradcheck would differentiate it), dropped tokens give nothing."""
    data = make_batch(batch=6, length=5, seed=9, spread=0.5)
    data["advantages"] = torch.zeros(6, dtype=torch.float64)
    x = data["log_prob"].clone().requires_grad_()
    call(pgloss.get("opd", **PRIME_RL), data, x).loss.backward()
    lp, old, teacher, mask = data["log_prob"], data["old_log_prob"], data["teacher_log_prob"], data["mask"]
    keep = mask & (lp.exp() - old.exp() >= -0.05)
    assert 0 < keep.sum() < mask.sum()
    expected = torch.where(keep, -(lp - old).exp() * (teacher - lp) / mask.sum(), 0.0)
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["opd", "iw_opd"])
def test_at_ratio_one_the_gradient_is_the_policy_gradient_of_the_teachers_advantage(name):
    """∂L/∂log π = -A·w_agg with A = Â + λ·w·(log π_T - log π_old), both surrogates."""
    data = make_batch(batch=6, length=5, seed=7)
    data["log_prob"] = data["old_log_prob"].clone()
    alg = pgloss.get(name)
    x = data["log_prob"].clone().requires_grad_()
    call(alg, data, x).loss.backward()
    _, old, adv, mask = loops.lists(data)
    advantage = torch.tensor(
        loops.opd_advantages(old, data["teacher_log_prob"].tolist(), adv, mask, gamma=alg.opd_position_gamma),
        dtype=torch.float64,
    )
    expected = torch.where(data["mask"], -advantage / data["mask"].sum(), 0.0)
    torch.testing.assert_close(x.grad, expected, rtol=1e-10, atol=1e-13)


def test_pure_distillation_moves_toward_the_teacher():
    """With Â = 0 the step lowers the sampled reverse KL: the tokens the teacher likes more gain mass."""
    data = make_batch(batch=6, length=5, seed=8)
    data["advantages"] = torch.zeros(6, dtype=torch.float64)
    x = data["old_log_prob"].clone().requires_grad_()
    call(pgloss.get("opd"), data, x).loss.backward()
    likes_more = (data["teacher_log_prob"] > data["old_log_prob"]) & data["mask"]
    assert (x.grad[likes_more] < 0).all() and (x.grad[data["mask"] & ~likes_more] >= 0).all()


def test_a_missing_teacher_is_named():
    data = make_batch(batch=3, length=4)
    with pytest.raises(ValueError, match="opd needs teacher_log_prob in the call"):
        pgloss.get("opd")(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    with pytest.raises(ValueError, match="opd_surrogate must be one of"):
        pgloss.get("opd", opd_surrogate="clip")
    with pytest.raises(ValueError, match="opd_advantage_policy must be one of"):
        pgloss.get("opd", opd_advantage_policy="teacher")
    with pytest.raises(ValueError, match=r"opd_discount must lie in \[0, 1\], got 1.5"):
        pgloss.get("opd", opd_discount=1.5)
    with pytest.raises(ValueError, match="opd_trust_region must be > 0 or None, got 0"):
        pgloss.get("opd", opd_trust_region=0.0)


def trl_iw_opd(logits, tokens, labels, teacher, rollout, gamma):
    iw_opd = pytest.importorskip("trl.experimental.iw_opd.iw_opd_trainer")
    trainer = types.SimpleNamespace(
        temperature=1.0,
        iw_opd_gamma=gamma,
        iw_opd_epsilon=1e-8,
        model=types.SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)),
    )
    return iw_opd.IWOPDTrainer._compute_iw_opd_loss(trainer, logits, tokens, labels, teacher, rollout)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
def test_parity_with_trl_iw_opd(gamma, dtype):
    g = torch.Generator().manual_seed(11)
    rows, width, vocab = 6, 7, 13
    logits = torch.randn(rows, width, vocab, generator=g, dtype=torch.float64).to(dtype)
    tokens = torch.randint(0, vocab, (rows, width), generator=g)
    lengths = torch.tensor([7, 5, 1, 0, 6, 3])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    labels = torch.where(mask, tokens, -100)
    sampled = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None])[..., 0]
    rollout = (sampled + 0.2 * torch.randn(rows, width, generator=g, dtype=torch.float64)).clamp(max=-1e-3).to(dtype)
    teacher = (sampled + torch.randn(rows, width, generator=g, dtype=torch.float64)).clamp(max=-1e-3).to(dtype)

    theirs_logits = logits.clone().requires_grad_()
    theirs = trl_iw_opd(theirs_logits, tokens, labels, teacher, rollout, gamma)
    theirs.backward()
    ours_logits = logits.clone().requires_grad_()
    log_prob = torch.log_softmax(ours_logits, -1).gather(-1, tokens[..., None])[..., 0]
    alg = pgloss.get("iw_opd", opd_position_gamma=gamma)
    ours = alg(
        torch.where(mask, log_prob, 0.0),
        rollout,
        torch.zeros(rows, dtype=dtype),
        mask,
        teacher_log_prob=torch.where(mask, teacher, 0.0),
    ).loss
    ours.backward()
    tol = dict(rtol=1e-12, atol=1e-15) if dtype == torch.float64 else dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours, theirs, **tol)
    torch.testing.assert_close(ours_logits.grad, theirs_logits.grad, **tol)
