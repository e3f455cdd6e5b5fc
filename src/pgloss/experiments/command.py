"""``pgloss experiment NAME``: run an experiment (length, distill) or resume it, and write its report.

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
from dataclasses import dataclass
from pathlib import Path

UNCOMPARED = ("workers", "status")  # experiment.json entries that do not make another experiment


def _settings(experiment) -> dict:
    """The experiment's settings as its experiment.json holds them (tuples as lists)."""
    return json.loads(json.dumps(dataclasses.asdict(experiment)))


def claim_out(out: str | None, default: str, experiment, overwrite: bool, own: tuple[str, ...] = ()) -> Path:
    """The experiment's folder: new, or one that holds this same experiment (resumed); a taken
    default becomes the next free name beside it; a taken --out is refused unless `overwrite`, which
    sets the experiment's files and folders `own` aside in ``--out/replaced``."""
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
        set_aside(path, own)
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


@dataclass(frozen=True)
class Plan:
    """One invocation of an experiment, before any work: what to run, where, and how to report it."""

    experiment: object
    module: object
    """The experiment's module: ``check(experiment)``, ``run(experiment, out)``."""
    default_out: str
    own: tuple[str, ...]
    """The files and folders it writes into --out (what --overwrite sets aside)."""
    command: list[str]
    """The command line that reproduces it, without --out."""
    report: object
    """``report(runs, out, command=..., seconds=...)`` writes report.md and returns its path."""
    total: int
    """The runs it makes when complete."""


def _given(args, names) -> dict:
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def _refuse_others(args, allowed: set[str]) -> None:
    """--options of the other experiment are refused, not ignored."""
    for name in ("task", "algorithms", "entropy_coef", "students", "teacher_steps", "teacher_d_model"):
        if name not in allowed and getattr(args, name, None) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is an option of another experiment, not of {args.name}")


