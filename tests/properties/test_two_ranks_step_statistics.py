"""Two real torch.distributed processes (gloo on CPU), started once for every step statistic that
is global over ranks (advantage statistics, the entropy quantile, M2PO's cut, the rollout weight mean,
Clip-Cov's selection, REAL's groups,
RAE's role baseline, Clip_B / Clip_V's statistics): each listed test module's `on_rank(rank)` runs inside the processes,
and its `check_ranks(results)` compares the ranks' results with one process on the whole batch."""

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import free_port

TESTS = Path(__file__).resolve().parents[1]
MODULES = ["advantages/test_estimators", "correction/test_token_masks", "correction/test_m2po",
           "correction/test_rollout_algorithms", "losses/test_cov_step", "losses/test_real",
           "advantages/test_baselines", "correction/test_clip_masks"]


def module(path: str):
    """The test module at tests/<path>.py, imported as pytest imports it (its folder on sys.path)."""
    folder, name = (TESTS / path).parent, Path(path).name
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        results[rank] = {name: module(name).on_rank(rank) for name in MODULES}
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks():
    results = mp.Manager().dict()
    mp.start_processes(worker, args=(free_port(), results), nprocs=2, start_method="spawn", join=True)
    return {rank: dict(results[rank]) for rank in (0, 1)}


@pytest.mark.parametrize("name", MODULES)
def test_two_gloo_ranks_match_one_process(ranks, name):
    module(name).check_ranks({rank: ranks[rank][name] for rank in (0, 1)})
