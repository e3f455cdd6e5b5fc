"""verl's registered pgloss policy losses (`pgloss_<name>`) with NaN and ±inf where `response_mask` is 0, in
every tensor verl hands a policy loss (log-probs, old log-probs, advantages, `rollout_is_weights`), with and
without the step's counts in `config.global_batch_info`: the loss, its gradient and every metric equal the call
with finite values there, and the gradient at masked positions is 0."""

import dataclasses
import math

import pytest
import torch

import pgloss

pytest.importorskip("verl")

from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.workers.config import ActorConfig, PolicyLossConfig

from pgloss.integrations import verl as adapter

ROWS, LENGTH, BUDGET = 8, 6, 6.0


def verl_runs(name):
    """Whether verl can run the name: its policy term needs no input verl never passes a policy loss (scores,
    group ids, the teacher's log-probs); verl adds the KL and entropy terms itself. The others are refused by
    name (tests/integrations/test_verl.py)."""
    return not dataclasses.replace(pgloss.get(name, generation_budget=BUDGET), kl_coef=0.0, entropy_coef=0.0).needs


RUNS = [name for name in pgloss.names() if verl_runs(name)]


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=g)
    lengths[5] = 0
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    old = -torch.rand(ROWS, LENGTH, generator=g, dtype=torch.float64) * 2 - 0.1
    log_prob = (old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)).clamp(max=-1e-3)
    return dict(
        old_log_prob=old,
        log_prob=log_prob,
        advantages=torch.randn(ROWS, LENGTH, generator=g, dtype=torch.float64),
        response_mask=mask,
        rollout_is_weights=0.5 + torch.rand(ROWS, LENGTH, generator=g, dtype=torch.float64),
    )


def poisoned(values, seed):
    g = torch.Generator().manual_seed(seed)
    out = dict(values)
    hole = ~values["response_mask"]
    for key in ("old_log_prob", "log_prob", "advantages", "rollout_is_weights"):
        poisons = torch.tensor([math.nan, math.inf, -math.inf], dtype=torch.float64)
        fill = poisons[torch.randint(0, 3, hole.shape, generator=g)]
        out[key] = torch.where(hole, fill, values[key])
    return out


def call(name, values, *, counts, weights):
    mode = pgloss.get(name, generation_budget=BUDGET).loss_agg_mode
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=4,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size_per_gpu=2,
        policy_loss=PolicyLossConfig(loss_mode=adapter.registered_name(name), dro_beta=0.1),
        loss_agg_mode=mode,
        loss_scale_factor=BUDGET,
    )
    if counts:  # what verl's ppo_loss fills before it calls the policy loss
        config.global_batch_info.update(
            dp_size=1, batch_num_tokens=int(values["response_mask"].sum()) + 5, global_batch_size=ROWS + 2
        )
    leaf = values["log_prob"].clone().requires_grad_(True)
    torch.manual_seed(0)  # Clip-Cov and KL-Cov draw from the global generator
    loss, metrics = get_policy_loss_fn(adapter.registered_name(name))(
        old_log_prob=values["old_log_prob"],
        log_prob=leaf,
        advantages=values["advantages"],
        response_mask=values["response_mask"],
        loss_agg_mode=mode,
        config=config,
        rollout_is_weights=values["rollout_is_weights"] if weights else None,
    )
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss, grad, metrics


def same(a, b):
    return torch.equal(torch.as_tensor(a).isnan(), torch.as_tensor(b).isnan()) and torch.equal(
        torch.nan_to_num(torch.as_tensor(a)), torch.nan_to_num(torch.as_tensor(b))
    )


@pytest.mark.parametrize("weights", [False, True], ids=["plain", "rollout_is_weights"])
@pytest.mark.parametrize("counts", [False, True], ids=["own-counts", "global_batch_info"])
@pytest.mark.parametrize("name", RUNS)
def test_non_finite_values_under_the_response_mask_change_nothing(name, counts, weights):
    clean = inputs(seed=1)
    loss, grad, metrics = call(name, clean, counts=counts, weights=weights)
    dirty_loss, dirty_grad, dirty_metrics = call(name, poisoned(clean, seed=2), counts=counts, weights=weights)
    assert grad.abs().sum() > 0
    assert same(dirty_loss, loss)
    assert torch.equal(dirty_grad, grad)
    assert (dirty_grad[~clean["response_mask"]] == 0).all()
    assert sorted(dirty_metrics) == sorted(metrics)
    for key in metrics:
        assert same(dirty_metrics[key], metrics[key]), key


def test_the_names_verl_cannot_run_are_refused():
    """The names left out above are refused by name at their first call, not run on made-up inputs."""
    assert RUNS and len(RUNS) < len(pgloss.names())
    for name in sorted(set(pgloss.names()) - set(RUNS)):
        with pytest.raises(ValueError):
            call(name, inputs(seed=1), counts=False, weights=False)
