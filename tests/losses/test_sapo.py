"""SAPO's per-token function (losses/sapo.py) against the plain loop, and the class computing with it."""

import loops
import pytest
import torch
from conftest import make_batch

import pgloss
from pgloss.losses.sapo import sapo_loss, sapo_slope


@pytest.mark.parametrize("taus", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo_loss_matches_loop_and_its_slope(taus):
    tau_pos, tau_neg = taus
    data = make_batch(seed=4, spread=0.6, per_token_adv=True)
    lp, old, adv = data["log_prob"], data["old_log_prob"], data["advantages"]
    x = lp.clone().requires_grad_()
    loss, gate = sapo_loss(torch.exp(x - old), adv, tau_pos=tau_pos, tau_neg=tau_neg)
    expected = loops.sapo_per_token(lp.tolist(), old.tolist(), adv.tolist(), tau_pos=tau_pos, tau_neg=tau_neg)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(loss, -gate * adv, rtol=0, atol=0)
    loss.sum().backward()  # d ℓ / d log π = -A · f'(r) · r
    ratio = torch.exp(lp - old)
    torch.testing.assert_close(
        x.grad, -adv * sapo_slope(ratio, adv, tau_pos=tau_pos, tau_neg=tau_neg) * ratio, rtol=1e-12, atol=1e-14
    )


@pytest.mark.parametrize("name, fn", [("sapo", None), ("tis_pg", "tis_pg_loss"), ("topr", "topr_loss")])
def test_the_class_computes_with_the_tested_function(name, fn):
    """The family's per-token term is its per-token function's output, not a second copy of it."""
    from pgloss.losses import reinforce

    data = make_batch(seed=5, spread=0.6, per_token_adv=True)
    alg = pgloss.get(name)
    out = alg(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"], scores=data["scores"])
    ratio = torch.exp(data["log_prob"] - data["old_log_prob"])
    if fn is None:
        expected, _ = sapo_loss(ratio, data["advantages"], tau_pos=alg.tau_pos, tau_neg=alg.tau_neg)
    elif fn == "tis_pg_loss":
        expected = reinforce.tis_pg_loss(
            data["log_prob"], ratio, data["advantages"], low=alg.tis_lower_bound, high=alg.tis_upper_bound
        )
    else:
        expected = reinforce.topr_loss(
            data["log_prob"],
            ratio,
            data["advantages"],
            (data["scores"] > 0)[:, None],
            low=alg.tis_lower_bound,
            high=alg.tis_upper_bound,
        )
    mask = data["mask"]
    torch.testing.assert_close(out.per_token, torch.where(mask, expected, 0.0), rtol=1e-12, atol=1e-14)
