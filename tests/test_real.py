"""REAL's group-contrastive loss (losses/real.py) against the plain loop, with gradcheck."""

import math

import pytest
import torch

import loops_vocabulary as loops
from conftest import make_batch
from pgloss.losses.real import real_group_loss


def sequence_terms(lp, old, adv, mask):
    m = mask.to(lp.dtype)
    n = m.sum(-1).clamp(min=1)
    return ((lp - old) * m).sum(-1) / n, (adv * m).sum(-1) / n, mask.any(-1)


def batch_loss(lp, old, adv, mask, group_ids, tau):
    """Σ_g L_g / (non-empty groups): L_g once per group, as group-mean-token-mean would give."""
    s, a, valid = sequence_terms(lp, old, adv, mask)
    per_row = real_group_loss(s, a, valid, group_ids, tau=tau)
    groups = group_ids[valid].unique()
    return sum(per_row[(group_ids == g) & valid][0] for g in groups) / max(len(groups), 1)


@pytest.mark.parametrize("tau", [0.5, 2.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_loop(tau, seed):
    data = make_batch(batch=9, length=6, seed=seed, spread=0.5, per_token_adv=seed == 2)
    mask = data["mask"]
    lp, old = torch.where(mask, data["log_prob"], 0.0), torch.where(mask, data["old_log_prob"], 0.0)
    adv = data["advantages"]
    adv = adv[:, None].expand_as(mask) if adv.ndim == 1 else adv
    group_ids = torch.arange(9) // 3
    loss = batch_loss(lp, old, adv, mask, group_ids, tau)
    expected = loops.real_loss(*loops.lists(data), group_ids.tolist(), tau=tau)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert expected > 0


def test_a_group_without_both_signs_contributes_zero_but_counts():
    s = torch.tensor([0.1, -0.2, 0.3, 0.4], dtype=torch.float64)
    a = torch.tensor([1.0, -1.0, 1.0, 2.0], dtype=torch.float64)  # group 1 has only positives
    out = real_group_loss(s, a, torch.ones(4, dtype=torch.bool), torch.tensor([0, 0, 1, 1]), tau=0.5)
    expected = math.log(1 + math.exp(-0.2 / 0.5)) + math.log(1 + math.exp(-0.1 / 0.5))
    assert out.tolist() == pytest.approx([expected, expected, 0.0, 0.0], rel=1e-14)


def test_gradcheck_and_huge_scores_stay_finite():
    data = make_batch(batch=6, length=5, seed=3, spread=0.5)
    mask = data["mask"]
    lp, old = torch.where(mask, data["log_prob"], 0.0), torch.where(mask, data["old_log_prob"], 0.0)
    adv = data["advantages"][:, None].expand_as(mask)
    group_ids = torch.arange(6) // 3
    assert torch.autograd.gradcheck(lambda x: batch_loss(x, old, adv, mask, group_ids, 0.5),
                                    (lp.clone().requires_grad_(),))
    x = (old + 1e4).requires_grad_()
    loss = batch_loss(x, old, adv, mask, group_ids, 0.5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
