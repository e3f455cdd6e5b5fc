"""The `pgloss` command, run the way a user runs it."""

import subprocess
import sys
from pathlib import Path

import pgloss

PGLOSS = [str(Path(sys.executable).with_name("pgloss"))]


def run(*args: str) -> str:
    return subprocess.run(PGLOSS + list(args), check=True, capture_output=True, text=True).stdout


def test_list_shows_every_algorithm_with_its_defaults():
    out = run("list")
    lines = out.strip().splitlines()
    assert len(lines) == 1 + len(pgloss.names()) == 13
    for name in pgloss.names():
        assert any(line.split()[0] == name for line in lines[1:]), name
    assert "clip_low=0.0003, clip_high=0.0004" in out
    assert "norm_constant required" in out


def test_losses_prints_a_finite_row_per_algorithm():
    out = run("losses", "--batch", "4", "--length", "6")
    rows = [line for line in out.splitlines() if line.split() and line.split()[0] in pgloss.names()]
    assert len(rows) == 12
    for row in rows:
        assert "nan" not in row and "inf" not in row


def test_unknown_command_fails():
    result = subprocess.run(PGLOSS + ["frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr
