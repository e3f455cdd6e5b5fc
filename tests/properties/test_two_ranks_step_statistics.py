"""Two real torch.distributed processes (gloo on CPU), started once for every step statistic that
is global over ranks (advantage statistics, the entropy quantile, M2PO's cut, the rollout weight mean,
Clip-Cov's selection, REAL's groups,
RAE's role baseline, Clip_B / Clip_V's statistics, a step's metrics): each listed test module's `on_rank(rank)` runs inside the processes,
and its `check_ranks(results)` compares the ranks' results with one process on the whole batch."""

import importlib
import sys
from pathlib import Path

import pytest
from conftest import run_ranks

TESTS = Path(__file__).resolve().parents[1]
MODULES = [
    "advantages/test_estimators",
    "correction/test_token_masks",
    "correction/test_m2po",
    "correction/test_rollout_algorithms",
    "losses/test_cov_step",
    "losses/test_real",
    "advantages/test_baselines",
    "correction/test_clip_masks",
    "core/test_step_metrics",
]


def module(path: str):
    """The test module at tests/<path>.py, imported as pytest imports it (its folder on sys.path)."""
    folder, name = (TESTS / path).parent, Path(path).name
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
    return importlib.import_module(name)


def worker(rank: int, world: int) -> dict:
    return {name: module(name).on_rank(rank) for name in MODULES}


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(worker)


@pytest.mark.parametrize("name", MODULES)
def test_two_gloo_ranks_match_one_process(ranks, name):
    module(name).check_ranks({rank: ranks[rank][name] for rank in (0, 1)})
