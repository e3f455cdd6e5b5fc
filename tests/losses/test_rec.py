"""REC (losses/rec.py: rec_oneside, rec_ring and the other keep rules and weights) against the float64
loop of tests/loops/losses.py, with gradcheck."""

import loops
import pytest
import torch
from conftest import make_batch

import pgloss


def call(alg, data, lp=None):
    lp = data["log_prob"] if lp is None else lp
    return alg(lp, data["old_log_prob"], data["advantages"], data["mask"])


@pytest.mark.parametrize("mode", ["one-side", "two-side", "ring", "none"])
@pytest.mark.parametrize("weight", ["none", "importance_sampling", "sequence_importance_sampling", "advantage"])
def test_matches_loop(mode, weight):
    data = make_batch(batch=7, length=6, seed=1, spread=0.8, per_token_adv=True)
    alg = pgloss.get("rec_oneside", rec_clip_mode=mode, rec_weight=weight, rec_temp=0.7)
    values = loops.rec(*loops.lists(data), mode=mode, weight=weight, temp=0.7)
    expected = loops.aggregate(values, data["mask"].tolist(), "token-mean")
    assert call(alg, data).loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_the_named_variants_keep_different_tokens():
    data = make_batch(batch=7, length=6, seed=2, spread=1.2, per_token_adv=True)
    lists = loops.lists(data)
    for name, mode in (("rec_oneside", "one-side"), ("rec_ring", "ring")):
        expected = loops.aggregate(loops.rec(*lists, mode=mode, weight="none"), data["mask"].tolist(), "token-mean")
        assert call(pgloss.get(name), data).loss.item() == pytest.approx(expected, rel=1e-12)
    one, ring = (call(pgloss.get(n), data).loss.item() for n in ("rec_oneside", "rec_ring"))
    assert abs(one - ring) > 1e-3  # with ratios spread this wide the rules drop different tokens


@pytest.mark.parametrize("name", ["rec_oneside", "rec_ring"])
def test_gradcheck_and_gradient_is_the_kept_weight(name):
    data = make_batch(batch=6, length=5, seed=3, spread=0.8, per_token_adv=True)
    x = data["log_prob"].clone().requires_grad_()  # gradcheck on the named default, w = 1 (a detached
    assert torch.autograd.gradcheck(lambda y: call(pgloss.get(name), data, y).loss, (x,))  # w is no function of x)
    alg = pgloss.get(name, rec_weight="importance_sampling")
    call(alg, data, x).loss.backward()
    mask, adv, r = data["mask"], data["advantages"], torch.exp(data["log_prob"] - data["old_log_prob"])
    keep = torch.tensor(loops.rec(*loops.lists(data), mode=alg.rec_clip_mode, weight="none")) != 0
    expected = torch.where(mask & keep, -r * adv, 0.0) / mask.sum()
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-14)


def test_bad_values_are_refused_by_name():
    for field, value in (
        ("rec_clip_mode", "gspo-one-side"),
        ("rec_weight", "gspo"),
        ("clip_low", 1.5),
        ("ring_high", 0.0),
        ("rec_temp", 0.0),
    ):
        with pytest.raises(ValueError, match=field):
            pgloss.get("rec_ring", **{field: value})


def test_the_sequence_weight_without_its_ratio_is_refused_by_name():
    """`rec_weight` with the sequence weight reads `sequence_ratio`: None is refused by name (was an AttributeError)."""
    from pgloss.losses.rec import rec_weight

    ratio = torch.full((2, 3), 1.5, dtype=torch.float64)
    with pytest.raises(ValueError, match="pass sequence_ratio"):
        rec_weight(ratio, None, torch.zeros(2, 3), weight="sequence_importance_sampling", temp=1.0)
    sequence = torch.tensor([[2.0], [0.5]], dtype=torch.float64)
    weight = rec_weight(ratio, sequence, torch.zeros(2, 3), weight="sequence_importance_sampling", temp=1.0)
    assert torch.equal(weight, torch.tensor([[2.0] * 3, [0.5] * 3], dtype=torch.float64))
