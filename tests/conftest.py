import os
import socket
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
# Without a GPU the Triton kernels (tests/vocab/test_kernels.py) run in Triton's interpreter on CPU tensors;
# it is chosen when triton is imported, so before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def log_probs(values):
    """`values` folded onto log-probabilities, -|x| (<= 0): a perturbed log-prob stays one, since
    pgloss refuses a positive log-prob at a valid position."""
    return -values.abs()


def make_batch(batch=5, length=7, *, seed=0, spread=0.3, dtype=torch.float64, per_token_adv=False):
    """Uneven lengths (one row empty when batch >= 5), ratios around one, mixed-sign advantages."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    if batch >= 5:
        lengths[3] = 0
    mask = torch.arange(length)[None, :] < lengths[:, None]
    old = -torch.rand(batch, length, generator=gen, dtype=dtype) * 2 - 0.1
    log_prob = log_probs(old + spread * torch.randn(batch, length, generator=gen, dtype=dtype))
    ref = log_probs(old + 0.2 * torch.randn(batch, length, generator=gen, dtype=dtype))
    shape = (batch, length) if per_token_adv else (batch,)
    advantages = torch.randn(shape, generator=gen, dtype=dtype)
    entropy = torch.rand(batch, length, generator=gen, dtype=dtype)
    group_ids = torch.arange(batch) % 2
    scores = torch.randn(batch, generator=gen, dtype=dtype)
    teacher = log_probs(old + 0.3 * torch.randn(batch, length, generator=gen, dtype=dtype))
    return dict(
        log_prob=log_prob,
        old_log_prob=old,
        ref_log_prob=ref,
        advantages=advantages,
        mask=mask,
        entropy=entropy,
        group_ids=group_ids,
        scores=scores,
        teacher_log_prob=teacher,
    )


def optional_inputs(data, part=slice(None)):
    """The loss call's optional inputs (core/inputs.py's table) that `data` holds, rows `part`: a test
    passes them all and each loss reads those it needs, so a new input reaches every such test."""
    from pgloss.core.inputs import OPTIONAL_INPUTS

    return {name: data[name][part] for name in OPTIONAL_INPUTS if name in data}


def algorithm(name, **overrides):
    import pgloss

    if name == "dr_grpo":
        overrides.setdefault("norm_constant", 9.0)
    return pgloss.get(name, **overrides)


@pytest.fixture
def batch():
    return make_batch()


def run_ranks(worker, world: int = 2) -> dict:
    """`worker(rank, world)` in `world` spawned processes joined in one gloo process group (set up and
    torn down here), each with one intra-op thread; {rank: what the worker returned}. `worker` is a
    module-level function."""
    import torch.multiprocessing as mp

    results = mp.Manager().dict()
    mp.start_processes(
        _rank_main, args=(world, free_port(), results, worker), nprocs=world, start_method="spawn", join=True
    )
    return {rank: results[rank] for rank in range(world)}


def _rank_main(rank: int, world: int, port: int, results, worker) -> None:
    import os

    import torch.distributed as dist

    # The ranks' tensors are tiny and the ranks share the machine's cores: a second intra-op thread per rank
    # only spins against the others (the FSDP2 test's ranks took twice the CPU time with torch's default).
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results[rank] = worker(rank, world)
        dist.barrier()  # every rank done before any tears its connections down (gloo aborts a rank mid-exit)
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    """A free TCP port on this host for a gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The count line at every verbosity, `-qq` included, where pytest prints none of its own."""
    if config.get_verbosity() >= -1:
        return
    stats = terminalreporter.stats
    count = {key: len(stats.get(key, ())) for key in ("passed", "failed", "skipped", "error")}
    extra = "".join(f", {count[key]} {key}" for key in ("skipped", "error") if count[key])
    terminalreporter.write_line(f"{count['passed']} passed, {count['failed']} failed{extra}")
