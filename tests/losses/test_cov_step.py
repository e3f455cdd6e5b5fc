"""Clip-Cov and KL-Cov select over the whole step (`step_selection`, losses/clip_cov.py and losses/kl_cov.py):
the selection of one call on the whole batch, and with it every split into micro-batches and ranks gives the whole
batch's loss and gradient. Without it each micro-batch selects among its own tokens, as verl."""

import dataclasses

import pytest
import torch
from conftest import make_batch
from properties.micro_batches import cut, micro_batches, parts_of

import pgloss

SPLITS = [[2, 4, 3], [1, 1, 7], [9]]
OVERRIDES = {"clip_cov": dict(clip_cov_ratio=0.1, clip_cov_lb=0.05), "kl_cov": dict(kl_cov_ratio=0.1)}


def data(seed=0):
    d = make_batch(batch=9, length=8, seed=seed, spread=0.3, per_token_adv=True)
    d["advantages"] = 2 * d["advantages"]  # covariances of order one: candidates inside (lb, ub)
    return d


def algorithm(name, seed=0):
    extra = dict(generator=torch.Generator().manual_seed(seed)) if name == "clip_cov" else {}
    return pgloss.get(name, **OVERRIDES[name], **extra)


def selection(alg, d, parts, **kwargs):
    lps, advs, masks = ([d[k][p] for p in parts] for k in ("log_prob", "advantages", "mask"))
    if isinstance(alg, pgloss.algorithms.ClipCov):
        return alg.step_selection(lps, [d["old_log_prob"][p] for p in parts], advs, masks, **kwargs)
    return alg.step_selection(lps, advs, masks, **kwargs)


def run(alg, d, parts, picks):
    """Summed loss and log_prob gradient over the micro-batches `parts`, each with its part of the
    step's selection (`picks`, or None: each micro-batch selects for itself)."""
    x = d["log_prob"].clone().requires_grad_()
    normalizer = pgloss.Normalizer.count(cut(d["mask"], parts))
    calls = [alg] * len(parts) if picks is None else [dataclasses.replace(alg, selection=s) for s in picks]

    def micro_batch(call_and_rows):
        call, p = call_and_rows
        return call(x[p], d["old_log_prob"][p], d["advantages"][p], d["mask"][p], normalizer=normalizer)

    return micro_batches(micro_batch, zip(calls, parts, strict=True)), x.grad


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_the_step_selection_of_one_batch_is_the_calls_own(name):
    d = data(1)
    picks = selection(algorithm(name, seed=3), d, [slice(0, 9)])
    out = algorithm(name, seed=3)(d["log_prob"], d["old_log_prob"], d["advantages"], d["mask"])
    fraction = picks[0].sum() / d["mask"].sum()
    key = "clip_cov_fraction" if name == "clip_cov" else "kl_cov_fraction"
    assert out.metrics[key].item() == pytest.approx(fraction.item()) and fraction > 0.05
    whole_loss, whole_grad = run(algorithm(name, seed=3), d, [slice(0, 9)], None)
    loss, grad = run(algorithm(name, seed=3), d, [slice(0, 9)], picks)
    assert loss.item() == whole_loss.item() and torch.equal(grad, whole_grad)


@pytest.mark.parametrize("sizes", SPLITS)
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_micro_batches_with_the_step_selection_equal_the_whole_batch(name, sizes):
    d = data(2)
    whole_loss, whole_grad = run(algorithm(name, seed=4), d, [slice(0, 9)], None)  # one call: verl's selection
    parts = parts_of(sizes)
    alg = algorithm(name, seed=4)
    loss, grad = run(alg, d, parts, selection(alg, d, parts))
    torch.testing.assert_close(loss, whole_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_without_it_each_micro_batch_selects_for_itself(name):
    d = data(2)
    whole_loss, whole_grad = run(algorithm(name, seed=4), d, [slice(0, 9)], None)
    _, grad = run(algorithm(name, seed=4), d, parts_of([2, 4, 3]), None)
    assert (grad - whole_grad).abs().max() > 1e-3  # verl's per-micro-batch selection: the test can fail


def test_bad_selection_is_named():
    d = data(0)
    alg = dataclasses.replace(algorithm("kl_cov"), selection=torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="selection must be a bool tensor of the call's shape"):
        alg(d["log_prob"], d["old_log_prob"], d["advantages"], d["mask"])
    with pytest.raises(ValueError, match="one tensor per micro-batch"):
        algorithm("kl_cov").step_selection([d["log_prob"]], [d["advantages"]] * 2, [d["mask"]])


RANK_PARTS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 9)]}


def on_rank(rank):  # inside a gloo process of properties/test_two_ranks_step_statistics.py: the step spans both ranks
    d = data(5)
    parts = RANK_PARTS[rank]
    out = {}
    for name in ("clip_cov", "kl_cov"):
        alg = algorithm(name, seed=6)  # every rank seeds the draw alike
        picks = selection(alg, d, parts)
        _, grad = run(alg, d, parts, picks)  # the Normalizer is all-reduced: world_size 2
        rows = torch.cat([torch.arange(9)[p] for p in parts])
        out[name] = (rows, grad[rows] / 2)  # DDP averages the two ranks' gradients
    return out


def check_ranks(results):
    d = data(5)
    for name in ("clip_cov", "kl_cov"):
        _, whole = run(algorithm(name, seed=6), d, [slice(0, 9)], None)
        grad = torch.zeros_like(whole)
        for rank in (0, 1):
            rows, part = results[rank][name]
            grad[rows] = part
        torch.testing.assert_close(grad, whole, rtol=1e-12, atol=1e-14, msg=name)
