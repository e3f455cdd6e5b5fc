"""CE-GPPO (losses/ce_gppo.py): clipped value, preserved gradient, against the plain loop."""

import loops
import torch
from conftest import make_batch

from pgloss.losses.ce_gppo import ce_gppo_loss
from pgloss.losses.ppo import clipped_surrogate

KW = dict(clip_low=0.2, clip_high=0.28, beta_low=0.75, beta_high=1.0, dual_clip=3.0)


def test_matches_loop_value_and_gradient():
    data = make_batch(batch=6, length=8, seed=8, spread=0.9, per_token_adv=True)
    mask = data["mask"]
    lp, old = torch.where(mask, data["log_prob"], 0.0), torch.where(mask, data["old_log_prob"], 0.0)
    adv = data["advantages"]
    x = lp.clone().requires_grad_()
    out = ce_gppo_loss(x - old, adv, **KW)
    loss = torch.where(mask, out.loss, 0.0)
    values, grads = loops.ce_gppo(*loops.lists(data), **KW)
    torch.testing.assert_close(loss, torch.tensor(values, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    loss.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor(grads, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    for branch in (out.clipped_low, out.clipped_high, out.clipped_dual):
        assert (branch & mask).any()  # every branch is exercised


def test_with_unit_betas_the_value_is_ppo_and_the_gradient_is_not_zero():
    data = make_batch(batch=6, length=8, seed=9, spread=0.9, per_token_adv=True)
    log_r = (data["log_prob"] - data["old_log_prob"]).requires_grad_()
    adv = data["advantages"]
    gppo = ce_gppo_loss(log_r, adv, clip_low=0.2, clip_high=0.2, beta_low=1.0, beta_high=1.0, dual_clip=None)
    ppo = clipped_surrogate(torch.exp(log_r), adv, clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(gppo.loss, ppo.loss, rtol=0, atol=1e-15)
    (grad,) = torch.autograd.grad(gppo.loss.sum(), log_r)
    clipped = gppo.clipped_low | gppo.clipped_high
    assert clipped.any() and (grad[clipped] != 0).all()  # where PPO's gradient is exactly zero
