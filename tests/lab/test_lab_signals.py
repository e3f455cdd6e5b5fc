"""A signal never costs a finished run its report, and ``pgloss report RUN_DIR`` writes it again:
real processes, real signals, sent at the moments a user meets (just after the bar shows done,
while the plots are drawn, a kill -9 in the middle)."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from lab_helpers import CLI_TINY, PGLOSS, warm_cache  # noqa: F401 (autouse: a warm-start cache of each test's own)

from pgloss.lab.plots import plot_names

PNGS = [f"{name}.png" for name in plot_names()]


def _wait_for(proc: subprocess.Popen, ready, seconds: float = 240) -> None:
    """Poll every 20 ms until `ready()`; the process must still be running then."""
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1][-3000:]


def _last_step_written(metrics: Path, steps: int, runs: int = 1):
    def ready() -> bool:
        if not metrics.exists():
            return False
        lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.endswith("}")]
        return sum(r["step"] == steps for r in lines) >= runs

    return ready


def _assert_complete(out: Path, runs: int) -> None:
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "finished" and [r["status"] for r in config["runs"]] == ["finished"] * runs
    report = (out / "report.md").read_text()
    assert "interrupted" not in report and "not started" not in report
    for png in PNGS:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
        assert f"![{png[:-4]}]({png})" in report


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_a_signal_just_after_the_last_step_keeps_the_run_and_its_report(tmp_path, sig):
    """The issue's case: the bar shows done, then SIGTERM (or Ctrl-C) while the run returns and its files
    are written: the run is finished, the report, plots and samples are all there, one line says so."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [PGLOSS, "train", "--algorithm", "grpo", "--steps", "3", *CLI_TINY, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(proc, _last_step_written(out / "metrics.jsonl", 3))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err and "again" not in err, err[-3000:]
    assert "pgloss train: 1 of 1 runs finished" in err and "the report was written in full first" in err, err[-3000:]
    _assert_complete(out, 1)
    assert "## grpo, seed 0" in (out / "samples.md").read_text()


def test_signals_while_the_plots_are_drawn_wait_for_them(tmp_path):
    """Two SIGTERMs once report.md exists (the plots come after it): every plot is still drawn."""
    out = tmp_path / "run"
    cmd = [
        PGLOSS,
        "compare",
        "--algorithms",
        "grpo",
        "dapo",
        "gspo",
        "--steps",
        "2",
        "--seeds",
        "1",
        "--workers",
        "1",
        *CLI_TINY,
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(proc, (out / "report.md").exists)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert "pgloss compare: 3 of 3 runs finished" in err, err[-3000:]
    _assert_complete(out, 3)


def test_a_process_group_signal_as_the_last_workers_end_keeps_every_run(tmp_path):
    """SIGTERM to the process group (workers too) as soon as every run's last step is written: a run whose
    worker died before returning its result is finished all the same (its steps are all in metrics.jsonl)."""
    out = tmp_path / "run"
    cmd = [
        PGLOSS,
        "compare",
        "--algorithms",
        "grpo",
        "dapo",
        "--steps",
        "2",
        "--seeds",
        "1",
        "--workers",
        "2",
        *CLI_TINY,
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    _wait_for(proc, _last_step_written(out / "metrics.jsonl", 2, runs=2))
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    _assert_complete(out, 2)


def test_report_rebuilds_a_killed_run_and_a_finished_one(tmp_path):
    """kill -9 leaves no report; `pgloss report` writes it from metrics.jsonl and config.json. On a run
    that has one, it writes the same report and keeps the earlier files in replaced/."""
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [PGLOSS, "train", "--algorithm", "grpo", "--steps", "200", *CLI_TINY, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _wait_for(
        proc, lambda: (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2
    )
    proc.kill()
    proc.communicate(timeout=60)
    assert not (out / "report.md").exists()
    done = subprocess.run([PGLOSS, "report", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"pgloss report: {out / 'report.md'}", done.stderr
    report = (out / "report.md").read_text()
    assert report.startswith("# pgloss lab: training run") and "0 of 1 runs finished" in report
    assert "- grpo, seed 0: interrupted after " in report and "No run finished." in report
    assert json.loads((out / "config.json").read_text())["status"] == "running"  # what the run left is not rewritten

    finished = tmp_path / "finished"
    subprocess.run(
        [
            PGLOSS,
            "compare",
            "--algorithms",
            "grpo",
            "sapo",
            "--steps",
            "2",
            "--seeds",
            "1",
            "--workers",
            "1",
            *CLI_TINY,
            "--out",
            str(finished),
        ],
        capture_output=True,
        timeout=300,
        check=True,
    )
    before = (finished / "report.md").read_text()
    done = subprocess.run([PGLOSS, "report", str(finished)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "kept in" in done.stderr, done.stderr
    assert (finished / "report.md").read_text() == before == (finished / "replaced" / "report.md").read_text()
    assert all((finished / png).exists() and (finished / "replaced" / png).exists() for png in PNGS)


def test_report_refuses_a_folder_without_a_run(tmp_path):
    done = subprocess.run([PGLOSS, "report", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no config.json" in done.stderr, done.stderr
    assert not any(tmp_path.iterdir())
