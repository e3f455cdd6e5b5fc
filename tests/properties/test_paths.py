"""One answer on every path: the gradient of one optimizer step is the same through one plain call,
micro-batches counted by `algorithm.step_normalizer`, `from_hidden` (whole and in micro-batches) and
`pgloss.diagnostics.inspect`, for every name and each kind of rollout correction. (The TRL adapter, the verl
adapter and the lab's update are held to the same reference in their own test files.)"""

import dataclasses

import pytest
import torch
from properties.micro_batches import micro_batches
from steps import PARTS, VERL_CHAINED, build, call, cases, data, entropy, log_probs, splits, step

from pgloss.diagnostics.inspect import inspect


@pytest.mark.parametrize("name, kind", cases())
def test_log_prob_paths_agree(name, kind):
    algorithm = build(name, kind)
    hidden, weight, targets, inputs = data()
    log_prob = log_probs(hidden, weight, targets).detach().requires_grad_(True)
    (reference,) = torch.autograd.grad(call(algorithm, log_prob, inputs).loss, log_prob)
    assert reference.abs().sum() > 0, "a step with no gradient would make every comparison vacuous"

    torch.manual_seed(0)
    inspected = inspect(algorithm, log_prob.detach(), **inputs)
    torch.testing.assert_close(inspected.grad, reference, rtol=1e-10, atol=1e-13)

    if splits(algorithm):
        torch.testing.assert_close(
            split_gradient(algorithm, log_prob, inputs, step(algorithm, inputs)), reference, rtol=1e-10, atol=1e-13
        )


def split_gradient(algorithm, log_prob, inputs, normalizer):
    """The gradient of the step run as the micro-batches `PARTS`, counted by `normalizer`."""
    leaf = log_prob.detach().clone().requires_grad_(True)
    micro_batches(lambda p: call(algorithm, leaf[p], inputs, p, normalizer), PARTS)
    return leaf.grad


@pytest.mark.parametrize("name", sorted({p.values[0] for p in cases() if p.values[1] == "chained rejection"}))
def test_chained_rejection_counts_and_applies_verl_s_mask(name):
    """Rules of mixed levels in a chain (a token rule, then sequence rules): the step counts and the call
    applies the tokens verl's `compute_rollout_correction_and_rejection_mask` keeps, so the loss is the
    loss without a correction on verl's kept mask, whole and in micro-batches."""
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    algorithm = build(name, "chained rejection")
    hidden, weight, targets, inputs = data()
    _, kept, _ = helper.compute_rollout_correction_and_rejection_mask(
        inputs["old_log_prob"],
        inputs["rollout_log_prob"],
        inputs["mask"].double(),
        rollout_is=None,
        rollout_is_threshold=None,
        **VERL_CHAINED,
    )
    kept = kept.bool()
    assert (int(kept.sum()), int(inputs["mask"].sum())) == (26, 32)
    log_prob = log_probs(hidden, weight, targets).detach().requires_grad_(True)
    plain = dataclasses.replace(algorithm, rollout_correction=None)
    on_kept = {k: v for k, v in inputs.items() if k != "rollout_log_prob"} | {"mask": kept}
    (reference,) = torch.autograd.grad(call(plain, log_prob, on_kept).loss, log_prob)
    assert reference.abs().sum() > 0

    normalizer = step(algorithm, inputs)
    assert int(normalizer.tokens) == 26
    (whole,) = torch.autograd.grad(call(algorithm, log_prob, inputs).loss, log_prob)
    torch.testing.assert_close(whole, reference, rtol=1e-10, atol=1e-13)
    if splits(algorithm):
        torch.testing.assert_close(
            split_gradient(algorithm, log_prob, inputs, normalizer), reference, rtol=1e-10, atol=1e-13
        )


# Whole-vocabulary chunks (the default sizes), and vocabulary tiles of 4 columns (11 = 4 + 4 + 3) with
# whole rows per chunk (the one-pass route) or 5-token chunks (shorter than a row: the recompute route).
TILES = {
    "whole": {},
    "tiles_one_pass": dict(chunk_size=12, vocab_block=4),
    "tiles_recompute": dict(chunk_size=5, vocab_block=4),
}


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("name, kind", cases())
def test_hidden_state_paths_agree(name, kind, tiles):
    sizes = TILES[tiles]
    algorithm = build(name, kind)
    hidden, weight, targets, inputs = data(seed=1)
    hidden.requires_grad_(True), weight.requires_grad_(True)
    plain = call(
        algorithm,
        log_probs(hidden, weight, targets),
        inputs,
        entropy=entropy(hidden, weight) if "entropy" in algorithm.needs else None,
    ).loss
    reference = torch.autograd.grad(plain, (hidden, weight))

    torch.manual_seed(0)
    fused = algorithm.from_hidden(hidden, weight, targets, **inputs, **sizes).loss
    for got, want in zip(torch.autograd.grad(fused, (hidden, weight)), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)

    if splits(algorithm):
        normalizer = step(algorithm, inputs)
        h, w = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)

        def part(p):
            torch.manual_seed(0)
            return algorithm.from_hidden(
                h[p], w, targets[p], normalizer=normalizer, **{k: v[p] for k, v in inputs.items()}, **sizes
            )

        micro_batches(part, PARTS)
        for got, want in zip((h.grad, w.grad), reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
