"""``pgloss train`` and ``pgloss compare``: run the lab and write metrics, plots, samples and a report.

``compare`` warm-starts one policy per seed, then trains every (algorithm, seed) pair from
that seed's warm start, ``--workers`` runs at a time in separate processes (one torch thread
each, so results do not depend on the number of workers). ``train`` runs one algorithm in this
process and works under ``torchrun`` (data parallel; rank 0 writes the files).

Both check every argument before any training, write ``metrics.jsonl`` as the runs go, keep
the other runs when one fails (exit status 1, its traceback in ``errors.log``), and on Ctrl-C
stop within seconds, writing the report and plots of the runs that finished (exit status 130).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from pgloss.lab.config import DEFAULT_ALGORITHMS, LabConfig, add_config_arguments, config_from_args, mismatched

LAB_FILES = ("metrics.jsonl", "config.json", "samples.md", "report.md", "errors.log")

_EMIT = None  # where a run's progress goes: this process's stream, or a queue's put in a worker


def _init_worker(queue) -> None:
    global _EMIT
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _EMIT = queue.put


def _emit(item=None) -> None:
    if _EMIT is not None:
        _EMIT(item)


def _failure(err: BaseException, **extra) -> dict:
    return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(), **extra}


def warm_state(cfg: LabConfig) -> dict:
    """``{"state": the warm-started policy of cfg.seed}`` (a CPU state dict), or ``{"error": ...}``."""
    import torch

    from pgloss.lab import trainer

    try:
        torch.set_num_threads(cfg.threads)
        tokenizer, task, model = trainer.build(cfg)
        trainer.warm_start(model, task, tokenizer, cfg)
        return {"state": {k: v.cpu() for k, v in model.state_dict().items()}}
    except Exception as err:  # noqa: BLE001 (reported per run, the other seeds go on)
        return _failure(err)
    finally:
        _emit()


def run(cfg: LabConfig, warm: dict) -> dict:
    """One RL run from a warm state: ``{"metrics", "samples"}``, or ``{"error", "traceback", "metrics"}``
    with the records of the steps it made. Every step's record is emitted as it is made."""
    from pgloss.lab import trainer

    records: list[dict] = []
    if "error" in warm:
        return {"error": f"warm start failed: {warm['error']}", "traceback": warm["traceback"], "metrics": records}

    def on_step(record: dict) -> None:
        records.append(record)
        _emit(record)

    _emit({"started": [cfg.algorithm, cfg.seed]})
    try:
        return trainer.train(cfg, warm["state"], on_step=on_step)
    except Exception as err:  # noqa: BLE001 (one algorithm failing does not lose the others)
        return _failure(err, metrics=records)


def _clean(value):
    return None if isinstance(value, float) and math.isnan(value) else value


class _Stream:
    """``metrics.jsonl``, one line per step, written as the runs go; ticks the progress bar."""

    def __init__(self, path: Path, bar=None) -> None:
        self.file, self.bar, self.written, self.started = open(path, "w"), bar, set(), set()

    def __call__(self, item: dict | None) -> None:
        """A step's record (written, one tick), None (a warm start: one tick) or a run's start."""
        if item is not None and "started" in item:
            self.started.add(tuple(item["started"]))
            return
        if item is not None:
            self.write(item)
        if self.bar is not None:
            self.bar.update(1)

    def write(self, record: dict) -> None:
        key = (record["algorithm"], record["seed"], record["step"])
        if key not in self.written:  # a run's result repeats the records its worker streamed
            self.written.add(key)
            self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
            self.file.flush()

    def steps_done(self, algorithm: str, seed: int) -> int:
        return sum(1 for a, s, _ in self.written if (a, s) == (algorithm, seed))

    def close(self) -> None:
        self.file.close()
        if self.bar is not None:
            self.bar.close()


