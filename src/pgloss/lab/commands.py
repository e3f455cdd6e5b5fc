"""``pgloss train`` and ``pgloss compare``: run the lab and write metrics, plots, samples and a report.

``compare`` warm-starts one policy per seed (the one pgloss ships, or one from the cache, or one it
trains: ``lab/warm.py``), then
trains every (algorithm, seed) pair from that seed's warm start, ``--workers`` runs at a time in
separate processes (one torch thread each, so results do not depend on the number of workers).
``train`` runs one algorithm in this process and works under ``torchrun`` (data parallel; rank 0
writes the files).

Both check every argument before any training, never replace an earlier run (``lab/outputs.py``),
show one progress bar (``lab/progress.py``), write ``metrics.jsonl`` as the runs go, keep the other
runs when one fails (exit status 1, its traceback in ``errors.log``), and on Ctrl-C or SIGTERM stop
within seconds, writing the report and plots of the runs that finished (exit status 130). Once the
training is over, a signal no longer stops anything: the report is written in full first
(``runner.Held``; ``lab/finish.py`` writes it). ``pgloss report RUN_DIR`` writes the report and plots
again from what a run saved (``finish.rebuild``).

Every run saves a checkpoint after each step (``lab/checkpoint.py``, in ``OUT/checkpoints``);
``--resume --out OUT`` continues an interrupted run (or comparison) from there, each run from its last
finished step, and gives the metrics and policy of a run never stopped. It refuses other settings than
the run's, naming them (``lab/resume.py``).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
import traceback
from pathlib import Path

from . import warm
from .config import DEFAULT_ALGORITHMS, LabConfig, add_config_arguments, config_from_args
from .finish import conclude, outcome, write_config
from .outputs import claim_directory
from .progress import Progress, step_costs
from .provenance import versions
from .resume import kept_records, resume_folder
from .runner import RL, WARM, Held, Runner, Sink, emit, require_extras, timed_steps
from .spec import add_algorithms_argument, parse_algorithms

LAB_FILES = (
    "metrics.jsonl",
    "config.json",
    "samples.md",
    "report.md",
    "errors.log",
    "checkpoints",
    "policy.safetensors",
    "policies",
    "tensorboard",
    "wandb",
)


def _failure(err: BaseException, **extra) -> dict:
    return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc(), **extra}


def warm_state(cfg: LabConfig, cache: Path | None) -> dict:
    """``{"state": the warm-started policy of cfg.seed}`` (a CPU state dict, from the cache when it
    holds it), or ``{"error": ...}``; each step of a warm start that trains is emitted."""
    try:
        return {
            "state": warm.state(cfg, cache, on_steps=lambda steps, seconds: emit({"warm": steps, "seconds": seconds}))
        }
    except Exception as err:
        return _failure(err)


def run(cfg: LabConfig, start: dict, checkpoint: Path | None = None, policy_file: Path | None = None) -> dict:
    """One RL run from a warm state (``{}`` when `checkpoint` holds the run to continue): ``{"metrics",
    "samples", "state"}``, or ``{"error", "traceback", "metrics"}`` with the records of the steps it made.
    Every new step's record is emitted as it is made; `checkpoint` is saved after each; the final policy
    goes to `policy_file` (safetensors, ``lab/policy.py``)."""
    from . import policy, trainer

    records: list[dict] = []
    if "error" in start:
        return {"error": f"warm start failed: {start['error']}", "traceback": start["traceback"], "metrics": records}
    timed = timed_steps(emit)

    def on_step(record: dict) -> None:
        records.append(record)
        timed(record)

    emit({"started": [cfg.algorithm, cfg.seed]})
    try:
        result = trainer.train(cfg, start.get("state"), on_step=on_step, checkpoint=checkpoint)
        if policy_file is not None:
            policy.save(result["state"], cfg, policy_file)
        return result
    except Exception as err:
        return _failure(err, metrics=records)


def progress(desc: str, cold_warm_starts: int, cfg: LabConfig, runs: int, workers: int, done: int = 0) -> Progress:
    """The command's one bar: the steps of the warm starts to train (not those in the cache), then
    every run's RL steps (and its final measurement), but the `done` steps a resumed run had made."""
    return Progress(
        desc,
        {
            WARM: (cold_warm_starts * cfg.warm_steps, min(workers, cold_warm_starts)),
            RL: (runs * (cfg.steps + 1) - done, min(workers, runs)),
        },
        prior=step_costs(cfg),
    )


def prepare_out(out: str | None, default: str, overwrite: bool) -> Path:
    """The output directory (``lab/outputs.py``: a taken ``--out`` is refused, a taken default
    becomes the next free name beside it, ``--overwrite`` removes the lab's files first)."""
    from .plots import plot_names

    own = [*LAB_FILES, *(f"{n}.png" for n in plot_names(mismatch=True))]
    return claim_directory(out, default, overwrite, own)


