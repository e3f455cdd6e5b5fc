"""VESPO (losses/vespo.py) against the plain loop: the gamma weight, its detachment, φ(1) = 1."""

import math

import pytest
import torch

import loops_vocabulary as loops
from conftest import make_batch
from pgloss.losses.vespo import vespo_loss, vespo_phi

SHAPE = dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("spread", [0.1, 0.6])
def test_matches_loop_and_gradient_is_phi_weighted_reinforce(per_token_adv, spread):
    data = make_batch(seed=7, spread=spread, per_token_adv=per_token_adv)
    mask = data["mask"]
    adv = data["advantages"]
    adv = adv[:, None].expand_as(mask) if adv.ndim == 1 else adv
    lp, old = torch.where(mask, data["log_prob"], 0.0), torch.where(mask, data["old_log_prob"], 0.0)
    x = lp.clone().requires_grad_()
    phi = vespo_phi(x - old, adv, mask, **SHAPE)
    loss = torch.where(mask, vespo_loss(x, phi, adv), 0.0)
    torch.testing.assert_close(loss, torch.tensor(loops.vespo(*loops.lists(data), **SHAPE), dtype=torch.float64),
                               rtol=1e-12, atol=1e-14)
    loss.sum().backward()
    assert not phi.requires_grad
    torch.testing.assert_close(x.grad, torch.where(mask, -phi * adv, 0.0), rtol=1e-12, atol=1e-14)


def test_phi_is_one_at_ratio_one_and_peaks_at_k_over_lambda():
    mask = torch.ones(3, 1, dtype=torch.bool)
    adv = torch.ones(3, 1, dtype=torch.float64)
    log_w = torch.tensor([[0.0], [math.log(2 / 3)], [math.log(0.5)]], dtype=torch.float64)
    phi = vespo_phi(log_w, adv, mask, **SHAPE).squeeze(-1)
    assert phi[0].item() == pytest.approx(1.0, abs=1e-15)
    assert phi[1] > phi[0] and phi[1] > phi[2]  # w = k/λ = 2/3 is the mode for A ≥ 0


def test_rollout_log_ratio_enters_the_sequence_weight():
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = -torch.ones(1, 2, dtype=torch.float64)
    zero = torch.zeros(1, 2, dtype=torch.float64)
    shift = torch.tensor([[0.1, -0.3]], dtype=torch.float64)
    torch.testing.assert_close(vespo_phi(zero, adv, mask, **SHAPE, rollout_log_ratio=shift),
                               vespo_phi(shift, adv, mask, **SHAPE))


def test_extreme_ratios_give_finite_zero_weight():
    mask = torch.ones(2, 3, dtype=torch.bool)
    delta = torch.tensor([[1e4] * 3, [-1e4] * 3], dtype=torch.float64)
    phi = vespo_phi(delta, torch.ones(2, 3, dtype=torch.float64), mask, **SHAPE)
    assert torch.isfinite(phi).all() and (phi < 1e-6).all()