class _Runner:
    """Runs jobs in this process (one worker) or in a pool of spawned processes."""

    def __init__(self, workers: int, stream: _Stream) -> None:
        self.stream, self.pool, self.queue = stream, None, None
        if workers > 1:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.queue = ctx.Queue()
            self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(self.queue,))

    def map(self, fn, jobs: list[tuple], done: dict) -> None:
        """``done[i] = fn(*jobs[i])`` as each job finishes: after a KeyboardInterrupt, `done`
        holds the jobs that finished."""
        global _EMIT
        if self.pool is None:
            _EMIT = self.stream
            try:
                for i, job in enumerate(jobs):
                    done[i] = fn(*job)
            finally:
                _EMIT = None
            return
        import queue as queue_module

        pending = {i: self.pool.apply_async(fn, job) for i, job in enumerate(jobs)}
        while pending:
            try:
                self.stream(self.queue.get(timeout=0.2))
            except queue_module.Empty:
                pass
            for i in [i for i, p in pending.items() if p.ready()]:
                done[i] = pending.pop(i).get()
                for record in done[i].get("metrics", []) if isinstance(done[i], dict) else []:
                    self.stream.write(record)

    def close(self, terminate: bool = False) -> None:
        if self.pool is not None:
            self.pool.terminate() if terminate else self.pool.close()
            self.pool.join()


def prepare_out(path: str) -> Path:
    """The output directory, created; the lab's files of an earlier run in it are removed.
    ValueError when it cannot be used."""
    from pgloss.lab.plots import plot_names

    out = Path(path)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {path}: is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {path}: cannot create the directory ({err.strerror})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: the directory is not writable")
    for name in (*LAB_FILES, *(f"{n}.png" for n in plot_names(mismatch=True))):
        (out / name).unlink(missing_ok=True)
    return out


