"""What ``pgloss train`` and ``pgloss compare`` write once their runs end, and ``pgloss report`` again.

``conclude`` writes the files of what finished with signals held (``runner.Held``), prints the command's
last line and gives its exit status; ``finish`` writes config.json (each run's status), samples.md,
errors.log, report.md, then the plots; ``rebuild`` writes report.md and the plots of a run folder again from
its config.json and metrics.jsonl (``pgloss report``). ``outcome`` is a run's status from what it returned
or, when a signal cost its result, from the records it streamed.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from .config import LabConfig, mismatched
from .resume import resume_command
from .runner import Held, Sink


def write_config(out: Path, config: dict) -> None:
    """``config.json``: the command, its settings and, once they end, each run's status."""
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


TITLES = {"compare": "comparison", "train": "training run"}


def finish(out: Path, runs: list[dict], config: dict, command: str = "compare", rebuilt: bool = False) -> Path:
    """config.json (with each run's status), samples.md, errors.log, report.md, then the PNG plots of the
    finished runs; returns the report. The report comes before the plots, the slow part, so that a
    process killed while drawing them still leaves it (``pgloss report`` draws them again). `rebuilt`:
    report.md and the plots only (``rebuild``: config.json, samples.md and errors.log stay as the run left them)."""
    from .plots import plot_all, plot_names
    from .report import write_report, write_samples

    finished = [r for r in runs if r["status"] == "finished"]
    if not rebuilt:
        config["runs"] = [{k: r[k] for k in ("algorithm", "seed", "status", "steps_done", "error")} for r in runs]
        write_config(out, config)
        write_samples(out, {(r["algorithm"], r["seed"]): r["samples"] for r in finished if r["samples"]})
    failed = [r for r in runs if r["status"] == "failed" and r.get("traceback") and not rebuilt]
    if failed:
        (out / "errors.log").write_text(
            "".join(f"== {r['algorithm']}, seed {r['seed']}\n{r['traceback']}\n" for r in failed)
        )
    mismatch = mismatched(config["base"])
    plots = [out / f"{name}.png" for name in plot_names(mismatch)] if finished else []
    report = write_report(out, runs, config, plots, title=TITLES[command])
    if finished:
        plot_all(
            [m for r in finished for m in r["metrics"]],
            out,
            max_grad_norm=config["base"]["max_grad_norm"],
            mismatch=mismatch,
        )
    return report


def _saved_runs(out: Path, config: dict) -> list[dict]:
    """The runs of a train or compare folder as `finish` takes them, from config.json and metrics.jsonl: a
    run whose last step (``steps``) is in metrics.jsonl is finished; a failed run stays failed (its
    error in config.json); one with some steps was interrupted; one with none did not start."""
    records: dict[tuple, list[dict]] = {}
    path = out / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a kill
                continue
            records.setdefault((record["algorithm"], record["seed"]), []).append(record)
    steps = config["base"]["steps"]
    saved = {(r["algorithm"], r["seed"]): r for r in config.get("runs", [])}
    runs = []
    for key in dict.fromkeys([*((a, s) for a in config["algorithms"] for s in config["seeds"]), *records]):
        metrics = sorted({r["step"]: r for r in records.get(key, [])}.values(), key=lambda r: r["step"])
        status, error = saved.get(key, {}).get("status"), saved.get(key, {}).get("error")
        if status != "failed":
            status = (
                "finished" if metrics and metrics[-1]["step"] == steps else "interrupted" if metrics else "not started"
            )
        runs.append(
            {
                "algorithm": key[0],
                "seed": key[1],
                "status": status,
                "error": error,
                "samples": {},
                "steps_done": min(len(metrics), steps),
                "metrics": metrics,
            }
        )
    return runs