def length_plan(args) -> Plan:
    from . import length
    from .length_report import write_report
    from ..lab.spec import parse_algorithms

    _refuse_others(args, {"task", "algorithms", "entropy_coef"})
    task = args.task or "trace"
    design = length.EXPERIMENTS[task]
    overrides = _given(args, ("seeds", "steps", "workers", "entropy_coef"))
    if args.algorithms is not None:
        overrides["algorithms"] = tuple(spec.label for spec in parse_algorithms(args.algorithms))
    experiment = dataclasses.replace(length.quick(design) if args.quick else design, **overrides)
    command = ["pgloss experiment length", *([f"--task {task}"] if task != "trace" else []),
               *(["--quick"] if args.quick else []),
               *(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if k != "algorithms"),
               *([f"--algorithms {' '.join(overrides['algorithms'])}"] if args.algorithms else [])]
    window = max(1, min(10, (experiment.steps + 1) // 4))

    def report(runs, out, *, command, seconds):
        names = list(experiment.algorithms) + sorted({a for a, _ in runs} - set(experiment.algorithms))
        return write_report(runs, names, out, command=command, seconds=seconds, window=window, design=design)

    return Plan(experiment, length, "runs/length" + ("" if task == "trace" else f"-{task}") + ("-quick" if args.quick else ""),
                length.OWN, command, report, experiment.seeds * len(experiment.algorithms))


def distill_plan(args) -> Plan:
    from . import distill
    from .claims import scale_caveat
    from .distill_report import write_report

    _refuse_others(args, {"students", "teacher_steps", "teacher_d_model"})
    overrides = _given(args, ("seeds", "steps", "teacher_steps", "teacher_d_model", "workers"))
    if args.students is not None:
        overrides["students"] = tuple(args.students)
    experiment = dataclasses.replace(distill.quick(distill.DESIGN) if args.quick else distill.DESIGN, **overrides)
    command = ["pgloss experiment distill", *(["--quick"] if args.quick else []),
               *(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if k != "students"),
               *([f"--students {' '.join(overrides['students'])}"] if args.students else [])]
    window = max(1, min(5, (experiment.steps + 1) // 4))

    def report(runs, out, *, command, seconds):
        labels = list(experiment.students) + sorted({a for a, _ in runs} - set(experiment.students) - {distill.TEACHER})
        caveat = scale_caveat({k: v for k, v in runs.items() if k[0] != distill.TEACHER}, distill.DESIGN)
        teacher = (f"GRPO from a warm start of its own, {experiment.teacher_d_model} wide (the students "
                   f"{experiment.d_model})" if experiment.teacher_d_model else "GRPO from the same warm start")
        return write_report(runs, labels, out, command=command, seconds=seconds, window=window, caveat=caveat,
                            teacher=teacher)

    return Plan(experiment, distill, "runs/distill" + (f"-teacher{experiment.teacher_d_model}"
                                                       if experiment.teacher_d_model else "") + ("-quick" if args.quick else ""),
                distill.OWN, command, report, experiment.seeds * (1 + len(experiment.students)))


PLANS = {"length": length_plan, "distill": distill_plan}


def cmd_experiment(args) -> int:
    """Run (or resume) the experiment in ``--out``, then write report.md and its plots there."""
    from .runs import load
    from ..lab.runner import require_extras

    try:  # every argument is checked before any work
        require_extras()
        plan = PLANS[args.name](args)
        if args.report_only:
            out = Path(args.out or plan.default_out)
        else:
            plan.module.check(plan.experiment)
            out = claim_out(args.out, plan.default_out, plan.experiment, args.overwrite, plan.own)
    except (ValueError, TypeError) as err:
        print(f"pgloss experiment: {err}", file=sys.stderr)
        return 2
    timing = out / "seconds.json"
    interrupted = False
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        _save(out, plan.experiment, "running")
        start = time.time()
        try:
            plan.module.run(plan.experiment, out)
        except KeyboardInterrupt:
            interrupted = True
        previous = json.loads(timing.read_text())["seconds"] if timing.exists() else 0.0
        timing.write_text(json.dumps({"seconds": round(previous + time.time() - start, 1)}) + "\n")
    runs = load(out)
    if not args.report_only:
        _save(out, plan.experiment, "interrupted" if interrupted else "finished")
    if not runs:
        print(f"pgloss experiment: {'interrupted; ' if interrupted else ''}no complete run in {out}", file=sys.stderr)
        return 130 if interrupted else 2
    seconds = json.loads(timing.read_text())["seconds"] if timing.exists() else None
    report = plan.report(runs, out, command=" ".join([*plan.command, f"--out {out}"]), seconds=seconds)
    if interrupted:
        print(f"pgloss experiment: interrupted; {len(runs)} of {plan.total} runs complete; report: {report}; "
              "the same command resumes", file=sys.stderr)
        return 130
    print(f"pgloss experiment: {len(runs)} of {plan.total} runs complete; report: {report}")
    return 0


def add_experiment_command(subparsers) -> None:
    """Add ``experiment`` to the ``pgloss`` command's subparsers."""
    from .distill import STUDENTS, DistillExperiment
    from .length import EXPERIMENTS, LengthExperiment
    from ..lab.spec import add_algorithms_argument

    distill = DistillExperiment()  # the defaults the help states
    parser = subparsers.add_parser("experiment", help="run an experiment that tests a published claim (length, distill)")
    parser.add_argument("name", choices=sorted(PLANS),
                        help="length: which losses lengthen responses; distill: does on-policy distillation reach its "
                             "teacher faster than RL (docs/experiments.md)")
    parser.add_argument("--quick", action="store_true",
                        help="two seeds and a few steps: checks that everything runs (minutes, not a result)")
    parser.add_argument("--task", choices=sorted(EXPERIMENTS), default=None,
                        help="length only. trace: length is the policy's free choice (default); chain: a longer trace "
                             "raises the reward, so responses lengthen (its own algorithms, budget, warm start and "
                             "entropy bonus)")
    add_algorithms_argument(parser, LengthExperiment().algorithms)
    action = next(a for a in parser._actions if a.dest == "algorithms")
    action.help = "length only. " + action.help[:-1] + f"; --task chain: {' '.join(EXPERIMENTS['chain'].algorithms)})"
    parser.set_defaults(algorithms=None)  # None: the experiment's own (or --quick's) algorithms
    parser.add_argument("--students", nargs="+", choices=list(STUDENTS),
                        help=f"distill only. the students trained against each teacher (default: "
                             f"{' '.join(distill.students)}): grpo on the task's reward, opd on the teacher's advantage "
                             "alone, opd+reward on both, iw_opd with IW-OPD's position weights")
    parser.add_argument("--teacher-steps", type=int,
                        help=f"distill only. GRPO steps that make each teacher (default: {distill.teacher_steps}; "
                             "--quick: 12)")
    parser.add_argument("--teacher-d-model", type=int,
                        help=f"distill only. width of each teacher, a larger model than the students' "
                             f"({distill.d_model}) from a warm start of its own (default: the students' width)")
    parser.add_argument("--seeds", type=int, help=f"seeds (default: length 5, distill {distill.seeds}; --quick: 2)")
    parser.add_argument("--steps", type=int,
                        help=f"RL steps per run (default: length {EXPERIMENTS['trace'].steps}, --task chain "
                             f"{EXPERIMENTS['chain'].steps}; distill {distill.steps} per student; --quick: 12, distill 8)")
    parser.add_argument("--workers", type=int, help="runs trained at once (default: 2; length --task chain 1)")
    parser.add_argument("--entropy-coef", type=float, help="length only. entropy bonus of every algorithm (default: "
                                                           f"none; --task chain {EXPERIMENTS['chain'].entropy_coef})")
    parser.add_argument("--out", help="output folder (default: runs/NAME, with -TASK for length's chain and -quick for "
                                      "--quick; taken by another experiment: the next free name beside it); the same "
                                      "experiment is resumed")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an experiment with other settings in --out, its files kept in --out/replaced")
    parser.add_argument("--report-only", action="store_true", help="only write the report from the runs in --out")
    parser.set_defaults(func=cmd_experiment)
