"""OPMD and sPPO (losses/opmd.py, losses/sppo.py) against the float64 loops of tests/loops/trinity.py,
with gradcheck."""

import math

import pytest
import torch

import loops
import pgloss
from conftest import make_batch


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