def rebuild(out: Path) -> Path:
    """Write report.md and the plots of the ``train`` or ``compare`` run in `out` again from its
    config.json and metrics.jsonl (a run stopped before its report, or one reported by an older pgloss);
    an earlier report.md and plots are kept in ``out/replaced`` first. Returns the report's path;
    ValueError when `out` holds no such run."""
    from .outputs import set_aside
    from .plots import plot_names

    try:
        config = json.loads((out / "config.json").read_text())
        command = "train" if config["command"].startswith("pgloss train") else "compare"
        config["base"], config["algorithms"], config["seeds"]
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{out}: no config.json of a pgloss train or compare run there ({err})") from None
    set_aside(out, ["report.md", *(f"{name}.png" for name in plot_names(mismatch=True))], why="pgloss report")
    return finish(out, _saved_runs(out, config), config, command, rebuilt=True)


def outcome(cfg: LabConfig, result: dict | None, sink: Sink) -> dict:
    """A run's status (finished, failed, interrupted, not started) with what it produced; ``steps_done``
    counts the steps whose record was written (at most ``cfg.steps``: the last record measures the final policy).
    A run whose result was lost to a signal after its last record was written is finished (without samples)."""
    if result is None:
        records = sorted(sink.records.get((cfg.algorithm, cfg.seed), []), key=lambda r: r["step"])
        if records and records[-1]["step"] == cfg.steps:
            return {
                "algorithm": cfg.algorithm,
                "seed": cfg.seed,
                "status": "finished",
                "steps_done": cfg.steps,
                "error": None,
                "metrics": records,
                "samples": {},
            }
        steps = min(sink.steps_done(cfg.algorithm, cfg.seed), cfg.steps)
        started = steps or (cfg.algorithm, cfg.seed) in sink.started
        return {
            "algorithm": cfg.algorithm,
            "seed": cfg.seed,
            "status": "interrupted" if started else "not started",
            "steps_done": steps,
            "error": None,
            "metrics": [],
            "samples": {},
        }
    status = "failed" if "error" in result else "finished"
    return {
        "algorithm": cfg.algorithm,
        "seed": cfg.seed,
        "status": status,
        "steps_done": min(len(result["metrics"]), cfg.steps),
        "error": result.get("error"),
        "traceback": result.get("traceback"),
        "metrics": result["metrics"],
        "samples": result.get("samples", {}),
    }


def _summary_line(
    command: str,
    runs: list[dict],
    report: Path,
    seconds: float,
    interrupted: bool,
    signalled: bool = False,
    resume: str | None = None,
) -> str:
    """The command's last line; `signalled`: a signal came after every run ended (the report is complete);
    `resume`: the command that continues an interrupted run."""
    done = sum(r["status"] == "finished" for r in runs)
    failed = [f"{r['algorithm']} seed {r['seed']}" for r in runs if r["status"] == "failed"]
    text = f"pgloss {command}: " + ("interrupted; " if interrupted else "")
    text += f"{done} of {len(runs)} runs finished in {seconds:.0f} s; report: {report}"
    if failed:
        text += f"; failed: {', '.join(failed)} (see errors.log)"
    if signalled:
        text += "; a signal came after the last run ended: the report was written in full first"
    if interrupted and resume:
        text += f"; continue it with: {resume}"
    return text


def conclude(
    command: str, out: Path, runs: list[dict], config: dict, start: float, interrupted: bool, held: Held
) -> int:
    """Write the files of what finished and print one line, signals held until then; the exit status
    (0, 1 failed, 130 after a signal). The status in config.json is "finished" when every run ended
    (finished or failed), even if a signal came after the last one, else "interrupted"."""
    with held:
        config["seconds"] = round(time.time() - start, 1)
        ended = all(r["status"] in ("finished", "failed") for r in runs)
        config["status"] = "finished" if ended else "interrupted"
        report = finish(out, runs, config, command)
        signalled = interrupted or bool(held.received)
        resume = None if ended else resume_command(config, out)
        line = _summary_line(command, runs, report, config["seconds"], not ended, signalled and ended, resume)
        print(line, file=sys.stderr if signalled else sys.stdout)
    if signalled:
        return 130
    return 1 if any(r["status"] != "finished" for r in runs) else 0
