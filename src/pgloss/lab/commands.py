"""``pgloss train`` and ``pgloss compare``: run the lab and write metrics, plots, samples and a report.

``compare`` warm-starts one policy per seed (or loads it from the cache, ``lab/warm.py``), then
trains every (algorithm, seed) pair from that seed's warm start, ``--workers`` runs at a time in
separate processes (one torch thread each, so results do not depend on the number of workers).
``train`` runs one algorithm in this process and works under ``torchrun`` (data parallel; rank 0
writes the files).

Both check every argument before any training, never replace an earlier run (``lab/outputs.py``),
show one progress bar (``lab/progress.py``), write ``metrics.jsonl`` as the runs go, keep the other
runs when one fails (exit status 1, its traceback in ``errors.log``), and on Ctrl-C or SIGTERM stop
within seconds, writing the report and plots of the runs that finished (exit status 130).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shlex
import subprocess
import sys
import time
import traceback
from pathlib import Path

from .config import DEFAULT_ALGORITHMS, LabConfig, add_config_arguments, config_from_args, mismatched
from .outputs import claim_directory
from .progress import Progress
from .runner import RL, WARM, Runner, Sink, emit, require_extras, timed_steps
from .spec import add_algorithms_argument, parse_algorithms

LAB_FILES = ("metrics.jsonl", "config.json", "samples.md", "report.md", "errors.log")


def _failure(err: BaseException, **extra) -> dict:
    return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(), **extra}


def warm_state(cfg: LabConfig, cache: Path | None) -> dict:
    """``{"state": the warm-started policy of cfg.seed}`` (a CPU state dict, from the cache when it
    holds it), or ``{"error": ...}``; each step of a warm start that trains is emitted."""
    from . import warm

    try:
        return {"state": warm.state(cfg, cache, on_steps=lambda steps, seconds: emit({"warm": steps,
                                                                                      "seconds": seconds}))}
    except Exception as err:  # noqa: BLE001 (reported per run, the other seeds go on)
        return _failure(err)


def run(cfg: LabConfig, warm: dict) -> dict:
    """One RL run from a warm state: ``{"metrics", "samples"}``, or ``{"error", "traceback", "metrics"}``
    with the records of the steps it made. Every step's record is emitted as it is made."""
    from . import trainer

    records: list[dict] = []
    if "error" in warm:
        return {"error": f"warm start failed: {warm['error']}", "traceback": warm["traceback"], "metrics": records}
    timed = timed_steps(emit)

    def on_step(record: dict) -> None:
        records.append(record)
        timed(record)

    emit({"started": [cfg.algorithm, cfg.seed]})
    try:
        return trainer.train(cfg, warm["state"], on_step=on_step)
    except Exception as err:  # noqa: BLE001 (one algorithm failing does not lose the others)
        return _failure(err, metrics=records)


def progress(desc: str, cold_warm_starts: int, cfg: LabConfig, runs: int, workers: int) -> Progress:
    """The command's one bar: the steps of the warm starts to train (not those in the cache), then
    every run's RL steps (and its final measurement)."""
    return Progress(desc, {WARM: (cold_warm_starts * cfg.warm_steps, min(workers, cold_warm_starts)),
                           RL: (runs * (cfg.steps + 1), min(workers, runs))})


def prepare_out(out: str | None, default: str, overwrite: bool) -> Path:
    """The output directory (``lab/outputs.py``: a taken ``--out`` is refused, a taken default
    becomes the next free name beside it, ``--overwrite`` removes the lab's files first)."""
    from .plots import plot_names

    own = [*LAB_FILES, *(f"{n}.png" for n in plot_names(mismatch=True))]
    return claim_directory(out, default, overwrite, own)


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


TITLES = {"compare": "comparison", "train": "training run"}


def finish(out: Path, runs: list[dict], config: dict, command: str = "compare") -> Path:
    """samples.md, PNG plots of the finished runs, errors.log, config.json and report.md; returns the report."""
    from .plots import plot_all
    from .report import write_report, write_samples

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
    return write_report(out, runs, config, plots, title=TITLES[command])


