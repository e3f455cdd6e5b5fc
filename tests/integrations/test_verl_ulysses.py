"""pgloss_<name> under verl 0.9.1's Ulysses sequence parallelism (ulysses_sequence_parallel_size > 1).

verl's FSDP engine (`verl.workers.engine.fsdp.transformer_impl`) pads each packed micro-batch to a multiple of
the sp size and gives each sp rank a contiguous slice (`ulysses_pad_and_slice_inputs`); after the model it
gathers the log-probs back over the sp group and drops the padding (`gather_outputs_and_unpad`, whose backward
keeps the rank's slice of the gradient times the sp size), then calls `ppo_loss`, and so the policy loss, on
whole sequences, with the counts of the data-parallel group alone (`dp_size` = world / sp). The loss never sees
a slice: the adapter needs no sequence group there. FSDP averages the gradient over dp x sp ranks, which the
gather's factor cancels.

This runs that path on two gloo ranks (sp = 2, dp = 1): each rank's log-probs are its slice of the packed
micro-batch, computed from a replicated parameter, gathered with verl's own function, through verl's
`ppo_loss` with pgloss_<name>; the parameter's gradient averaged over the ranks must be one process's.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import pgloss

pytest.importorskip("verl")
pytest.importorskip("tensordict")

from conftest import run_ranks
from test_verl import BUDGET, ROWS, SPLIT, actor_config, make_batch, micro_batch, own_mode
from verl.utils.ulysses import gather_outputs_and_unpad
from verl.workers.config import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from pgloss.integrations import verl as adapter

SP = 2


def runnable(name):
    """verl passes a policy loss no group ids nor scores, and has no group mode."""
    algorithm = dataclasses.replace(pgloss.get(name, generation_budget=BUDGET), kl_coef=0.0, entropy_coef=0.0)
    return not algorithm.needs and own_mode(name) != "group-mean-token-mean"


def config(name):
    return actor_config(
        policy_loss=PolicyLossConfig(loss_mode=adapter.registered_name(name), dro_beta=0.1),
        loss_agg_mode=own_mode(name),
        loss_scale_factor=BUDGET,
    )


def step(name, sequence_parallel):
    """Σ over verl's micro-batches of ppo_loss and the gradient of the parameter the log-probs come from."""
    batch = make_batch(seed=3)
    theta = batch["log_prob"].clone().requires_grad_()
    total = torch.zeros((), dtype=torch.float64)
    for rows in [slice(0, ROWS)] if pgloss.get(name, generation_budget=BUDGET).couples_rows else SPLIT:
        output, data = micro_batch(batch, theta, rows)
        packed = output["log_probs"]
        if sequence_parallel:  # this rank's slice of the padded packed tokens, then verl's gather back
            pad = (SP - packed.shape[0] % SP) % SP
            padded = torch.cat([packed, packed.new_zeros(pad)])
            width = padded.shape[0] // SP
            local = padded[dist.get_rank() * width : (dist.get_rank() + 1) * width]
            packed = gather_outputs_and_unpad(
                local, gather_dim=0, unpad_dim=0, padding_size=pad, group=dist.group.WORLD
            )
        loss, _ = ppo_loss(config(name), {"log_probs": packed}, data)
        loss.backward()
        total = total + loss.detach()
    return total, theta.grad


def worker(rank, world):
    torch.set_num_threads(1)
    out = {}
    for name in filter(runnable, pgloss.names()):
        loss, grad = step(name, sequence_parallel=True)
        dist.all_reduce(grad)  # FSDP's average over the dp x sp ranks
        out[name] = (loss, grad / world)
    return out


def test_the_loss_sees_whole_sequences_and_the_gradient_is_one_process():
    results = run_ranks(worker, SP)
    names = [name for name in pgloss.names() if runnable(name)]
    assert len(names) > len(pgloss.names()) // 2 and set(results[0]) == set(names)  # the rest: test_verl.py
    for name in names:
        loss, grad = step(name, sequence_parallel=False)
        assert grad.abs().sum() > 0
        for rank in range(SP):
            got_loss, got_grad = results[rank][name]
            torch.testing.assert_close(got_loss, loss, rtol=1e-12, atol=1e-14, msg=name)  # each rank: the whole loss
            torch.testing.assert_close(got_grad, grad, rtol=1e-10, atol=1e-13, msg=name)
