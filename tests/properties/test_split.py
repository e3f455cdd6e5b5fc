"""Split invariance: micro-batches sharing one Normalizer give the whole batch's loss and gradient."""

import pytest
import torch
from conftest import algorithm, make_batch, optional_inputs
from hypothesis import given, settings
from hypothesis import strategies as st
from properties.micro_batches import cut, parts_of, split_call

import pgloss

SPLITS = [[0, 1, 2, 3, 4, 5, 6, 7, 8], [2, 4, 3], [1, 1, 7]]  # rows per micro-batch (uneven)


def run(alg, data, sizes, *, normalizer_from_whole_step=True):
    """Return (summed loss, summed log_prob gradient) over micro-batches of `sizes` rows."""
    parts = parts_of(sizes)
    normalizer = pgloss.Normalizer.count(cut(data["mask"], parts), group_ids=cut(data["group_ids"], parts))
    return split_call(
        alg,
        data["log_prob"],
        parts,
        normalizer,
        old_log_prob=data["old_log_prob"],
        advantages=data["advantages"],
        mask=data["mask"],
        **optional_inputs(data),
    )


@pytest.mark.parametrize("mode", pgloss.AGG_MODES)
@pytest.mark.parametrize("name", ["grpo", "gspo_token", "cispo", "sapo", "fipo"])
def test_micro_batches_equal_whole_batch(name, mode):
    data = make_batch(batch=9, length=6, seed=21, per_token_adv=True)
    alg = algorithm(name, loss_agg_mode=mode, norm_constant=6.0, kl_coef=0.1, entropy_coef=0.01)
    whole_loss, whole_grad = run(alg, data, [9])
    for sizes in SPLITS[1:]:
        loss, grad = run(alg, data, sizes)
        torch.testing.assert_close(loss, whole_loss, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", ["gspo", "sample_grpo", "dr_grpo", "dapo"])
def test_named_defaults_are_split_invariant(name):
    data = make_batch(batch=9, length=6, seed=22)
    alg = algorithm(name)
    whole_loss, whole_grad = run(alg, data, [9])
    loss, grad = run(alg, data, [2, 4, 3])
    torch.testing.assert_close(loss, whole_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-14)


def test_per_micro_batch_normalisation_would_not_be_invariant():
    """The bug pgloss exists to avoid: normalising each micro-batch by its own token count."""
    data = make_batch(batch=9, length=6, seed=23)
    alg = pgloss.get("dapo")
    whole_loss, _ = run(alg, data, [9])
    local = (
        sum(
            alg(data["log_prob"][s], data["old_log_prob"][s], data["advantages"][s], data["mask"][s]).loss
            for s in (slice(0, 2), slice(2, 9))
        )
        / 2
    )
    assert abs(local.item() - whole_loss.item()) > 1e-3


@settings(max_examples=30, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    cuts=st.lists(st.integers(1, 8), min_size=1, max_size=4),
    mode=st.sampled_from(pgloss.AGG_MODES),
    # Row-coupled names (Clip-Cov and KL-Cov select among a call's tokens, REAL contrasts a group's rows)
    # are split-invariant only for calls holding whole groups: tests/losses/test_families_against_loops.py.
    name=st.sampled_from([n for n, (family, _) in pgloss.algorithms.NAMED.items() if not family.couples_rows]),
)
def test_any_split_of_any_algorithm_is_invariant(seed, cuts, mode, name):
    """Random algorithm, mode, batch and cut points: the summed micro-batch gradient never moves."""
    data = make_batch(batch=9, length=6, seed=seed, per_token_adv=True)
    bounds = sorted(set(c for c in cuts if c < 9))
    sizes = [b - a for a, b in zip([0] + bounds, bounds + [9], strict=True)]
    fixed = algorithm(name).fixed_agg_mode
    alg = algorithm(name, loss_agg_mode=fixed or mode, norm_constant=6.0, kl_coef=0.1)
    whole_loss, whole_grad = run(alg, data, [9])
    loss, grad = run(alg, data, sizes)
    torch.testing.assert_close(loss, whole_loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_grad, rtol=1e-12, atol=1e-14)
