"""``pgloss experiment NAME``: run an experiment (length, distill) or resume it, and write its report.

Where it writes follows ``lab/outputs.py``, with one addition: an ``--out`` that holds this same
experiment (the settings in its ``experiment.json``, the number of workers aside) is resumed, its
complete runs kept. Ctrl-C and SIGTERM stop it alike: the report of the complete runs is written,
``experiment.json`` records the status (and the command), and the same command resumes; a signal that
comes once the training is over waits for the report.

``pgloss report RUN_DIR`` writes the report and plots of any run again from what it saved: a
``train`` or ``compare`` folder (``lab.finish.rebuild``) or an experiment's (``rebuild_experiment``).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

UNCOMPARED = ("workers", "status", "command")  # experiment.json entries that do not make another experiment


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
    if saved is not None:  # a setting added since the experiment was saved holds its default there
        saved = {**_settings(type(experiment)()), **saved}
    if saved is not None and {k: v for k, v in saved.items() if k not in UNCOMPARED} == {
        k: v for k, v in mine.items() if k not in UNCOMPARED
    }:
        return path  # the same experiment: resumed
    if overwrite:
        set_aside(path, own)
        return path
    if out is None:
        return beside(path)
    if saved is None:
        raise ValueError(refusal(path))
    differ = [
        f"{k} {saved.get(k)!r} there, {mine[k]!r} here" for k in mine if k not in UNCOMPARED and saved.get(k) != mine[k]
    ]
    raise ValueError(
        f"--out {path} holds an experiment with other settings ({'; '.join(differ)}): a run never "
        "replaces another; give a new --out, or add --overwrite to replace it"
    )


def _save(out: Path, experiment, status: str, command: str) -> None:
    (out / "experiment.json").write_text(
        json.dumps({**_settings(experiment), "status": status, "command": command}, indent=2) + "\n"
    )


class ExperimentModule(Protocol):
    """What an experiment's module (``experiments/length.py``, ``experiments/distill.py``) offers a `Plan`."""

    def check(self, experiment: Any, /) -> None:
        """Refuse (ValueError/TypeError) an experiment the lab cannot run, before any work."""

    def run(self, experiment: Any, out: Path, /) -> float:
        """Train every run of `experiment` not yet complete in `out`; the seconds taken."""


class WriteReport(Protocol):
    """A plan's report: writes report.md (and its plots) of `runs` into `out`, returns its path."""

    def __call__(
        self, runs: dict[tuple[str, int], list[dict]], out: Path, *, command: str, seconds: float | None
    ) -> Path: ...


@dataclass(frozen=True)
class Plan:
    """One invocation of an experiment, before any work: what to run, where, and how to report it."""

    experiment: Any
    """The experiment's settings (a ``LengthExperiment`` or a ``DistillExperiment``), read by `module`."""
    module: ExperimentModule
    default_out: str
    own: tuple[str, ...]
    """The files and folders it writes into --out (what --overwrite sets aside)."""
    command: list[str]
    """The command line that reproduces it, without --out."""
    report: WriteReport
    total: int
    """The runs it makes when complete."""


def _given(args, names) -> dict:
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def _refuse_others(args, allowed: set[str]) -> None:
    """--options of the other experiment are refused, not ignored."""
    for name in (
        "task",
        "algorithms",
        "entropy_coef",
        "target_entropy",
        "students",
        "teacher_steps",
        "teacher_d_model",
    ):
        if name not in allowed and getattr(args, name, None) is not None:
            raise ValueError(f"--{name.replace('_', '-')} is an option of another experiment, not of {args.name}")


