"""The optional inputs' one table (core/inputs.py): every path reads it and nothing else names them."""

import dataclasses
import inspect

import pytest
import torch

import pgloss
from pgloss.core.batch import TokenBatch
from pgloss.core.inputs import OPTIONAL_INPUTS


def batch(rows: int = 3, length: int = 4) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    log_prob = -torch.rand(rows, length, dtype=torch.float64)
    return dict(
        log_prob=log_prob,
        old_log_prob=log_prob - 0.1,
        advantages=torch.randn(rows, dtype=torch.float64),
        mask=torch.ones(rows, length, dtype=torch.bool),
    )


def test_every_input_is_a_field_of_the_batch_and_a_parameter_of_the_call():
    fields = {field.name for field in dataclasses.fields(TokenBatch)}
    assert set(OPTIONAL_INPUTS) <= fields
    parameters = inspect.signature(pgloss.get("grpo").__call__).parameters
    assert list(OPTIONAL_INPUTS) == [name for name in parameters if name in OPTIONAL_INPUTS]
    assert all(parameters[name].default is None for name in OPTIONAL_INPUTS)


@pytest.mark.parametrize("name", pgloss.names())
def test_what_a_loss_needs_is_in_the_table(name):
    assert pgloss.get(name, generation_budget=4).needs <= set(OPTIONAL_INPUTS)


def test_a_misspelt_input_is_refused_with_the_closest_name():
    with pytest.raises(TypeError, match="'ref_logprob'.*did you mean 'ref_log_prob'"):
        pgloss.get("grpo")(**batch(), ref_logprob=batch()["log_prob"])
    with pytest.raises(TypeError, match="'reward'.*the optional inputs are ref_log_prob"):
        pgloss.get("grpo")(**batch(), reward=torch.zeros(3))


def test_a_missing_input_says_why_from_the_configuration():
    with pytest.raises(ValueError, match=r"needs ref_log_prob in the call \(kl_coef=0.04"):
        pgloss.get("grpo", kl_coef=0.04)(**batch())
    with pytest.raises(ValueError, match="needs scores in the call .*raw sequence rewards"):
        pgloss.get("topr")(**batch())


def test_the_table_says_what_is_detached_and_what_keeps_its_gradient():
    data = batch()
    given = {
        name: (
            torch.zeros(3, dtype=torch.long if spec.kind == "integer" else torch.bool)
            if spec.kind != "real"
            else -torch.rand(3 if spec.per == "row" else (3, 4), dtype=torch.float64).requires_grad_()
        )
        for name, spec in OPTIONAL_INPUTS.items()
    }
    prepared = TokenBatch.prepare(**data, **given)
    for name, spec in OPTIONAL_INPUTS.items():
        assert getattr(prepared, name).requires_grad == spec.grad, name


def test_from_hidden_takes_the_inputs_it_does_not_compute():
    data = batch()
    hidden, weight = torch.randn(3, 4, 5, dtype=torch.float64), torch.randn(7, 5, dtype=torch.float64)
    targets = torch.randint(0, 7, (3, 4))
    alg = pgloss.get("topr")
    args = dict(old_log_prob=data["old_log_prob"], advantages=data["advantages"], mask=data["mask"])
    out = alg.from_hidden(hidden, weight, targets, **args, scores=torch.ones(3, dtype=torch.float64))
    assert torch.isfinite(out.loss)
    with pytest.raises(TypeError, match="'entropy'"):
        alg.from_hidden(hidden, weight, targets, **args, entropy=torch.zeros(3, 4, dtype=torch.float64))


def test_verl_refuses_a_loss_that_needs_any_input():
    pytest.importorskip("verl", reason="the verl adapter needs verl (the verl extra)")
    from pgloss.integrations import verl

    assert verl._NOT_PASSED == frozenset(OPTIONAL_INPUTS)