def _outcome(cfg: LabConfig, result: dict | None, sink: Sink) -> dict:
    """A run's status (finished, failed, interrupted, not started) with what it produced; ``steps_done``
    counts the steps whose record was written (at most ``cfg.steps``: the last record measures the final policy)."""
    if result is None:
        steps = min(sink.steps_done(cfg.algorithm, cfg.seed), cfg.steps)
        started = steps or (cfg.algorithm, cfg.seed) in sink.started
        return {"algorithm": cfg.algorithm, "seed": cfg.seed, "status": "interrupted" if started else "not started",
                "steps_done": steps, "error": None, "metrics": [], "samples": {}}
    status = "failed" if "error" in result else "finished"
    return {"algorithm": cfg.algorithm, "seed": cfg.seed, "status": status, "steps_done": min(len(result["metrics"]), cfg.steps),
            "error": result.get("error"), "traceback": result.get("traceback"), "metrics": result["metrics"],
            "samples": result.get("samples", {})}


def _command_line() -> str:
    return "pgloss " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def _summary_line(command: str, runs: list[dict], report: Path, seconds: float, interrupted: bool) -> str:
    done = sum(r["status"] == "finished" for r in runs)
    failed = [f"{r['algorithm']} seed {r['seed']}" for r in runs if r["status"] == "failed"]
    text = f"pgloss {command}: " + ("interrupted; " if interrupted else "")
    text += f"{done} of {len(runs)} runs finished in {seconds:.0f} s; report: {report}"
    if failed:
        text += f"; failed: {', '.join(failed)} (see errors.log)"
    return text


def cmd_compare(args) -> int:
    """Train every algorithm of ``--algorithms`` for every seed and write the comparison."""
    from . import trainer, warm

    start = time.time()
    try:  # every argument is checked before any training
        require_extras()
        base = config_from_args(args)
        if args.seeds < 1:
            raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        specs = parse_algorithms(args.algorithms, loss_args=args.loss_arg or [])
        for spec in specs:
            trainer.make_algorithm(dataclasses.replace(base, algorithm=spec.label))
        cache = warm.cache_dir(args.warm_cache)
        out = prepare_out(args.out, "runs/compare", args.overwrite)
    except (ValueError, TypeError) as err:
        print(f"pgloss compare: {err}", file=sys.stderr)
        return 2
    seeds = list(range(args.seeds))
    runs = [dataclasses.replace(base, algorithm=s.label, seed=seed) for s in specs for seed in seeds]
    workers = min(args.workers, len(runs))
    config = {"command": _command_line(), "versions": versions(), "algorithms": [s.label for s in specs],
              "seeds": seeds, "workers": workers, "base": dataclasses.asdict(base), "status": "running"}
    _write_config(out, config)
    starts = [dataclasses.replace(base, seed=s) for s in seeds]
    cold = sum(not warm.cached(cfg, cache) for cfg in starts)
    sink = Sink(out / "metrics.jsonl", progress("compare", cold, base, len(runs), workers))
    runner, states, results, interrupted = None, {}, {}, False
    try:
        runner = Runner(workers, sink)
        runner.map(warm_state, [(cfg, cache) for cfg in starts], states)
        runner.map(run, [(cfg, states[cfg.seed]) for cfg in runs], results, on_done=sink.result)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        if runner is not None:
            runner.close(terminate=interrupted)
        sink.close()
    return _conclude("compare", out, [_outcome(cfg, results.get(i), sink) for i, cfg in enumerate(runs)],
                     config, start, interrupted)