def _command_line() -> str:
    return "pgloss " + " ".join(shlex.quote(a) for a in sys.argv[1:])


def cmd_compare(args) -> int:
    """Train every algorithm of ``--algorithms`` for every seed and write the comparison."""
    from . import checkpoint, policy, trackers, trainer

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
        report_to = trackers.check(args.report_to)
        seeds = list(range(args.seeds))
        runs = [dataclasses.replace(base, algorithm=s.label, seed=seed) for s in specs for seed in seeds]
        workers = min(args.workers, len(runs))
        config = {
            "command": _command_line(),
            "versions": versions(),
            "algorithms": [s.label for s in specs],
            "seeds": seeds,
            "workers": workers,
            "base": dataclasses.asdict(base),
            "warm_start": warm.origin([dataclasses.replace(base, seed=s) for s in seeds]),
            "status": "running",
        }
        kept: list[dict] | None = None
        resumable: set[tuple[str, int]] = set()
        if args.resume:
            config = resume_folder(args, "compare", config)
            out = Path(args.out)
            kept, resumable = kept_records(out, runs)
        else:
            out = prepare_out(args.out, "runs/compare", args.overwrite)
    except (ValueError, TypeError) as err:
        print(f"pgloss compare: {err}", file=sys.stderr)
        return 2
    write_config(out, config)
    starts = [
        dataclasses.replace(base, seed=s) for s in seeds if any((cfg.algorithm, s) not in resumable for cfg in runs)
    ]  # a seed with a run to start
    cold = sum(not warm.cached(cfg, cache) for cfg in starts)
    logs = trackers.Trackers(report_to, out, dataclasses.asdict(base), resumed=args.resume) if report_to else None
    sink = Sink(out / "metrics.jsonl", progress("compare", cold, base, len(runs), workers, len(kept or ())), kept, logs)
    runner, interrupted, held = None, False, Held()
    states: dict[int, dict] = {}  # by seed: its warm start (a state or an error)
    results: dict[int, dict] = {}  # by index in runs: what the run returned
    try:
        runner = Runner(workers, sink)
        started: dict[int, dict] = {}  # by index in starts
        runner.map(warm_state, [(cfg, cache) for cfg in starts], started)
        states = {cfg.seed: started[i] for i, cfg in enumerate(starts)}
        runner.map(
            run,
            [
                (
                    cfg,
                    states.get(cfg.seed, {}),
                    checkpoint.path(out, cfg.algorithm, cfg.seed),
                    policy.path(out, cfg.algorithm, cfg.seed, single=False),
                )
                for cfg in runs
            ],
            results,
            on_done=sink.result,
        )
        held.hold()  # every run has ended: from here a signal waits for the report
    except KeyboardInterrupt:
        held.hold()
        interrupted = True
    finally:
        held.hold()
        if runner is not None:
            runner.close(terminate=interrupted)
        sink.close()
    return conclude(
        "compare",
        out,
        [outcome(cfg, results.get(i), sink) for i, cfg in enumerate(runs)],
        config,
        start,
        interrupted,
        held,
    )


