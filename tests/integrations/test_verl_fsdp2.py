"""pgloss_<name> inside verl 0.9.1 on two gloo ranks with FSDP2-sharded parameters: verl's own
`ppo_loss` per micro-batch, with the counts verl's FSDP engine fills (`dp_size`, `batch_num_tokens`
all-reduced over the data-parallel group, `global_batch_size` the mini-batch's rows on every rank).

Each rank runs a tiny model sharded by `fully_shard` on its rows (uneven tokens, an all-masked
micro-batch on rank 1), packs its log-probs as verl does and backpropagates every micro-batch; the
shard FSDP2 leaves on each rank must equal the matching rows of one `ppo_loss` call on the whole
mini-batch in one process. Clip-Cov and KL-Cov select tokens per call: their reference is the same
per-micro-batch calls in one process. TOPR and REAL need inputs verl does not pass (test_verl.py).
"""

import dataclasses
import functools
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import pgloss

pytest.importorskip("verl")
pytest.importorskip("tensordict")

from conftest import free_port
from properties.micro_batches import micro_batches
from test_fsdp2 import VOCAB, selects_per_call, tiny
from test_verl import BUDGET, LENGTH, ROWS, actor_config, make_batch, micro_batch, own_mode
from verl.utils import tensordict_utils as tu
from verl.workers.config import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss

from pgloss.integrations import verl as adapter

WORLD = 2
RANKS = {0: [slice(0, 3), slice(3, 5)], 1: [slice(5, 6), slice(6, 8)]}  # row 5 is empty (make_batch)
NAMES = [  # verl passes a policy loss none of the optional inputs (a teacher's term needs teacher_log_prob)
    n
    for n in pgloss.names()
    if not dataclasses.replace(pgloss.get(n, norm_constant=BUDGET), kl_coef=0.0, entropy_coef=0.0).needs
]


def data():
    """test_verl's mini-batch, with the old log-probs near the tiny model's own (ratios near one)."""
    batch = make_batch(seed=4)
    g = torch.Generator().manual_seed(5)
    batch["ids"] = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    batch["targets"] = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    with torch.no_grad():
        batch["old"] = log_probs(tiny(), batch, slice(None)) + 0.1 * torch.randn(
            ROWS, LENGTH, generator=g, dtype=torch.float64
        )
    return batch


def log_probs(model, batch, rows):
    logits = model.lm_head(model(batch["ids"][rows]))
    return logits.log_softmax(-1).gather(-1, batch["targets"][rows][..., None])[..., 0]


def loss(config, model, batch, rows, *, dp_size, batch_num_tokens):
    """verl's ppo_loss on one micro-batch, its log-probs from the model (placed at their rows)."""
    index = torch.arange(ROWS)[rows]
    leaf = torch.zeros(ROWS, LENGTH, dtype=torch.float64).index_copy(0, index, log_probs(model, batch, rows))
    output, micro = micro_batch(batch, leaf, rows, dp_size=dp_size)
    tu.assign_non_tensor(micro, batch_num_tokens=batch_num_tokens)  # as FSDPEngine.forward_backward_batch
    torch.manual_seed(0)  # Clip-Cov's draw: the same on every path
    return ppo_loss(config, output, micro)[0]


def config_of(name):
    # dro_beta has no default in verl (it refuses the loss without one), so the config sets pgloss's
    policy_loss = PolicyLossConfig(loss_mode=adapter.registered_name(name), dro_beta=0.1)
    return actor_config(policy_loss=policy_loss, loss_agg_mode=own_mode(name), loss_scale_factor=BUDGET)


def worker(rank: int, port: int, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        batch = data()
        model = tiny()
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        parts = RANKS[rank]
        tokens = torch.tensor(sum(int(batch["mask"][p].sum()) for p in parts))
        dist.all_reduce(tokens)  # FSDPEngine: the loss mask's sum, all-reduced over the dp group
        out = {}
        for name in NAMES:
            config = config_of(name)
            model.zero_grad(set_to_none=True)
            micro_batches(
                functools.partial(loss, config, model, batch, dp_size=WORLD, batch_num_tokens=int(tokens)), parts
            )
            out[name] = {k: p.grad.to_local().clone() for k, p in model.named_parameters()}
        results[rank] = out
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    results = mp.Manager().dict()
    mp.start_processes(worker, args=(free_port(), results), nprocs=WORLD, start_method="spawn", join=True)
    return {rank: dict(results[rank]) for rank in range(WORLD)}


@pytest.mark.parametrize("name", NAMES)
def test_every_shard_gets_the_gradient_of_one_verl_call(ranks, name):
    batch, model, config = data(), tiny(), config_of(name)
    tokens = int(batch["mask"].sum())
    if selects_per_call(pgloss.get(name, norm_constant=BUDGET)):
        sum(
            loss(config, model, batch, rows, dp_size=1, batch_num_tokens=tokens)
            for rank in range(WORLD)
            for rows in RANKS[rank]
        ).backward()
    else:
        loss(config, model, batch, slice(0, ROWS), dp_size=1, batch_num_tokens=tokens).backward()
    want = {k: p.grad for k, p in model.named_parameters()}
    assert sum(g.abs().sum() for g in want.values()) > 0
    for rank in range(WORLD):
        for key, full in want.items():
            torch.testing.assert_close(
                ranks[rank][name][key],
                torch.chunk(full, WORLD)[rank],
                rtol=1e-9,
                atol=1e-12,
                msg=lambda m, rank=rank, key=key: f"{name}, rank {rank}, {key}: {m}",
            )
