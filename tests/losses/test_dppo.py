"""DPPO-Binary-TV and -KL (losses/dppo.py) against the plain loop, masks and gradients."""

import math

import loops
import pytest
import torch
from conftest import make_batch

from pgloss.losses.dppo import dppo_loss, dppo_valid


def inputs(seed):
    data = make_batch(batch=6, length=8, seed=seed, spread=0.8, per_token_adv=True)
    data["log_prob"] = data["log_prob"].clamp(max=-1e-3)  # probabilities below one, as the Bernoulli KL needs
    mask = data["mask"]
    return (
        data,
        torch.where(mask, data["log_prob"], 0.0),
        torch.where(mask, data["old_log_prob"], -1.0),
        data["advantages"],
        mask,
    )


@pytest.mark.parametrize("divergence", ["tv", "kl"])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop_and_gradient(divergence, seed):
    data, lp, old, adv, mask = inputs(seed)
    kw = dict(clip_low=0.05, clip_high=0.1)
    x = lp.clone().requires_grad_()
    ratio = torch.exp((x - old).clamp(-20, 20))
    valid = dppo_valid(x, old, adv, divergence=divergence, **kw)
    loss = torch.where(mask, dppo_loss(x, ratio, adv, valid, truncation=1.5), 0.0)
    expected = loops.dppo(*loops.lists(data), divergence=divergence, **kw, truncation=1.5)
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    loss.sum().backward()
    weight = torch.exp(lp - old).clamp(max=1.5) * valid
    torch.testing.assert_close(x.grad, torch.where(mask, -adv * weight, 0.0), rtol=1e-12, atol=1e-14)
    assert (~valid & mask).any() and (valid & mask).any()  # both sides of the trust region are exercised
    assert (torch.exp(lp - old)[mask] > 1.5).any()  # and the truncation


def test_tv_mask_is_one_sided():
    # p_old = 0.5. A > 0: a rise of 0.3 > ε_high leaves, a fall of 0.3 stays; A < 0 mirrors it.
    old = torch.full((1, 4), math.log(0.5), dtype=torch.float64)
    lp = torch.log(torch.tensor([[0.8, 0.2, 0.8, 0.2]], dtype=torch.float64))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    valid = dppo_valid(lp, old, adv, divergence="tv", clip_low=0.2, clip_high=0.2)
    assert valid.tolist() == [[False, True, True, False]]


def test_kl_mask_is_the_bernoulli_kl():
    # p_old = 0.5 → p = 0.8: D = 0.5 log(0.5/0.8) + 0.5 log(0.5/0.2) ≈ 0.2231 (with the 1e-8 terms).
    old = torch.full((1, 1), math.log(0.5), dtype=torch.float64)
    lp = torch.full((1, 1), math.log(0.8), dtype=torch.float64)
    d = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)
    adv = torch.ones(1, 1, dtype=torch.float64)
    assert dppo_valid(lp, old, adv, divergence="kl", clip_low=0.2, clip_high=d + 1e-6).item()
    assert not dppo_valid(lp, old, adv, divergence="kl", clip_low=0.2, clip_high=d - 1e-6).item()


def test_unknown_divergence_is_refused():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="divergence must be one of"):
        dppo_valid(x, x, x, divergence="js", clip_low=0.2, clip_high=0.2)