def _conclude(command: str, out: Path, runs: list[dict], config: dict, start: float, interrupted: bool) -> int:
    """Write the files of what finished and print one line; the exit status (0, 1 failed, 130 interrupted)."""
    config["seconds"] = round(time.time() - start, 1)
    config["status"] = "interrupted" if interrupted else "finished"
    try:
        report = finish(out, runs, config, command)
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
    from . import distributed as dist
    from . import trainer, warm

    start = time.time()
    try:
        require_extras()
        specs = parse_algorithms(args.algorithms, loss_args=args.loss_arg or [])
        if len(specs) != 1:
            raise ValueError(f"--algorithms: train runs one algorithm, got {', '.join(s.label for s in specs)} "
                             "(use pgloss compare for several)")
        cfg = config_from_args(args, algorithm=specs[0].label)
        trainer.make_algorithm(cfg)
        cache = warm.cache_dir(args.warm_cache)
        rank, world = dist.init(cfg.device)
        out = prepare_out(args.out, "runs/train", args.overwrite) if rank == 0 else None
    except (ValueError, TypeError) as err:
        print(f"pgloss train: {err}", file=sys.stderr)
        return 2
    config = {"command": _command_line(), "versions": versions(), "algorithms": [cfg.algorithm], "seeds": [cfg.seed],
              "world_size": world, "base": dataclasses.asdict(cfg), "status": "running"}
    sink = Sink(None)
    if rank == 0:
        _write_config(out, config)
        sink = Sink(out / "metrics.jsonl", progress(f"train {cfg.algorithm}", int(not warm.cached(cfg, cache)), cfg,
                                                     1, 1))
    records: list[dict] = []
    timed = timed_steps(sink)

    def on_step(record: dict) -> None:
        records.append(record)
        timed(record)

    result, interrupted = None, False
    try:
        state = warm.state(cfg, cache, on_steps=lambda steps, seconds: sink({"warm": steps, "seconds": seconds}))
        result = trainer.train(cfg, state, on_step=on_step)
    except KeyboardInterrupt:
        interrupted = True
    except Exception as err:  # noqa: BLE001 (the partial metrics and the traceback are written)
        result = _failure(err, metrics=records)
    finally:
        sink.close()
    status = 0
    if rank == 0:
        status = _conclude("train", out, [_outcome(cfg, result, sink)], config, start, interrupted)
    dist.cleanup()
    return status


def _add_run_arguments(parser, default_out: str) -> None:
    """The options train and compare share besides LabConfig's: loss settings, output, cache."""
    parser.add_argument("--loss-arg", action="append", metavar="KEY=VALUE",
                        help="a loss hyperparameter of pgloss.get for every algorithm of the run, e.g. clip_high=0.28 "
                             "or kl_coef=0 (repeatable; NAME:KEY=VALUE in --algorithms sets one algorithm's)")
    parser.add_argument("--out", help=f"output directory (default: {default_out}, or {default_out}-2, ... when "
                                      "taken); an --out that holds files is refused")
    parser.add_argument("--overwrite", action="store_true",
                        help="write over a run in --out, its files kept in --out/replaced (otherwise refused)")
    parser.add_argument("--warm-cache", metavar="DIR",
                        help="where warm starts are cached, keyed by their settings, torch and the lab's code "
                             "(default: $XDG_CACHE_HOME/pgloss/warm or ~/.cache/pgloss/warm; none: no cache)")


def add_commands(subparsers) -> None:
    """Add ``train`` and ``compare`` to the ``pgloss`` command's subparsers."""
    train = subparsers.add_parser("train", help="train a tiny policy with one algorithm (torchrun for data parallel)")
    add_algorithms_argument(train, ("grpo",), "--algorithm", one=True)
    add_config_arguments(train, skip=("algorithm",))
    _add_run_arguments(train, "runs/train")
    train.set_defaults(func=cmd_train)

    compare = subparsers.add_parser("compare", help="train a tiny policy with each algorithm and compare them")
    add_algorithms_argument(compare, DEFAULT_ALGORITHMS)
    compare.add_argument("--seeds", type=int, default=2, help="seeds 0..K-1 per algorithm (default: 2)")
    compare.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1),
                         help="runs trained at once, one process each (default: min(2, CPUs))")
    add_config_arguments(compare, skip=("algorithm", "seed"))
    _add_run_arguments(compare, "runs/compare")
    compare.set_defaults(func=cmd_compare)