def cmd_train(args) -> int:
    """Train one algorithm (data parallel under torchrun) and write its files."""
    from . import checkpoint, policy, trackers, trainer
    from . import distributed as dist

    start = time.time()
    try:
        require_extras()
        specs = parse_algorithms(args.algorithms, loss_args=args.loss_arg or [])
        if len(specs) != 1:
            raise ValueError(
                f"--algorithms: train runs one algorithm, got {', '.join(s.label for s in specs)} "
                "(use pgloss compare for several)"
            )
        cfg = config_from_args(args, algorithm=specs[0].label)
        trainer.make_algorithm(cfg)
        cache = warm.cache_dir(args.warm_cache)
        report_to = trackers.check(args.report_to)
        rank, world = dist.init(cfg.device)
        config = {
            "command": _command_line(),
            "versions": versions(),
            "algorithms": [cfg.algorithm],
            "seeds": [cfg.seed],
            "world_size": world,
            "base": dataclasses.asdict(cfg),
            "warm_start": warm.origin([cfg]),
            "status": "running",
        }
        kept, saved = None, None
        out: Path | None = None  # the run's folder, on rank 0 only (the rank that writes files)
        if args.resume and world > 1:
            raise ValueError(
                "--resume: a run under torchrun keeps no checkpoint (each rank samples with its own "
                "generator); resume a single-process run"
            )
        if args.resume:
            config = {**resume_folder(args, "train", config), "world_size": world}
            out = Path(args.out)
            kept, resumable = kept_records(out, [cfg])
            saved = checkpoint.path(out, cfg.algorithm, cfg.seed) if resumable else None
        elif rank == 0:
            out = prepare_out(args.out, "runs/train", args.overwrite)
    except (ValueError, TypeError) as err:
        print(f"pgloss train: {err}", file=sys.stderr)
        return 2
    sink = Sink(None)
    if out is not None:  # rank 0
        write_config(out, config)
        cold = int(saved is None and not warm.cached(cfg, cache))
        logs = trackers.Trackers(report_to, out, dataclasses.asdict(cfg), resumed=args.resume) if report_to else None
        sink = Sink(
            out / "metrics.jsonl", progress(f"train {cfg.algorithm}", cold, cfg, 1, 1, len(kept or ())), kept, logs
        )
    records: list[dict] = []
    held = Held()

    def on_step(record: dict) -> None:
        if record["step"] == cfg.steps:  # held before the last record is written: a signal that sees it waits
            held.hold()  # the run is made: what remains, its return and its report, is not interrupted
        records.append(record)
        timed(record)

    result, interrupted = None, False
    try:
        state = (
            None
            if saved is not None
            else warm.state(cfg, cache, on_steps=lambda steps, seconds: sink({"warm": steps, "seconds": seconds}))
        )
        timed = timed_steps(sink)  # the first RL step is timed from here, not from before the warm start
        result = trainer.train(
            cfg,
            state,
            on_step=on_step,
            checkpoint=checkpoint.path(out, cfg.algorithm, cfg.seed) if out is not None and world == 1 else None,
        )
        if out is not None:  # rank 0
            policy.save(result["state"], cfg, policy.path(out, cfg.algorithm, cfg.seed, single=True))
    except KeyboardInterrupt:
        held.hold()
        interrupted = True
    except Exception as err:
        result = _failure(err, metrics=records)
    finally:
        held.hold()
        sink.close()
    status = 0
    if out is not None:  # rank 0
        status = conclude("train", out, [outcome(cfg, result, sink)], config, start, interrupted, held)
    held.release()
    dist.cleanup()
    return status


def _add_run_arguments(parser, default_out: str) -> None:
    """The options train and compare share besides LabConfig's: loss settings, output, cache."""
    parser.add_argument(
        "--loss-arg",
        action="append",
        metavar="KEY=VALUE",
        help="a loss hyperparameter of pgloss.get for every algorithm of the run, e.g. clip_high=0.28 "
        "or kl_coef=0 (repeatable; NAME:KEY=VALUE in --algorithms sets one algorithm's)",
    )
    parser.add_argument(
        "--out",
        help=f"output directory (default: {default_out}, or {default_out}-2, ... when "
        "taken); an --out that holds files is refused",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="write over a run in --out, its files kept in --out/replaced (otherwise refused)",
    )
    parser.add_argument(
        "--report-to",
        nargs="+",
        metavar="TRACKER",
        help="also log every step's metrics and the run's settings to tensorboard (OUT/tensorboard), "
        "wandb (offline unless WANDB_MODE says otherwise) or none (default)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the interrupted run in --out from each run's last finished step (the "
        "same settings as it; the result is that of a run never stopped)",
    )
    parser.add_argument(
        "--warm-cache",
        metavar="DIR",
        help="where warm starts are cached, keyed by their settings, torch and the lab's code "
        "(default: $XDG_CACHE_HOME/pgloss/warm or ~/.cache/pgloss/warm; none: no cache)",
    )


def add_commands(subparsers) -> None:
    """Add ``train`` and ``compare`` to the ``pgloss`` command's subparsers."""
    train = subparsers.add_parser("train", help="train a tiny policy with one algorithm (torchrun for data parallel)")
    add_algorithms_argument(train, ("grpo",), "--algorithm", one=True)
    add_config_arguments(train, skip=("algorithm",))
    _add_run_arguments(train, "runs/train")
    train.set_defaults(func=cmd_train)

    compare = subparsers.add_parser("compare", help="train a tiny policy with each algorithm and compare them")
    add_algorithms_argument(compare, DEFAULT_ALGORITHMS)
    compare.add_argument(
        "--seeds",
        type=int,
        default=len(warm.SHIPPED_SEEDS),
        help=f"seeds 0..K-1 per algorithm (default: {len(warm.SHIPPED_SEEDS)}, the seeds whose warm "
        "starts pgloss ships, so every machine starts them from the same weights)",
    )
    compare.add_argument(
        "--workers",
        type=int,
        default=min(2, os.cpu_count() or 1),
        help="runs trained at once, one process each (default: min(2, CPUs))",
    )
    add_config_arguments(compare, skip=("algorithm", "seed"))
    _add_run_arguments(compare, "runs/compare")
    compare.set_defaults(func=cmd_compare)
