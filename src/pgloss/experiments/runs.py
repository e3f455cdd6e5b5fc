"""How an experiment trains its runs and finds them again: one JSON-lines file per (label, seed) in
``OUT/runs``, written as the run goes and named only once it is complete, so an interrupted
experiment resumes where it stopped; the warm starts in ``OUT/warm``, shared by every run of a seed.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path


def check_counts(experiment, *names: str) -> None:
    """Refuse an experiment's own count (seeds, workers, ...) that is not an int >= 1, naming its flag.
    The lab's settings are checked by the lab's configuration, which each experiment builds once."""
    for name in names:
        value = getattr(experiment, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be an int >= 1, got {value!r}")


def lab_settings(experiment) -> dict:
    """The experiment's fields that are `LabConfig`'s too (the same name is the same setting, documented
    once, in lab/config.py), by name: the settings every run of the experiment shares, which its
    ``lab_config`` passes to the lab as they are."""
    from ..lab.config import LabConfig

    lab = {f.name for f in dataclasses.fields(LabConfig)}
    return {f.name: getattr(experiment, f.name) for f in dataclasses.fields(experiment) if f.name in lab}


def run_path(out: Path, label: str, seed: int) -> Path:
    """Where the run of `label` from `seed` is kept (it exists only when the run is complete)."""
    return out / "runs" / f"{label}-{seed}.jsonl"


def warm_state(cfg, cache: str):
    """The warm start of `cfg` from `cache` (trained there first if absent), its steps reported to the progress bar."""
    from ..lab import warm
    from ..lab.runner import emit

    return warm.state(cfg, Path(cache), on_steps=lambda steps, seconds: emit({"warm": steps, "seconds": seconds}))


def write_run(
    cfg,
    path: str,
    cache: str,
    *,
    label: str | None = None,
    extra=None,
    on_rollout=None,
    teacher_state=None,
    teacher_cfg=None,
) -> dict:
    """Train `cfg` from its warm start in `cache`, each step's record (with ``extra(step)``'s measures,
    and `label` as its ``algorithm`` when given) appended to ``path.tmp`` as it is made and reported to
    the progress bar; the file takes its final name `path` only when the run is complete. `teacher_state`
    and `teacher_cfg` go to ``trainer.train``; returns its result."""
    from ..lab import trainer
    from ..lab.runner import emit, timed_steps

    tmp = Path(path + ".tmp")
    report = timed_steps(emit)
    with open(tmp, "w") as f:

        def on_step(record):
            record = {
                **record,
                **({} if label is None else {"algorithm": label}),
                **({} if extra is None else extra(record["step"])),
            }
            f.write(json.dumps(record) + "\n")
            f.flush()
            report(record)

        result = trainer.train(
            cfg,
            warm_state(cfg, cache),
            on_step=on_step,
            on_rollout=on_rollout,
            teacher_state=teacher_state,
            teacher_cfg=teacher_cfg,
        )
    tmp.rename(path)  # only a complete run gets its final name
    return result


def execute(
    name: str,
    stages: list[tuple],
    *,
    workers: int,
    warm_starts: int,
    warm_steps: int,
    rl_steps: int,
    progress: bool = True,
) -> float:
    """Run `stages`, each ``(fn, jobs)`` after the one before (e.g. warm starts, then teachers, then
    students), ``workers`` jobs at a time, with one progress bar on stderr over the `warm_starts` to
    train (`warm_steps` each) and `rl_steps`; returns the seconds taken. A KeyboardInterrupt (Ctrl-C, SIGTERM) stops the workers and
    propagates: complete runs stay, the next call resumes."""
    from ..lab.progress import Progress
    from ..lab.runner import RL, WARM, Runner, Sink

    start = time.time()
    bar = (
        Progress(
            f"experiment {name}", {WARM: (warm_starts * warm_steps, min(workers, warm_starts)), RL: (rl_steps, workers)}
        )
        if progress
        else None
    )
    sink = Sink(None, bar)
    runner, interrupted = None, False
    try:
        runner = Runner(workers, sink)
        for fn, jobs in stages:
            runner.map(fn, jobs, {})
    except BaseException:
        interrupted = True
        raise
    finally:
        if runner is not None:
            runner.close(terminate=interrupted)
        sink.close()
    return time.time() - start


def load(out: Path) -> dict[tuple[str, int], list[dict]]:
    """Every complete run in ``out/runs``: (label, seed) -> its per-step records."""
    runs = {}
    for path in sorted((out / "runs").glob("*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if records:
            runs[(records[0]["algorithm"], records[0]["seed"])] = records
    return runs