def length_plan(args) -> Plan:
    from ..lab.spec import parse_algorithms
    from . import length

    _refuse_others(args, {"task", "algorithms", "entropy_coef", "target_entropy"})
    task = args.task or "trace"
    design = length.EXPERIMENTS[task]
    overrides = _given(args, ("seeds", "steps", "workers", "entropy_coef", "target_entropy"))
    if args.algorithms is not None:
        overrides["algorithms"] = tuple(spec.label for spec in parse_algorithms(args.algorithms))
    experiment = dataclasses.replace(length.quick(design) if args.quick else design, **overrides)
    command = [
        "pgloss experiment length",
        *([f"--task {task}"] if task != "trace" else []),
        *(["--quick"] if args.quick else []),
        *(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if k != "algorithms"),
        *([f"--algorithms {' '.join(overrides['algorithms'])}"] if args.algorithms else []),
    ]
    return _length_plan(
        experiment, command, "runs/length" + ("" if task == "trace" else f"-{task}") + ("-quick" if args.quick else "")
    )


def _length_plan(experiment, command: list[str], default_out: str) -> Plan:
    from . import length
    from .length_report import write_report

    design = length.EXPERIMENTS[experiment.task]
    window = max(1, min(10, (experiment.steps + 1) // 4))

    def report(runs: dict[tuple[str, int], list[dict]], out: Path, *, command: str, seconds: float | None) -> Path:
        names = list(experiment.algorithms) + sorted({a for a, _ in runs} - set(experiment.algorithms))
        return write_report(runs, names, out, command=command, seconds=seconds, window=window, design=design)

    return Plan(
        experiment, length, default_out, length.OWN, command, report, experiment.seeds * len(experiment.algorithms)
    )


def distill_plan(args) -> Plan:
    from . import distill

    _refuse_others(args, {"students", "teacher_steps", "teacher_d_model"})
    overrides = _given(args, ("seeds", "steps", "teacher_steps", "teacher_d_model", "workers"))
    if args.students is not None:
        overrides["students"] = tuple(args.students)
    experiment = dataclasses.replace(distill.quick(distill.DESIGN) if args.quick else distill.DESIGN, **overrides)
    command = [
        "pgloss experiment distill",
        *(["--quick"] if args.quick else []),
        *(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items() if k != "students"),
        *([f"--students {' '.join(overrides['students'])}"] if args.students else []),
    ]
    return _distill_plan(
        experiment,
        command,
        "runs/distill"
        + (f"-teacher{experiment.teacher_d_model}" if experiment.teacher_d_model else "")
        + ("-quick" if args.quick else ""),
    )


def _distill_plan(experiment, command: list[str], default_out: str) -> Plan:
    from . import distill
    from .claims import scale_caveat
    from .distill_report import write_report

    window = max(1, min(5, (experiment.steps + 1) // 4))

    def report(runs: dict[tuple[str, int], list[dict]], out: Path, *, command: str, seconds: float | None) -> Path:
        labels = list(experiment.students) + sorted({a for a, _ in runs} - set(experiment.students) - {distill.TEACHER})
        caveat = scale_caveat({k: v for k, v in runs.items() if k[0] != distill.TEACHER}, distill.DESIGN)
        teacher = (
            f"GRPO from a warm start of its own, {experiment.teacher_d_model} wide (the students {experiment.d_model})"
            if experiment.teacher_d_model
            else "GRPO from the same warm start"
        )
        return write_report(
            runs, labels, out, command=command, seconds=seconds, window=window, caveat=caveat, teacher=teacher
        )

    return Plan(
        experiment,
        distill,
        default_out,
        distill.OWN,
        command,
        report,
        experiment.seeds * (1 + len(experiment.students)),
    )


PLANS = {"length": length_plan, "distill": distill_plan}


def _saved_plan(out: Path) -> tuple[Plan, str]:
    """The plan of the experiment saved in ``out/experiment.json`` and the command recorded there;
    ValueError when there is none."""
    from . import distill, length

    try:
        saved = json.loads((out / "experiment.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"{out}: no experiment.json of a pgloss experiment there ({err})") from None
    kind, cls, build = (
        ("distill", distill.DistillExperiment, _distill_plan)
        if "students" in saved
        else ("length", length.LengthExperiment, _length_plan)
    )
    fields = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items() if k in fields}
    experiment = cls(**values)  # JSON's values, checked by the experiment's own check before any work
    command = saved.get("command") or f"pgloss experiment {kind} --out {out} (the settings of experiment.json)"
    return build(experiment, [], str(out)), command


def rebuild_experiment(out: Path) -> Path:
    """Write the report and plots of the experiment in `out` again from its complete runs (``out/runs``);
    an earlier report and plots are kept in ``out/replaced`` first. ValueError when there is none."""
    from ..lab.outputs import set_aside
    from .runs import load

    plan, command = _saved_plan(out)
    runs = load(out)
    if not runs:
        raise ValueError(f"{out}: no complete run of the experiment in {out / 'runs'}")
    set_aside(out, [name for name in plan.own if name.endswith((".md", ".png"))], why="pgloss report")
    seconds_file = out / "seconds.json"
    seconds = json.loads(seconds_file.read_text())["seconds"] if seconds_file.exists() else None
    return plan.report(runs, out, command=command, seconds=seconds)


def cmd_report(args) -> int:
    """``pgloss report RUN_DIR``: the report and plots of a train, compare or experiment folder, again."""
    from ..lab.finish import rebuild
    from ..lab.runner import Held, require_extras

    out = Path(args.run_dir)
    try:
        require_extras()
        if not out.is_dir():
            raise ValueError(f"RUN_DIR {out}: not a directory")
        with Held():  # a signal waits for the report: it is never left half written
            report = rebuild_experiment(out) if (out / "experiment.json").exists() else rebuild(out)
    except (ValueError, TypeError) as err:
        print(f"pgloss report: {err}", file=sys.stderr)
        return 2
    print(f"pgloss report: {report}")
    return 0


def add_report_command(subparsers) -> None:
    """Add ``report`` to the ``pgloss`` command's subparsers."""
    parser = subparsers.add_parser("report", help="write the report and plots of a run folder again from what it saved")
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        help="the --out of a pgloss train, compare or experiment run (an earlier report.md and plots "
        "there are kept in RUN_DIR/replaced)",
    )
    parser.set_defaults(func=cmd_report)


def cmd_experiment(args) -> int:
    """Run (or resume) the experiment in ``--out``, then write report.md and its plots there."""
    from ..lab.runner import Held, require_extras
    from .runs import load

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
    interrupted, held = False, Held()
    command = " ".join([*plan.command, f"--out {out}"])
    if not args.report_only:
        out.mkdir(parents=True, exist_ok=True)
        _save(out, plan.experiment, "running", command)
        start = time.time()
        try:
            plan.module.run(plan.experiment, out)
            held.hold()  # the training is over: a signal waits for the report
        except KeyboardInterrupt:
            held.hold()
            interrupted = True
        previous = json.loads(timing.read_text())["seconds"] if timing.exists() else 0.0
        timing.write_text(json.dumps({"seconds": round(previous + time.time() - start, 1)}) + "\n")
    with held:
        runs = load(out)
        if not args.report_only:
            _save(out, plan.experiment, "interrupted" if interrupted else "finished", command)
        if not runs:
            print(
                f"pgloss experiment: {'interrupted; ' if interrupted else ''}no complete run in {out}", file=sys.stderr
            )
            return 130 if interrupted else 2
        seconds = json.loads(timing.read_text())["seconds"] if timing.exists() else None
        report = plan.report(runs, out, command=command, seconds=seconds)
    interrupted = interrupted or bool(held.received)
    if interrupted:
        print(
            f"pgloss experiment: interrupted; {len(runs)} of {plan.total} runs complete; report: {report}; "
            "the same command resumes",
            file=sys.stderr,
        )
        return 130
    print(f"pgloss experiment: {len(runs)} of {plan.total} runs complete; report: {report}")
    return 0


def add_experiment_command(subparsers) -> None:
    """Add ``experiment`` to the ``pgloss`` command's subparsers."""
    from ..lab.spec import add_algorithms_argument
    from .distill import STUDENTS, DistillExperiment
    from .length import EXPERIMENTS, LengthExperiment

    distill = DistillExperiment()  # the defaults the help states
    parser = subparsers.add_parser(
        "experiment", help="run an experiment that tests a published claim (length, distill)"
    )
    parser.add_argument(
        "name",
        choices=sorted(PLANS),
        help="length: which losses lengthen responses; distill: does on-policy distillation reach its "
        "teacher faster than RL (docs/experiments.md)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="two seeds and a few steps: checks that everything runs (minutes, not a result)",
    )
    parser.add_argument(
        "--task",
        choices=sorted(EXPERIMENTS),
        default=None,
        help="length only. trace: length is the policy's free choice (default); chain: a longer trace "
        "raises the reward, so responses lengthen (its own algorithms, budget, warm start and "
        "entropy bonus); ladder: each further step of work solves longer chains, so responses "
        "keep lengthening (its own algorithms, 8 seeds, 200 steps, the entropy steered to a target)",
    )
    add_algorithms_argument(parser, LengthExperiment().algorithms)
    action = next(a for a in parser._actions if a.dest == "algorithms")
    action.help = (
        "length only. " + action.help[:-1] + f"; --task chain: {' '.join(EXPERIMENTS['chain'].algorithms)}"
        f"; --task ladder: {' '.join(EXPERIMENTS['ladder'].algorithms)})"
    )
    parser.set_defaults(algorithms=None)  # None: the experiment's own (or --quick's) algorithms
    parser.add_argument(
        "--students",
        nargs="+",
        choices=list(STUDENTS),
        help=f"distill only. the students trained against each teacher (default: "
        f"{' '.join(distill.students)}): grpo on the task's reward, opd on the teacher's advantage "
        "alone, opd+reward on both, iw_opd with IW-OPD's position weights",
    )
    parser.add_argument(
        "--teacher-steps",
        type=int,
        help=f"distill only. GRPO steps that make each teacher (default: {distill.teacher_steps}; --quick: 12)",
    )
    parser.add_argument(
        "--teacher-d-model",
        type=int,
        help=f"distill only. width of each teacher, a larger model than the students' "
        f"({distill.d_model}) from a warm start of its own (default: the students' width)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        help=f"seeds (default: length 5, --task ladder "
        f"{EXPERIMENTS['ladder'].seeds}; distill {distill.seeds}; --quick: 2)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"RL steps per run (default: length {EXPERIMENTS['trace'].steps}, --task chain "
        f"{EXPERIMENTS['chain'].steps}, --task ladder {EXPERIMENTS['ladder'].steps}; distill {distill.steps} per student; --quick: 12, distill 8)",
    )
    parser.add_argument(
        "--workers", type=int, help="runs trained at once (default: 2; length --task chain or ladder 1)"
    )
    parser.add_argument(
        "--entropy-coef",
        type=float,
        help="length only. entropy bonus of every algorithm (default: "
        f"none; --task chain {EXPERIMENTS['chain'].entropy_coef}; "
        "with --target-entropy, the starting coefficient)",
    )
    parser.add_argument(
        "--target-entropy",
        type=float,
        help="length only. steer every algorithm's entropy bonus toward this entropy, nats per token "
        f"(pgloss.AdaptiveEntropy; default: none, a fixed bonus; --task ladder "
        f"{EXPERIMENTS['ladder'].target_entropy})",
    )
    parser.add_argument(
        "--out",
        help="output folder (default: runs/NAME, with -TASK for length's chain and ladder and -quick for "
        "--quick; taken by another experiment: the next free name beside it); the same "
        "experiment is resumed",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an experiment with other settings in --out, its files kept in --out/replaced",
    )
    parser.add_argument("--report-only", action="store_true", help="only write the report from the runs in --out")
    parser.set_defaults(func=cmd_experiment)
