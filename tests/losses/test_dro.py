"""DRO / Kimi-1.5 (losses/dro.py) against the plain loop, gradcheck and the identity at r = 1."""

import loops
import torch
from conftest import make_batch

from pgloss.losses.dro import dro_loss


def test_matches_loop_and_gradcheck():
    data = make_batch(seed=5, spread=0.5, per_token_adv=True)
    mask = data["mask"]
    lp, old = torch.where(mask, data["log_prob"], 0.0), torch.where(mask, data["old_log_prob"], 0.0)
    adv = data["advantages"]
    loss = torch.where(mask, dro_loss(lp, lp - old, adv, beta=0.3), 0.0)
    torch.testing.assert_close(
        loss, torch.tensor(loops.dro(*loops.lists(data), beta=0.3), dtype=torch.float64), rtol=1e-12, atol=1e-14
    )

    def fn(x):
        return torch.where(mask, dro_loss(x, x - old, adv, beta=0.3), 0.0).sum()

    assert torch.autograd.gradcheck(fn, (lp.clone().requires_grad_(),))
    x = lp.clone().requires_grad_()
    fn(x).backward()  # ∂/∂log π = -A + β·δ
    torch.testing.assert_close(x.grad, torch.where(mask, -adv + 0.3 * (lp - old), 0.0), rtol=1e-12, atol=1e-14)


def test_penalty_has_no_gradient_at_ratio_one():
    data = make_batch(seed=6, per_token_adv=True)
    x = data["log_prob"].clone().requires_grad_()
    dro_loss(x, x - data["log_prob"], data["advantages"], beta=10.0).sum().backward()
    torch.testing.assert_close(x.grad, -data["advantages"], rtol=0, atol=1e-15)
