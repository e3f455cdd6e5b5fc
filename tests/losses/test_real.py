"""REAL's group-contrastive loss (losses/real.py) against the plain loop, with gradcheck."""

import math

import loops
import pytest
import torch
from conftest import make_batch
from properties.micro_batches import cut, parts_of, split_call

import pgloss
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
    assert torch.autograd.gradcheck(
        lambda x: batch_loss(x, old, adv, mask, group_ids, 0.5), (lp.clone().requires_grad_(),)
    )
    x = (old + 1e4).requires_grad_()
    loss = batch_loss(x, old, adv, mask, group_ids, 0.5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()


def real_data(seed):
    data = make_batch(batch=9, length=6, seed=seed, spread=0.5, per_token_adv=True)
    data["group_ids"] = torch.arange(9) // 3  # three groups of three rows (row 3 is empty)
    signs = torch.tensor([1.0, -1.0, 1.0, 0.0, 1.0, -1.0, 1.0, -1.0, 1.0], dtype=torch.float64)
    data["advantages"] = data["advantages"] + 2 * signs[:, None]  # both signs in every group: each contrasts
    return data


def split_run(alg, data, parts):
    """Summed loss and gradient over micro-batches `parts`, with the step's Normalizer (group counts)."""
    normalizer = pgloss.Normalizer.count(cut(data["mask"], parts), group_ids=cut(data["group_ids"], parts))
    return split_call(
        alg,
        data["log_prob"],
        parts,
        normalizer,
        old_log_prob=data["old_log_prob"],
        advantages=data["advantages"],
        mask=data["mask"],
        group_ids=data["group_ids"],
        ref_log_prob=data["ref_log_prob"],
    )


@pytest.mark.parametrize("cuts", [[3], [6], [3, 6], []])
@pytest.mark.parametrize("seed", [0, 1])
def test_micro_batches_of_whole_groups_equal_the_whole_batch(cuts, seed):
    """REAL is a mean over the step's groups: with whole groups per call and the step's group count
    (Normalizer), any split gives the whole batch's loss and gradient (KL term on)."""
    data = real_data(seed)
    alg = pgloss.get("real", kl_coef=0.1)
    whole_loss, whole_grad = split_run(alg, data, [slice(0, 9)])
    loss, grad = split_run(alg, data, parts_of(b - a for a, b in zip([0] + cuts, cuts + [9], strict=True)))
    torch.testing.assert_close(loss, whole_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-14)


def test_a_group_split_across_calls_is_not_invariant():
    data = real_data(0)
    alg = pgloss.get("real")
    _, whole_grad = split_run(alg, data, [slice(0, 9)])
    _, grad = split_run(alg, data, [slice(0, 7), slice(7, 9)])  # group 1 is cut: each call contrasts a part
    assert (grad - whole_grad).abs().max() > 1e-3


RANK_PARTS = {0: [slice(0, 3)], 1: [slice(3, 6), slice(6, 9)]}


def on_rank(rank):  # inside a gloo process of properties/test_two_ranks_step_statistics.py: whole groups on each rank
    data = real_data(2)
    parts = RANK_PARTS[rank]
    _, grad = split_run(pgloss.get("real", kl_coef=0.1), data, parts)  # Normalizer all-reduced: world size 2
    rows = torch.cat([torch.arange(9)[p] for p in parts])
    return rows, grad[rows] / 2  # DDP averages the two ranks' gradients


def check_ranks(results):
    data = real_data(2)
    _, whole = split_run(pgloss.get("real", kl_coef=0.1), data, [slice(0, 9)])
    grad = torch.zeros_like(whole)
    for rank in (0, 1):
        rows, part = results[rank]
        grad[rows] = part
    torch.testing.assert_close(grad, whole, rtol=1e-12, atol=1e-14)
