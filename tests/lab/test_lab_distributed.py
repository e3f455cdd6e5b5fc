"""One trainer update on two gloo processes gives the parameters and the loss metrics of the same update on one."""

import pytest
import torch
from conftest import run_ranks
from lab_helpers import TINY, fixed_batch, tiny_policy

from pgloss.lab.config import LabConfig
from pgloss.lab.trainer import make_algorithm
from pgloss.lab.update import LOSS_METRICS, update

ALGORITHMS = ("grpo", "dapo", "dr_grpo")
N_PROMPTS = 6


def step(algorithm_name: str, rank: int = 0, world: int = 1) -> tuple[list[torch.Tensor], dict[str, float]]:
    """One ``update`` (2 minibatches x 2 micro-batches) on this rank's prompts; the parameters after it and its
    loss metrics."""
    policy = tiny_policy()
    batch = fixed_batch(policy, tiny_policy(seed=1), n_prompts=N_PROMPTS)
    mine = batch.select(batch.rollout.group_ids % world == rank)  # prompts rank, rank + world, ...
    cfg = LabConfig(algorithm=algorithm_name, epochs=1, minibatches=2, micro_batches=2, **TINY)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    metrics = update(policy, optimizer, make_algorithm(cfg), mine, cfg, N_PROMPTS, torch.Generator().manual_seed(0))
    return [p.detach().clone() for p in policy.parameters()], {k: float(metrics[k]) for k in (*LOSS_METRICS, "loss")}


def _worker(rank: int, world: int) -> dict:
    torch.set_num_threads(1)
    return {name: step(name, rank, world) for name in ALGORITHMS}


def test_two_processes_match_one():
    ranks = run_ranks(_worker)
    for name in ALGORITHMS:
        one, metrics = step(name)
        start = [p.detach() for p in tiny_policy().parameters()]
        moved = max(float((a - s).abs().max()) for a, s in zip(one, start, strict=True))
        assert moved > 1e-3, name  # the step did something
        for a, b in zip(one, ranks[0][name][0], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert metrics["clip_frac"] > 0 and metrics["ppo_kl"] != 0, name  # the second optimizer step clipped
        for rank in (0, 1):  # each step's metrics are over its tokens on every rank (pgloss.StepMetrics)
            assert ranks[rank][name][1] == pytest.approx(metrics, rel=1e-5, abs=1e-7), (name, rank)
