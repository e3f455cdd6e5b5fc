"""GMPO's per-sequence loss (losses/gmpo.py) against the plain loop, and its gradient."""

import math

import loops
import pytest
import torch
from conftest import make_batch

from pgloss.losses.gmpo import gmpo_loss


def tensors(data):
    adv = data["advantages"]
    adv = adv[:, None].expand_as(data["log_prob"]) if adv.ndim == 1 else adv
    mask = data["mask"]
    return torch.where(mask, data["log_prob"] - data["old_log_prob"], 0.0), adv, mask


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("clip", [(0.4, 0.4), (0.1, 0.3)])
def test_matches_loop(per_token_adv, clip):
    data = make_batch(seed=3, spread=0.5, per_token_adv=per_token_adv)
    delta, adv, mask = tensors(data)
    loss, ratio, clipped = gmpo_loss(delta, adv, mask, clip_low=clip[0], clip_high=clip[1], max_log_ratio=20.0)
    expected = loops.gmpo(*loops.lists(data), clip_low=clip[0], clip_high=clip[1])
    torch.testing.assert_close(
        torch.where(mask, loss, 0.0), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14
    )
    assert ratio.shape == (5, 1)
    assert clipped.any() and not clipped[~mask].any()  # spread 0.5 crosses the band somewhere


def test_gradient_is_gradcheck_exact_and_zero_on_clipped_tokens():
    data = make_batch(seed=4, spread=0.5)
    delta, adv, mask = tensors(data)

    def fn(d):
        return torch.where(mask, gmpo_loss(d, adv, mask, clip_low=0.2, clip_high=0.2, max_log_ratio=20.0)[0], 0.0).sum()

    assert torch.autograd.gradcheck(fn, (delta.clone().requires_grad_(),))
    d = delta.clone().requires_grad_()
    loss, ratio, clipped = gmpo_loss(d, adv, mask, clip_low=0.2, clip_high=0.2, max_log_ratio=20.0)
    loss[:, 0].sum().backward()  # L_i once per row
    assert (d.grad[clipped] == 0).all()
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)
    a_hat = (adv * mask).sum(-1, keepdim=True) / lengths
    free = mask & ~clipped
    torch.testing.assert_close(d.grad[free], (-a_hat * ratio / lengths).expand_as(d)[free], rtol=1e-12, atol=1e-14)


def test_one_sided_clip_in_log_space():
    # A > 0: a rise above ε_high is cut, a fall is kept; A < 0: the mirror image.
    delta = torch.tensor([[1.0, -1.0], [1.0, -1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, ratio, clipped = gmpo_loss(delta, adv, mask, clip_low=0.4, clip_high=0.4, max_log_ratio=20.0)
    torch.testing.assert_close(
        ratio.squeeze(-1), torch.tensor([math.exp((0.4 - 1.0) / 2), math.exp((1.0 - 0.4) / 2)], dtype=torch.float64)
    )
    assert clipped.tolist() == [[True, False], [False, True]]


def test_huge_log_ratio_is_finite_with_zero_gradient():
    delta = torch.tensor([[1e4, 1e4]], dtype=torch.float64, requires_grad=True)
    adv = torch.full((1, 2), -1.0, dtype=torch.float64)
    loss, ratio, _ = gmpo_loss(
        delta, adv, torch.ones(1, 2, dtype=torch.bool), clip_low=0.4, clip_high=0.4, max_log_ratio=20.0
    )
    loss[:, 0].sum().backward()
    assert ratio.item() == pytest.approx(math.exp(20.0))
    assert (delta.grad == 0).all()
