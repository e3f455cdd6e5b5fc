"""The project's own checks on its code, with the configuration in pyproject.toml: ruff's lint rules and its
format, mypy over the package, and every source file at most 450 lines (a file past that holds two concepts)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ["src", "tests", "benchmarks", "examples"]
MAX_LINES = 450


def run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, timeout=600, cwd=ROOT)


@pytest.mark.parametrize("command", [("ruff", "check", *CHECKED), ("ruff", "format", "--check", *CHECKED)])
def test_ruff_passes(command):
    done = run(*command)
    assert done.returncode == 0, (done.stdout + done.stderr)[-5000:]


def test_mypy_passes_over_the_package():
    done = run("mypy")  # the files and options are pyproject.toml's [tool.mypy]
    assert done.returncode == 0, done.stdout[-5000:]
    assert "Success: no issues found" in done.stdout


def test_every_source_file_is_at_most_450_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "src" / "pgloss").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split along a concept: {long}"
