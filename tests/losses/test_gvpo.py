"""GVPO's group loss (losses/gvpo.py) against the plain loop, with gradcheck and whole-group splits."""

import loops
import pytest
import torch
from conftest import make_batch
from properties.micro_batches import cut, parts_of, split_call

import pgloss


def gvpo_data(seed, per_token_adv=True):
    data = make_batch(batch=9, length=6, seed=seed, spread=0.5, per_token_adv=per_token_adv)
    data["group_ids"] = torch.arange(9) // 3  # three groups of three rows (row 3 is empty)
    return data


def call(alg, data, lp=None, part=slice(None), normalizer=None):
    lp = data["log_prob"] if lp is None else lp
    return alg(
        lp[part],
        data["old_log_prob"][part],
        data["advantages"][part],
        data["mask"][part],
        group_ids=data["group_ids"][part],
        normalizer=normalizer,
    )


@pytest.mark.parametrize("beta", [0.1, 1.0])
@pytest.mark.parametrize("center", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_loop(beta, center, seed):
    data = gvpo_data(seed)
    expected = loops.gvpo(*loops.lists(data), data["group_ids"].tolist(), beta=beta, center=center)
    out = call(pgloss.get("gvpo", gvpo_beta=beta, gvpo_center_advantages=center), data)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    assert expected > 0


def test_gradcheck_and_the_gradient_weights_sum_to_zero_in_each_group():
    data = gvpo_data(3)
    alg = pgloss.get("gvpo", gvpo_beta=0.5)
    x = data["log_prob"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: call(alg, data, y).loss, (x,))
    call(alg, data, x).loss.backward()
    mask = data["mask"]
    row_grad = x.grad[:, 0]  # β·c_i/((k - 1)·groups): the same on every valid token of row i
    for g in range(3):
        rows = (data["group_ids"] == g) & mask.any(-1)
        assert abs(row_grad[rows].sum().item()) < 1e-12 and row_grad[rows].abs().max() > 1e-4


def test_detaching_the_group_mean_changes_nothing_with_centred_advantages():
    from pgloss.losses.gvpo import gvpo_group_loss

    r = torch.tensor([0.3, -0.1, 0.5, 0.2], dtype=torch.float64, requires_grad=True)
    a = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    ids, valid = torch.tensor([0, 0, 1, 1]), torch.ones(4, dtype=torch.bool)
    gvpo_group_loss(r, a, valid, ids).sum().backward()
    grad = r.grad.clone()
    r.grad = None
    mean = torch.stack([r[:2].mean(), r[:2].mean(), r[2:].mean(), r[2:].mean()])  # not detached
    c = (r - mean) - (a - torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64))
    (2 * 0.5 * c.square()).sum().backward()  # each row holds its group's L_g, k - 1 = 1
    torch.testing.assert_close(grad, r.grad, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("cuts", [[3], [6], [3, 6]])
def test_micro_batches_of_whole_groups_equal_the_whole_batch(cuts):
    data = gvpo_data(4)
    alg = pgloss.get("gvpo", kl_coef=0.1)
    data["ref_log_prob"] = data["ref_log_prob"]

    def run(parts):
        norm = pgloss.Normalizer.count(cut(data["mask"], parts), group_ids=cut(data["group_ids"], parts))
        return split_call(
            alg,
            data["log_prob"],
            parts,
            norm,
            old_log_prob=data["old_log_prob"],
            advantages=data["advantages"],
            mask=data["mask"],
            group_ids=data["group_ids"],
            ref_log_prob=data["ref_log_prob"],
        )

    whole_loss, whole_grad = run([slice(0, 9)])
    loss, grad = run(parts_of(b - a for a, b in zip([0] + cuts, cuts + [9], strict=True)))
    assert loss.item() == pytest.approx(whole_loss.item(), rel=1e-12)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-14)


def test_needs_group_ids():
    data = gvpo_data(0)
    with pytest.raises(ValueError, match="group_ids"):
        pgloss.get("gvpo")(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
