"""``pgloss train`` and ``pgloss compare``: run the lab and write metrics, plots, samples and a report.

``compare`` warm-starts one policy per seed, then trains every (algorithm, seed) pair from
that seed's warm start, ``--workers`` runs at a time in separate processes (one torch thread
each, so results do not depend on the number of workers). ``train`` runs one algorithm in this
process and works under ``torchrun`` (data parallel; rank 0 writes the files).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from pgloss.lab.config import DEFAULT_ALGORITHMS, LabConfig, add_config_arguments, config_from_args

_TICK = None  # progress callback: the bar's update in this process, a queue's put in a worker


def _init_worker(queue) -> None:
    global _TICK
    _TICK = queue.put


def _tick(_record=None) -> None:
    if _TICK is not None:
        _TICK(1)


def warm_state(cfg: LabConfig) -> dict:
    """The warm-started policy of ``cfg.seed`` (a CPU state dict)."""
    import torch

    from pgloss.lab import trainer

    torch.set_num_threads(cfg.threads)
    tokenizer, task, model = trainer.build(cfg)
    trainer.warm_start(model, task, tokenizer, cfg)
    _tick()
    return {k: v.cpu() for k, v in model.state_dict().items()}


def run(cfg: LabConfig, state: dict) -> dict:
    """One RL run from a warm state; progress ticks once per step."""
    from pgloss.lab import trainer

    return trainer.train(cfg, state, on_step=_tick)


class _Runner:
    """Runs jobs in this process (one worker) or in a pool of spawned processes, ticking a bar."""

    def __init__(self, workers: int, bar) -> None:
        self.bar, self.pool, self.queue = bar, None, None
        if workers > 1:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.queue = ctx.Queue()
            self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(self.queue,))

    def map(self, fn, jobs: list[tuple]) -> list:
        """``[fn(*job) for job in jobs]``."""
        global _TICK
        if self.pool is None:
            _TICK = self.bar.update
            return [fn(*job) for job in jobs]
        import queue as queue_module

        pending = [self.pool.apply_async(fn, job) for job in jobs]
        while not all(p.ready() for p in pending):
            try:
                self.bar.update(self.queue.get(timeout=0.2))
            except queue_module.Empty:
                pass
        while not self.queue.empty():
            self.bar.update(self.queue.get())
        return [p.get() for p in pending]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool.join()


def _clean(value):
    return None if isinstance(value, float) and math.isnan(value) else value


def write_outputs(out: Path, records: list[dict], samples: dict, config: dict, command: str) -> Path:
    """metrics.jsonl, config.json, samples.md, PNG plots and report.md in `out`; returns the report."""
    from pgloss.lab.plots import plot_all
    from pgloss.lab.report import write_report, write_samples

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n")
    (out / "config.json").write_text(json.dumps({"command": command, **config}, indent=2) + "\n")
    write_samples(out, samples)
    plots = plot_all(records, out)
    return write_report(out, records, config, plots, samples, command)


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=1.0)


def _command_line() -> str:
    return "pgloss " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def cmd_compare(args) -> int:
    """Train every algorithm of ``--algorithms`` for every seed and write the comparison."""
    from pgloss.lab.tasks import make_task
    from pgloss.lab.trainer import make_algorithm

    algorithms = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    base = config_from_args(args)
    try:  # fail before any training on an unknown name
        make_task(base.task)
        for a in algorithms:
            make_algorithm(dataclasses.replace(base, algorithm=a))
    except (ValueError, TypeError) as err:
        print(f"pgloss compare: {err}", file=sys.stderr)
        return 2
    seeds = list(range(args.seeds))
    workers = max(1, min(args.workers, len(algorithms) * len(seeds)))
    out = Path(args.out)
    start = time.time()
    bar = _progress(len(seeds) + len(algorithms) * len(seeds) * (base.steps + 1), "compare")
    runner = _Runner(workers, bar)
    try:
        bar.set_postfix_str("warm start")
        states = runner.map(warm_state, [(dataclasses.replace(base, seed=s),) for s in seeds])
        runs = [dataclasses.replace(base, algorithm=a, seed=s) for a in algorithms for s in seeds]
        bar.set_postfix_str("RL")
        results = runner.map(run, [(cfg, states[cfg.seed]) for cfg in runs])
    finally:
        runner.close()
        bar.close()
    records = [r for result in results for r in result["metrics"]]
    samples = {(cfg.algorithm, cfg.seed): result["samples"] for cfg, result in zip(runs, results)}
    config = {"algorithms": algorithms, "seeds": seeds, "workers": workers, "base": dataclasses.asdict(base),
              "seconds": round(time.time() - start, 1)}
    report = write_outputs(out, records, samples, config, _command_line())
    print(f"wrote {report} ({config['seconds']} s)")
    return 0


def cmd_train(args) -> int:
    """Train one algorithm (data parallel under torchrun) and write its files."""
    from pgloss.lab import distributed as dist
    from pgloss.lab import trainer

    from pgloss.lab.tasks import make_task

    cfg = config_from_args(args)
    try:  # fail before any training on an unknown name
        make_task(cfg.task)
        trainer.make_algorithm(cfg)
    except (ValueError, TypeError) as err:
        print(f"pgloss train: {err}", file=sys.stderr)
        return 2
    rank, world = dist.init(cfg.device)
    start = time.time()
    bar = _progress(cfg.steps + 1, f"train {cfg.algorithm}") if rank == 0 else None
    result = trainer.train(cfg, on_step=(lambda _r: bar.update(1)) if bar else None)
    if bar:
        bar.close()
    if rank == 0:
        config = {"algorithms": [cfg.algorithm], "seeds": [cfg.seed], "world_size": world,
                  "base": dataclasses.asdict(cfg), "seconds": round(time.time() - start, 1)}
        report = write_outputs(Path(args.out), result["metrics"], {(cfg.algorithm, cfg.seed): result["samples"]},
                               config, _command_line())
        print(f"wrote {report} ({config['seconds']} s)")
    dist.cleanup()
    return 0


def add_commands(subparsers) -> None:
    """Add ``train`` and ``compare`` to the ``pgloss`` command's subparsers."""
    train = subparsers.add_parser("train", help="train a tiny policy with one algorithm (torchrun for data parallel)")
    add_config_arguments(train)
    train.add_argument("--out", default="runs/train", help="output directory (default: runs/train)")
    train.set_defaults(func=cmd_train)

    compare = subparsers.add_parser("compare", help="train a tiny policy with each algorithm and compare them")
    compare.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS),
                         help=f"comma-separated pgloss algorithm names (default: {','.join(DEFAULT_ALGORITHMS)})")
    compare.add_argument("--seeds", type=int, default=2, help="seeds 0..K-1 per algorithm (default: 2)")
    compare.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                         help="runs trained at once, one process each (default: min(2, CPUs))")
    compare.add_argument("--out", default="runs/compare", help="output directory (default: runs/compare)")
    add_config_arguments(compare, skip=("algorithm", "seed"))
    compare.set_defaults(func=cmd_compare)
