"""Properties every registered name has, checked over `pgloss.names()`: a family inherits them by being
registered. Beside these: tests/properties/test_paths.py (one call = micro-batches = from_hidden =
inspect, with each kind of rollout correction), test_no_host_sync.py (meta tensors, torch.compile)
and test_robustness.py (extreme log-ratios, empty and all-masked batches)."""

import functools

import pytest
import torch
import torch.distributed as dist
from conftest import run_ranks
from properties.micro_batches import cut, micro_batches
from steps import PARTS, data, log_probs

import pgloss
from pgloss.core.inputs import OPTIONAL_INPUTS

OPTIONAL = tuple(name for name in OPTIONAL_INPUTS if name != "full_kl")  # the exact KL has its own tests
RANKS = {0: [slice(0, 2), slice(2, 4)], 1: [slice(4, 8)]}  # uneven shares of whole groups


def step_inputs(algorithm, seed=0):
    """log_prob (a leaf) and the call's inputs: the required ones, and every optional one it needs."""
    hidden, weight, targets, inputs = data(seed)
    inputs = {k: v for k, v in inputs.items() if k not in OPTIONAL or k in algorithm.needs}
    if "entropy" in algorithm.needs:
        logp = torch.log_softmax(hidden @ weight.T, dim=-1)
        inputs["entropy"] = -(logp.exp() * logp).sum(-1)
    return log_probs(hidden, weight, targets).detach().requires_grad_(True), inputs


def everyone():
    """Each name with an entropy bonus and a KL term, so that every optional input is in play."""
    return [pytest.param(name, id=name) for name in pgloss.names()]


def build(name):
    return pgloss.get(name, generation_budget=6, kl_coef=0.05, entropy_coef=0.01)


def run(algorithm, log_prob, inputs, rows=slice(None), normalizer=None):
    torch.manual_seed(0)  # Clip-Cov and KL-Cov draw their selection from the global generator
    return algorithm(log_prob[rows], **{k: v[rows] for k, v in inputs.items()}, normalizer=normalizer)


def gradient(algorithm, log_prob, inputs, rows=slice(None), normalizer=None):
    out = run(algorithm, log_prob, inputs, rows, normalizer)
    return out, torch.autograd.grad(out.loss, log_prob)[0]


@pytest.mark.parametrize("name", everyone())
def test_the_same_call_gives_the_same_bits(name):
    algorithm = build(name)
    log_prob, inputs = step_inputs(algorithm)
    first, grad = gradient(algorithm, log_prob, inputs)
    again, grad_again = gradient(algorithm, log_prob, inputs)
    assert torch.equal(first.loss, again.loss) and torch.equal(grad, grad_again)
    assert grad.abs().sum() > 0
    assert first.metrics.keys() == again.metrics.keys()
    for key, value in first.metrics.items():
        assert value.requires_grad is False and value.dim() == 0, key
        assert torch.equal(value, again.metrics[key]) or (value.isnan() and again.metrics[key].isnan()), key


@pytest.mark.parametrize("name", everyone())
def test_a_missing_input_is_named_with_its_reason(name):
    algorithm = build(name)
    log_prob, inputs = step_inputs(algorithm)
    for needed in sorted(algorithm.needs & set(OPTIONAL)):
        with pytest.raises(ValueError, match=f"{name} needs {needed} in the call"):
            algorithm(log_prob, **{k: v for k, v in inputs.items() if k != needed})


@pytest.mark.parametrize("name", everyone())
def test_a_mask_of_the_wrong_shape_is_refused_by_name(name):
    algorithm = build(name)
    log_prob, inputs = step_inputs(algorithm)
    with pytest.raises(ValueError, match="mask"):
        algorithm(log_prob, **{**inputs, "mask": inputs["mask"][:, :-1]})


def splits_over_ranks(algorithm) -> bool:
    """A loss whose rows do not depend on other rows' values splits over ranks (whole groups each)."""
    return not algorithm.couples_rows


def rank_gradients(rank: int, world: int) -> dict:
    out = {}
    for name in pgloss.names():
        algorithm = build(name)
        if not splits_over_ranks(algorithm):
            continue
        log_prob, inputs = step_inputs(algorithm)
        parts = RANKS[rank]
        normalizer = algorithm.step_normalizer(
            cut(inputs["mask"], parts),
            old_log_probs=cut(inputs["old_log_prob"], parts),
            group_ids=cut(data()[3]["group_ids"], parts),
        )
        micro_batches(functools.partial(run, algorithm, log_prob, inputs, normalizer=normalizer), parts)
        total = log_prob.grad.clone()
        dist.all_reduce(total)
        out[name] = total / dist.get_world_size()  # DDP's gradient average
    return out


def test_two_gloo_ranks_give_one_process_gradient_for_every_name():
    results = run_ranks(rank_gradients)
    checked = []
    for name in pgloss.names():
        algorithm = build(name)
        if not splits_over_ranks(algorithm):
            continue
        log_prob, inputs = step_inputs(algorithm)
        _, reference = gradient(algorithm, log_prob, inputs)
        for rank in (0, 1):
            torch.testing.assert_close(results[rank][name], reference, rtol=1e-10, atol=1e-13, msg=name)
        checked.append(name)
    coupled = [n for n in pgloss.names() if n not in checked]
    assert len(checked) >= len(pgloss.names()) - 4, f"only {checked}; coupled rows: {coupled}"
    assert PARTS  # the single-process micro-batch split of the same step is in test_paths.py
