"""``pgloss experiment length``: run the length experiment (or resume it) and write its report.

Where it writes follows ``lab/outputs.py``, with one addition: an ``--out`` that holds this same
experiment (the settings in its ``experiment.json``, the number of workers aside) is resumed, its
complete runs kept. Ctrl-C and SIGTERM stop it alike: the report of the complete runs is written,
``experiment.json`` records the status, and the same command resumes.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

# the files and folders an experiment writes into --out (what --overwrite sets aside)
OWN = ("runs", "warm", "experiment.json", "seconds.json", "report.md", "length_reward.png", "length_length.png",
       "length_repetition.png", "length_gradient.png")
UNCOMPARED = ("workers", "status")  # experiment.json entries that do not make another experiment


def _settings(experiment) -> dict:
    """The experiment's settings as its experiment.json holds them (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(experiment)))


def claim_out(out: str | None, default: str, experiment, overwrite: bool) -> Path:
    """The experiment's folder: new, or one that holds this same experiment (resumed); a taken
    default becomes the next free name beside it; a taken --out is refused unless `overwrite`."""
    from ..lab.outputs import beside, refusal, set_aside, taken

    path = Path(default if out is None else out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path}: is a file, not a directory")
    if not taken(path):
        return path
    saved_file = path / "experiment.json"
    saved = json.loads(saved_file.read_text()) if saved_file.exists() else None
    mine = _settings(experiment)
    if saved is not None and {k: v for k, v in saved.items() if k not in UNCOMPARED} == \
            {k: v for k, v in mine.items() if k not in UNCOMPARED}:
        return path  # the same experiment: resumed
    if overwrite:
        set_aside(path, OWN)
        return path
    if out is None:
        return beside(path)
    if saved is None:
        raise ValueError(refusal(path))
    differ = [f"{k} {saved.get(k)!r} there, {mine[k]!r} here" for k in mine
              if k not in UNCOMPARED and saved.get(k) != mine[k]]
    raise ValueError(f"--out {path} holds an experiment with other settings ({'; '.join(differ)}): a run never "
                     "replaces another; give a new --out, or add --overwrite to replace it")


def _save(out: Path, experiment, status: str) -> None:
    (out / "experiment.json").write_text(json.dumps({**_settings(experiment), "status": status}, indent=2) + "\n")


def cmd_experiment(args) -> int:
    """Run (or resume) the experiment in ``--out``, then write report.md and its plots there."""
    from . import length
    from .length_report import write_report
    from .runs import load
    from ..lab.runner import require_extras
    from ..lab.spec import parse_algorithms

    design = length.EXPERIMENTS[args.task]
    base = length.quick(design) if args.quick else design
    overrides = {k: getattr(args, k) for k in ("seeds", "steps", "workers", "entropy_coef") if getattr(args, k) is not None}
    default = "runs/length" + ("" if args.task == "trace" else f"-{args.task}") + ("-quick" if args.quick else "")
    try:  # every argument is checked before any work
        require_extras()
        if args.algorithms is not None:
            overrides["algorithms"] = tuple(spec.label for spec in parse_algorithms(args.algorithms))
        experiment = dataclasses.replace(base, **overrides)
        if args.report_only:
            out = Path(args.out or default)
        else:
            length.check(experiment)
            out = claim_out(args.out, default, experiment, args.overwrite)
    except (ValueError, TypeError) as err:
        print(f"pgloss experiment: {err}", file=sys.stderr)
        return 2
    timing = out / "seconds.json"
    interrupted = False
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        _save(out, experiment, "running")
        start = time.time()
        try:
            length.run(experiment, out)
        except KeyboardInterrupt:
            interrupted = True
        previous = json.loads(timing.read_text())["seconds"] if timing.exists() else 0.0
        timing.write_text(json.dumps({"seconds": round(previous + time.time() - start, 1)}) + "\n")
    runs = load(out)
    total = experiment.seeds * len(experiment.algorithms)
    if not args.report_only:
        _save(out, experiment, "interrupted" if interrupted else "finished")
    if not runs:
        print(f"pgloss experiment: {'interrupted; ' if interrupted else ''}no complete run in {out}", file=sys.stderr)
        return 130 if interrupted else 2
    seconds = json.loads(timing.read_text())["seconds"] if timing.exists() else None
    window = max(1, min(10, (experiment.steps + 1) // 4))
    command = " ".join(["pgloss experiment length", *([f"--task {args.task}"] if args.task != "trace" else []),
                        *(["--quick"] if args.quick else []),
                        *(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if k != "algorithms"),
                        *([f"--algorithms {' '.join(overrides['algorithms'])}"] if args.algorithms else []),
                        f"--out {out}"])
    names = list(experiment.algorithms) + sorted({a for a, _ in runs} - set(experiment.algorithms))
    report = write_report(runs, names, out, command=command, seconds=seconds, window=window, design=design)
    if interrupted:
        print(f"pgloss experiment: interrupted; {len(runs)} of {total} runs complete; report: {report}; "
              "the same command resumes", file=sys.stderr)
        return 130
    print(f"pgloss experiment: {len(runs)} of {total} runs complete; report: {report}")
    return 0


def add_experiment_command(subparsers) -> None:
    """Add ``experiment`` to the ``pgloss`` command's subparsers."""
    from .length import EXPERIMENTS, LengthExperiment
    from ..lab.spec import add_algorithms_argument

    parser = subparsers.add_parser("experiment", help="run an experiment that tests a published claim (length)")
    parser.add_argument("name", choices=["length"], help="length: which losses lengthen responses (docs/experiments.md)")
    parser.add_argument("--quick", action="store_true",
                        help="two seeds, 12 steps: checks that everything runs (minutes, not a result)")
    parser.add_argument("--task", choices=sorted(EXPERIMENTS), default="trace",
                        help="trace: length is the policy's free choice (default); chain: a longer trace raises "
                             "the reward, so responses lengthen (its own algorithms, budget, warm start and entropy bonus)")
    add_algorithms_argument(parser, LengthExperiment().algorithms)
    action = next(a for a in parser._actions if a.dest == "algorithms")
    action.help = action.help[:-1] + f"; --task chain: {' '.join(EXPERIMENTS['chain'].algorithms)})"
    parser.set_defaults(algorithms=None)  # None: the experiment's own (or --quick's) algorithms
    parser.add_argument("--seeds", type=int, help="seeds per algorithm (default: 5; --quick: 2)")
    parser.add_argument("--steps", type=int,
                        help=f"RL steps per run (default: {EXPERIMENTS['trace'].steps}, --task chain "
                             f"{EXPERIMENTS['chain'].steps}; --quick: 12)")
    parser.add_argument("--workers", type=int, help="runs trained at once (default: 2; --task chain 1)")
    parser.add_argument("--entropy-coef", type=float, help="entropy bonus of every algorithm (default: none; "
                                                           f"--task chain {EXPERIMENTS['chain'].entropy_coef})")
    parser.add_argument("--out", help="output folder (default: runs/length, runs/length-quick, runs/length-chain or "
                                      "runs/length-chain-quick; taken by another "
                                      "experiment: the next free name beside it); the same experiment is resumed")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an experiment with other settings in --out, its files kept in --out/replaced")
    parser.add_argument("--report-only", action="store_true", help="only write the report from the runs in --out")
    parser.set_defaults(func=cmd_experiment)