def _git_version() -> str | None:
    """``git describe --always --dirty`` of the checkout pgloss runs from; None outside one."""
    import pgloss

    src = Path(pgloss.__file__).resolve().parent
    try:
        tracked = subprocess.run(["git", "-C", str(src), "ls-files", "--error-unmatch", "__init__.py"],
                                 capture_output=True, timeout=10)
        if tracked.returncode != 0:
            return None
        done = subprocess.run(["git", "-C", str(src), "describe", "--always", "--dirty", "--abbrev=12"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def versions() -> dict:
    """pgloss, torch, Python and the git commit of the source, for ``config.json``."""
    import torch

    import pgloss

    return {"pgloss": pgloss.__version__, "torch": torch.__version__, "python": platform.python_version(),
            "git": _git_version()}


def _write_config(out: Path, config: dict) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def finish(out: Path, runs: list[dict], config: dict) -> Path:
    """samples.md, PNG plots of the finished runs, errors.log, config.json and report.md; returns the report."""
    from pgloss.lab.plots import plot_all
    from pgloss.lab.report import write_report, write_samples

    finished = [r for r in runs if r["status"] == "finished"]
    write_samples(out, {(r["algorithm"], r["seed"]): r["samples"] for r in finished})
    plots = plot_all([m for r in finished for m in r["metrics"]], out, max_grad_norm=config["base"]["max_grad_norm"],
                     mismatch=mismatched(config["base"])) if finished else []
    failed = [r for r in runs if r["status"] == "failed"]
    if failed:
        (out / "errors.log").write_text("".join(f"== {r['algorithm']}, seed {r['seed']}\n{r['traceback']}\n"
                                                for r in failed))
    config["runs"] = [{k: r[k] for k in ("algorithm", "seed", "status", "steps_done", "error")} for r in runs]
    _write_config(out, config)
    return write_report(out, runs, config, plots)


def _outcome(cfg: LabConfig, result: dict | None, stream: _Stream) -> dict:
    """A run's status (finished, failed, interrupted, not started) with what it produced; ``steps_done``
    counts the steps whose record was written (at most ``cfg.steps``: the last record measures the final policy)."""
    if result is None:
        steps = min(stream.steps_done(cfg.algorithm, cfg.seed), cfg.steps)
        started = steps or (cfg.algorithm, cfg.seed) in stream.started
        return {"algorithm": cfg.algorithm, "seed": cfg.seed, "status": "interrupted" if started else "not started",
                "steps_done": steps, "error": None, "metrics": [], "samples": {}}
    status = "failed" if "error" in result else "finished"
    return {"algorithm": cfg.algorithm, "seed": cfg.seed, "status": status, "steps_done": min(len(result["metrics"]), cfg.steps),
            "error": result.get("error"), "traceback": result.get("traceback"), "metrics": result["metrics"],
            "samples": result.get("samples", {})}


def _progress(total: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, mininterval=1.0)


def _command_line() -> str:
    return "pgloss " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _specs(items: list[str], loss_args: list[str] | None):
    import pgloss
    from pgloss.lab.spec import parse_algorithms

    return parse_algorithms(items, pgloss.names(), loss_args or [])


def _summary_line(command: str, runs: list[dict], report: Path, seconds: float, interrupted: bool) -> str:
    done = sum(r["status"] == "finished" for r in runs)
    failed = [f"{r['algorithm']} seed {r['seed']}" for r in runs if r["status"] == "failed"]
    text = f"pgloss {command}: " + ("interrupted; " if interrupted else "")
    text += f"{done} of {len(runs)} runs finished in {seconds:.0f} s; report: {report}"
    if failed:
        text += f"; failed: {', '.join(failed)} (see errors.log)"
    return text


def _import_outputs() -> None:
    """Import what the report and plots need now, so that a missing package fails before any
    training and Ctrl-C cannot land inside an import (a half-imported extension cannot be retried)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as err:
        raise ValueError(f"the lab needs matplotlib and tqdm ({err}); install them with pip install 'pgloss[lab]'") from None


def cmd_compare(args) -> int:
    """Train every algorithm of ``--algorithms`` for every seed and write the comparison."""
    from pgloss.lab import trainer

    start = time.time()
    try:  # every argument is checked before any training
        _import_outputs()
        base = config_from_args(args)
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        specs = _specs(args.algorithms, args.loss_arg)
        for spec in specs:
            trainer.make_algorithm(dataclasses.replace(base, algorithm=spec.label))
        out = prepare_out(args.out)
    except (ValueError, TypeError) as err:
        print(f"pgloss compare: {err}", file=sys.stderr)
        return 2
    seeds = list(range(args.seeds))
    runs = [dataclasses.replace(base, algorithm=s.label, seed=seed) for s in specs for seed in seeds]
    workers = min(args.workers, len(runs))
    config = {"command": _command_line(), "versions": versions(), "algorithms": [s.label for s in specs],
              "seeds": seeds, "workers": workers, "base": dataclasses.asdict(base), "status": "running"}
    _write_config(out, config)
    stream = _Stream(out / "metrics.jsonl", _progress(len(seeds) + len(runs) * (base.steps + 1), "compare"))
    runner, warm, results, interrupted = None, {}, {}, False
    try:
        runner = _Runner(workers, stream)
        stream.bar.set_postfix_str("warm start")
        runner.map(warm_state, [(dataclasses.replace(base, seed=s),) for s in seeds], warm)
        stream.bar.set_postfix_str("RL")
        runner.map(run, [(cfg, warm[cfg.seed]) for cfg in runs], results)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if runner is not None:
            runner.close(terminate=interrupted)
        stream.close()
    return _conclude("compare", out, [_outcome(cfg, results.get(i), stream) for i, cfg in enumerate(runs)],
                     config, start, interrupted)


def _conclude(command: str, out: Path, runs: list[dict], config: dict, start: float, interrupted: bool) -> int:
    """Write the files of what finished and print one line; the exit status (0, 1 failed, 130 interrupted)."""
    config["seconds"] = round(time.time() - start, 1)
    config["status"] = "interrupted" if interrupted else "finished"
    try:
        report = finish(out, runs, config)
    except KeyboardInterrupt:
        print(f"pgloss {command}: interrupted again while writing the report; metrics.jsonl in {out} is complete "
              "up to the first interruption", file=sys.stderr)
        return 130
    line = _summary_line(command, runs, report, config["seconds"], interrupted)
    print(line, file=sys.stderr if interrupted else sys.stdout)
    if interrupted:
        return 130
    return 1 if any(r["status"] != "finished" for r in runs) else 0


def cmd_train(args) -> int:
    """Train one algorithm (data parallel under torchrun) and write its files."""
    from pgloss.lab import distributed as dist
    from pgloss.lab import trainer

    start = time.time()
    try:
        _import_outputs()
        specs = _specs([args.algorithm], args.loss_arg)
        if len(specs) != 1:
            raise ValueError(f"--algorithm: train runs one algorithm, got {', '.join(s.label for s in specs)} "
                             "(use pgloss compare for several)")
        cfg = config_from_args(args, algorithm=specs[0].label)
        trainer.make_algorithm(cfg)
        rank, world = dist.init(cfg.device)
        out = prepare_out(args.out) if rank == 0 else None
    except (ValueError, TypeError) as err:
        print(f"pgloss train: {err}", file=sys.stderr)
        return 2
    config = {"command": _command_line(), "versions": versions(), "algorithms": [cfg.algorithm], "seeds": [cfg.seed],
              "world_size": world, "base": dataclasses.asdict(cfg), "status": "running"}
    stream = None
    if rank == 0:
        _write_config(out, config)
        stream = _Stream(out / "metrics.jsonl", _progress(cfg.steps + 1, f"train {cfg.algorithm}"))
    records: list[dict] = []

    def on_step(record: dict) -> None:
        records.append(record)
        if stream is not None:
            stream(record)

    result, interrupted = None, False
    try:
        result = trainer.train(cfg, on_step=on_step)
    except KeyboardInterrupt:
        interrupted = True
    except Exception as err:  # noqa: BLE001 (the partial metrics and the traceback are written)
        result = _failure(err, metrics=records)
    finally:
        if stream is not None:
            stream.close()
    status = 0
    if rank == 0:
        status = _conclude("train", out, [_outcome(cfg, result, stream)], config, start, interrupted)
    dist.cleanup()
    return status


def add_commands(subparsers) -> None:
    """Add ``train`` and ``compare`` to the ``pgloss`` command's subparsers."""
    loss_arg = dict(action="append", metavar="KEY=VALUE",
                    help="a loss hyperparameter of pgloss.get for every algorithm of the run, e.g. clip_high=0.28 "
                         "or kl_coef=0 (repeatable; NAME:KEY=VALUE in the algorithm sets one algorithm's)")
    train = subparsers.add_parser("train", help="train a tiny policy with one algorithm (torchrun for data parallel)")
    add_config_arguments(train)
    train.add_argument("--loss-arg", **loss_arg)
    train.add_argument("--out", default="runs/train", help="output directory (default: runs/train)")
    train.set_defaults(func=cmd_train)

    compare = subparsers.add_parser("compare", help="train a tiny policy with each algorithm and compare them")
    compare.add_argument("--algorithms", nargs="+", default=list(DEFAULT_ALGORITHMS), metavar="SPEC",
                         help="pgloss algorithm names, space- or comma-separated, 'all' for every name; "
                              "NAME:KEY=VALUE[,KEY=VALUE] sets that run's loss hyperparameters, so "
                              "'dapo dapo:clip_high=0.3' compares two settings of one loss "
                              f"(default: {' '.join(DEFAULT_ALGORITHMS)})")
    compare.add_argument("--loss-arg", **loss_arg)
    compare.add_argument("--seeds", type=int, default=2, help="seeds 0..K-1 per algorithm (default: 2)")
    compare.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                         help="runs trained at once, one process each (default: min(2, CPUs))")
    compare.add_argument("--out", default="runs/compare", help="output directory (default: runs/compare)")
    add_config_arguments(compare, skip=("algorithm", "seed"))
    compare.set_defaults(func=cmd_compare)
