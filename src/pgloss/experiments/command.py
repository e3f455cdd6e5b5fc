"""``pgloss experiment length``: run the length experiment (or resume it) and write its report."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path


def cmd_experiment(args) -> int:
    """Run (or resume) the experiment in ``--out``, then write report.md and its plots there."""
    from pgloss.experiments import length
    from pgloss.experiments.length_report import write_report

    base = length.QUICK if args.quick else length.LengthExperiment()
    overrides = {k: getattr(args, k) for k in ("seeds", "steps", "workers") if getattr(args, k) is not None}
    if args.algorithms is not None:
        overrides["algorithms"] = tuple(a.strip() for a in args.algorithms.split(",") if a.strip())
    out = Path(args.out or ("runs/length-quick" if args.quick else "runs/length"))
    try:
        experiment = dataclasses.replace(base, **overrides)
        timing = out / "seconds.json"
        if not args.report_only:
            seconds = length.run(experiment, out, log=lambda line: print(line, flush=True))
            previous = json.loads(timing.read_text())["seconds"] if timing.exists() else 0.0
            timing.write_text(json.dumps({"seconds": round(previous + seconds, 1)}) + "\n")
    except (ValueError, TypeError) as err:
        print(f"pgloss experiment: {err}", file=sys.stderr)
        return 2
    runs = length.load(out)
    if not runs:
        print(f"pgloss experiment: no complete run in {out}", file=sys.stderr)
        return 2
    seconds = json.loads(timing.read_text())["seconds"] if timing.exists() else None
    window = max(1, min(10, (experiment.steps + 1) // 4))
    command = " ".join(["pgloss experiment length", *(["--quick"] if args.quick else []),
                        *(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if k != "algorithms"),
                        *([f"--algorithms {args.algorithms}"] if args.algorithms else []), f"--out {out}"])
    names = list(experiment.algorithms) + sorted({a for a, _ in runs} - set(experiment.algorithms))
    report = write_report(runs, names, out, command=command, seconds=seconds, window=window)
    print(f"wrote {report}")
    return 0


def add_experiment_command(subparsers) -> None:
    """Add ``experiment`` to the ``pgloss`` command's subparsers."""
    parser = subparsers.add_parser("experiment", help="run an experiment that tests a published claim (length)")
    parser.add_argument("name", choices=["length"], help="length: which losses lengthen responses (docs/experiments.md)")
    parser.add_argument("--quick", action="store_true",
                        help="two seeds, 12 steps: checks that everything runs (minutes, not a result)")
    parser.add_argument("--algorithms", help="comma-separated algorithm names (default: grpo,bnpo,dapo,dr_grpo,"
                                             "sample_grpo,gspo)")
    parser.add_argument("--seeds", type=int, help="seeds per algorithm (default: 5; --quick: 2)")
    parser.add_argument("--steps", type=int, help="RL steps per run (default: 100; --quick: 12)")
    parser.add_argument("--workers", type=int, help="runs trained at once (default: 2)")
    parser.add_argument("--out", help="output folder (default: runs/length, or runs/length-quick)")
    parser.add_argument("--report-only", action="store_true", help="only write the report from the runs in --out")
    parser.set_defaults(func=cmd_experiment)
