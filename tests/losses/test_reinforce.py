"""GPG, TIS-PG and TOPR (losses/reinforce.py) against the plain loops, with their gradients."""

import loops
import pytest
import torch
from conftest import make_batch

from pgloss.losses.reinforce import reinforce_loss, tis_pg_loss, topr_loss


def inputs(seed=0, spread=0.6):
    data = make_batch(seed=seed, spread=spread, per_token_adv=True)
    mask = data["mask"]
    lp = torch.where(mask, data["log_prob"], 0.0)
    old = torch.where(mask, data["old_log_prob"], 0.0)
    scores = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3], dtype=torch.float64)
    return data, lp, old, data["advantages"], mask, scores


def masked(x, mask):
    return torch.where(mask, x, 0.0)


def test_gpg_matches_loop_and_gradcheck():
    data, lp, old, adv, mask, _ = inputs()
    torch.testing.assert_close(
        masked(reinforce_loss(lp, adv), mask),
        torch.tensor(loops.gpg(*loops.lists(data)), dtype=torch.float64),
        rtol=1e-12,
        atol=1e-14,
    )
    assert torch.autograd.gradcheck(
        lambda x: masked(reinforce_loss(x, adv), mask).sum(), (lp.clone().requires_grad_(),)
    )


@pytest.mark.parametrize("bounds", [(0.0, 1.0), (0.5, 2.0)])
def test_tis_pg_matches_loop_and_its_gradient_is_the_truncated_weight(bounds):
    data, lp, old, adv, mask, _ = inputs(1)
    low, high = bounds
    x = lp.clone().requires_grad_()
    loss = tis_pg_loss(x, torch.exp(x - old), adv, low=low, high=high)
    expected = loops.tis_pg(*loops.lists(data), low=low, high=high)
    torch.testing.assert_close(masked(loss, mask), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    masked(loss, mask).sum().backward()
    weight = torch.exp(lp - old).clamp(low, high)
    torch.testing.assert_close(x.grad, masked(-weight * adv, mask), rtol=1e-12, atol=1e-14)
    assert (weight[mask] < 1).any() and (weight[mask] == high).any()  # both regimes are exercised


def test_topr_splits_on_the_score_not_the_advantage():
    data, lp, old, adv, mask, scores = inputs(2)
    x = lp.clone().requires_grad_()
    positive = (scores > 0)[:, None]
    loss = topr_loss(x, torch.exp(x - old), adv, positive, low=0.0, high=1.0)
    expected = loops.topr(*loops.lists(data), scores.tolist(), low=0.0, high=1.0)
    torch.testing.assert_close(masked(loss, mask), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    masked(loss, mask).sum().backward()
    weight = torch.where(positive, 1.0, torch.exp(lp - old).clamp(0.0, 1.0))
    torch.testing.assert_close(x.grad, masked(-weight * adv, mask), rtol=1e-12, atol=1e-14)
    # Rows whose score is positive have a negative advantage somewhere: the split is not sign(A).
    assert ((adv < 0) & positive & mask).any()


def test_reinforce_identity_at_ratio_one():
    _, lp, _, adv, mask, scores = inputs(3)
    grads = []
    for fn in (
        lambda x: reinforce_loss(x, adv),
        lambda x: tis_pg_loss(x, torch.exp(x - lp), adv, low=0.0, high=1.0),
        lambda x: topr_loss(x, torch.exp(x - lp), adv, (scores > 0)[:, None], low=0.0, high=1.0),
    ):
        x = lp.clone().requires_grad_()
        masked(fn(x), mask).sum().backward()
        grads.append(x.grad)
    for g in grads:
        torch.testing.assert_close(g, masked(-adv, mask), rtol=0, atol=1e-15)
