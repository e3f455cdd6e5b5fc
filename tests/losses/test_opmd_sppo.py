"""OPMD and sPPO (losses/opmd.py, losses/sppo.py) against the float64 loops of tests/loops/losses.py,
with gradcheck."""

import math

import loops
import pytest
import torch
from conftest import make_batch

import pgloss


def call(alg, data, lp=None):
    lp = data["log_prob"] if lp is None else lp
    return alg(lp, data["old_log_prob"], data["advantages"], data["mask"])


@pytest.mark.parametrize("tau", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_opmd_matches_loop(tau, mode):
    data = make_batch(batch=7, length=6, seed=4, spread=0.5, per_token_adv=True)
    lp, _, adv, mask = loops.lists(data)
    expected = loops.aggregate(loops.opmd(lp, adv, tau=tau), mask, mode)
    out = call(pgloss.get("opmd", opmd_tau=tau, loss_agg_mode=mode), data)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_opmd_gradcheck_and_is_reinforce_scaled():
    data = make_batch(batch=6, length=5, seed=5, per_token_adv=True)
    x = data["log_prob"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: call(pgloss.get("opmd"), data, y).loss, (x,))
    call(pgloss.get("opmd", opmd_tau=1.0), data, x).loss.backward()
    y = data["log_prob"].clone().requires_grad_()
    call(pgloss.get("gpg", loss_agg_mode="token-mean"), data, y).loss.backward()
    torch.testing.assert_close(x.grad, y.grad / 2, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("epsilon", [0.1, 0.3])
@pytest.mark.parametrize("seed", [0, 1])
def test_sppo_matches_loop(epsilon, seed):
    data = make_batch(batch=7, length=6, seed=seed, spread=0.4, per_token_adv=True)
    lp, old, adv, mask = loops.lists(data)
    expected = loops.aggregate(loops.sppo(lp, old, adv, epsilon=epsilon), mask, "token-mean")
    out = call(pgloss.get("sppo", sppo_epsilon=epsilon), data)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    r = torch.exp(data["log_prob"] - data["old_log_prob"])[data["mask"]]
    outside = ((r > 1 + epsilon) | (r < 1 / (1 + epsilon))).double().mean()
    assert out.metrics["pg_clipfrac"].item() == pytest.approx(outside.item())
    assert 0 < outside < 1  # both kinds of token occur


def test_sppo_gradcheck_and_gradient_is_reinforce_inside_the_band():
    data = make_batch(batch=6, length=5, seed=6, spread=0.4, per_token_adv=True)
    alg = pgloss.get("sppo")
    x = data["log_prob"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: call(alg, data, y).loss, (x,))
    call(alg, data, x).loss.backward()
    mask, d = data["mask"], data["log_prob"] - data["old_log_prob"]
    inside = d.abs() <= math.log(1.3)
    expected = torch.where(mask & inside, -data["advantages"], 0.0) / mask.sum()
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name, scale", [("rec_oneside", 1.0), ("rec_ring", 1.0), ("sppo", 1.0), ("opmd", 0.5)])
def test_reinforce_identity_at_ratio_one(name, scale):
    """At π_θ = π_old every token is kept: the gradient is -Â·∇log π_θ / N (OPMD's scaled by 1/(1+τ))."""
    data = make_batch(batch=6, length=5, seed=7, per_token_adv=True)
    x = data["old_log_prob"].clone().requires_grad_()
    pgloss.get(name)(x, data["old_log_prob"], data["advantages"], data["mask"]).loss.backward()
    mask = data["mask"]
    torch.testing.assert_close(
        x.grad, torch.where(mask, -scale * data["advantages"], 0.0) / mask.sum(), rtol=1e-12, atol=1e-15
    )


def test_gvpo_gradient_at_ratio_one_is_the_centred_advantage():
    """R_θ = 0 at π_θ = π_old: c_i = -(Â_i - mean Â), so ∂L/∂log π_{i,t} = -β·(Â_i - Ā_g)/((k - 1)·groups)."""
    data = make_batch(batch=6, length=5, seed=8)
    ids = torch.arange(6) // 3
    x = data["old_log_prob"].clone().requires_grad_()
    pgloss.get("gvpo", gvpo_beta=0.5)(
        x, data["old_log_prob"], data["advantages"], data["mask"], group_ids=ids
    ).loss.backward()
    mask, adv = data["mask"], data["advantages"].clone()
    valid = mask.any(-1)
    expected = torch.zeros(6, dtype=torch.float64)
    for g in range(2):
        rows = (ids == g) & valid
        k = int(rows.sum())
        expected[rows] = -0.5 * (adv[rows] - adv[rows].mean()) / ((k - 1) * 2)
    torch.testing.assert_close(x.grad, torch.where(mask, expected[:, None], 0.0), rtol=1e-12, atol=1e-15)
