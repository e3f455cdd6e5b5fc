"""Two real torch.distributed processes (gloo on CPU), started once for every statistic of part 2
that is global over ranks: each listed test module's `on_rank(rank)` runs inside the processes,
and its `check_ranks(results)` compares the ranks' results with one process on the whole batch."""

import importlib
import os

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from test_distributed import free_port

MODULES = ["test_estimators", "test_token_masks", "test_m2po", "test_rollout_algorithms", "test_cov_step", "test_real"]


def worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = {name: importlib.import_module(name).on_rank(rank) for name in MODULES}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    results = mp.Manager().dict()
    mp.start_processes(worker, args=(free_port(), results), nprocs=2, start_method="spawn", join=True)
    return {rank: dict(results[rank]) for rank in (0, 1)}


@pytest.mark.parametrize("name", MODULES)
def test_two_gloo_ranks_match_one_process(ranks, name):
    importlib.import_module(name).check_ranks({rank: ranks[rank][name] for rank in (0, 1)})
