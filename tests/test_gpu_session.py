"""benchmarks/gpu_session.sh, the GPU session's one command, run here with every command checked, not run
(tests/benchmark_argcheck.py): a typo in it would otherwise be found on a GPU lent for minutes."""

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("checks", "plain", "hidden", "step")


def run_session(tmp_path: Path, *parts: str, script: Path = ROOT / "benchmarks" / "gpu_session.sh"):
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{ROOT / "tests" / "benchmark_argcheck.py"}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    env = {**os.environ, "BENCH_PYTHON": str(python), "OUT": str(tmp_path / "out")}
    return subprocess.run(
        ["bash", str(script), *parts],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_every_command_of_the_session_is_accepted_and_each_part_keeps_its_log(tmp_path):
    done = run_session(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    checked = [line for line in done.stdout.splitlines() if line.startswith("checked:")]
    scripts = [line.split()[1] for line in checked]
    assert scripts == ["the"] + ["pytest"] + ["benchmarks/plain.py"] * 2 + ["benchmarks/launches.py"] + [
        "benchmarks/fused.py"
    ] * 3 + ["benchmarks/grpo_step.py"], checked
    assert "would install" in done.stdout  # the install step ran, with the installer replaced
    assert done.stdout.count(": exit 0 (") == 8  # every command passed its check
    logs = sorted(path.name for path in (tmp_path / "out").iterdir())
    assert logs == sorted(["setup.log", *(f"{part}.log" for part in PARTS)])
    assert "benchmarks/grpo_step.py" in (tmp_path / "out" / "step.log").read_text()


def test_a_misspelt_variant_or_an_unknown_part_fails_here(tmp_path):
    script = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    broken = tmp_path / "benchmarks" / "gpu_session.sh"
    broken.parent.mkdir()
    broken.write_text(script.replace("liger-static", "liger-statik"))
    # the broken copy runs from its own folder's parent, so it finds the repository's scripts through a link
    for name in ("src", "tests"):
        (tmp_path / name).symlink_to(ROOT / name)
    for path in (ROOT / "benchmarks").glob("*.py"):
        (tmp_path / "benchmarks" / path.name).symlink_to(path)
    done = run_session(tmp_path, "hidden", script=broken)
    refusals = [line for line in done.stdout.splitlines() if "unknown variants" in line]
    assert len(refusals) == 1 and "'liger-statik'" in refusals[0], done.stdout
    assert done.stdout.count(": exit 2 (") == 1  # argparse's status for the command with the typo
    assert done.returncode == 1  # the session went on to the next command, and says that one failed
    unknown = run_session(tmp_path, "plian")
    assert unknown.returncode == 2 and "unknown part plian" in unknown.stderr
