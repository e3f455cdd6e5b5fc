"""The `pgloss` command, run the way a user runs it."""

import subprocess
import sys
from pathlib import Path

import pytest

import pgloss
import pgloss.cli
from pgloss.algorithms import _TABLE

PGLOSS = [str(Path(sys.executable).with_name("pgloss"))]


def run(*args: str) -> str:
    return subprocess.run(PGLOSS + list(args), check=True, capture_output=True, text=True).stdout


def test_list_groups_every_algorithm_by_family_with_its_defaults_and_source():
    out = run("list")
    lines = out.strip().splitlines()
    headers = [line for line in lines if line.startswith("[")]
    assert len(headers) == len(pgloss.families()) and "[DPPO] losses/dppo.py" in headers
    table = [row[0] for row in _TABLE]  # the built-in names: the command's own process registers no other
    printed = [line.split()[0] for line in lines if not line.startswith(("[", " "))]
    assert sorted(printed) == sorted(table) and len(lines) == len(headers) + 2 * len(table)
    for name in table:
        row = next(i for i, line in enumerate(lines) if line.split()[:1] == [name])
        assert lines[row + 1].split()[0] == "source:", name
    assert "cispo_convention=relative" in out and "verl geo_mean" in out
    assert "clip_low=0.0003, clip_high=0.0004" in out
    assert "norm_constant required" in out


def test_losses_prints_a_finite_row_per_algorithm():
    out = run("losses", "--batch", "4", "--length", "6")
    rows = [line for line in out.splitlines() if line.split() and line.split()[0] in pgloss.names()]
    assert len(rows) == len(pgloss.names())
    for row in rows:
        assert "nan" not in row and "inf" not in row


def test_unknown_command_fails():
    result = subprocess.run(PGLOSS + ["frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


def test_bad_numbers_and_unknown_trainers_get_one_line_as_a_user_runs_them():
    """The command as a user runs it: a bad --length is one line and exit 2 (no traceback); a trainer
    without a conformance module is refused by name, listing those that exist."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pgloss.cli", "losses", "--length", "0"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr == "pgloss losses: --length must be >= 1 (tokens per response), got 0\n"
    done = subprocess.run(
        [sys.executable, "-m", "pgloss.cli", "conformance", "--trainer", "nemo_rl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    choices = "'liger', 'ms_swift', 'ms_swift_sdar', 'openrlhf', 'trl', 'trl_sdpo', 'verl', 'verl_distillation'"
    assert done.returncode == 2 and f"invalid choice: 'nemo_rl' (choose from {choices})" in done.stderr
    assert "Traceback" not in done.stderr and "install" not in done.stderr + done.stdout


def test_a_misspelt_algorithm_on_the_command_line_gets_the_closest_name():
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "pgloss.cli", "train", "--algorithm", "grpoo"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "unknown algorithm 'grpoo' (did you mean 'grpo'?)" in done.stderr


def test_an_option_of_another_command_gets_that_commands_usage_and_a_hint():
    """`pgloss train --seeds 1`: train's own usage (not the top-level one), exit 2, and a hint that train takes
    --seed while compare and experiment take --seeds."""
    done = subprocess.run(PGLOSS + ["train", "--seeds", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr.startswith("usage: pgloss train "), done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "pgloss train: error: unrecognized arguments: --seeds 1 "
        "(did you mean --seed? --seeds is an option of pgloss compare and pgloss experiment)"
    )


@pytest.mark.parametrize(
    ("command", "typed", "meant"),
    [
        ("train", "--learning-rate", "--lr"),
        ("compare", "--learning-rate", "--lr"),
        ("train", "--algoritm", "--algorithm"),
    ],
)
def test_an_unknown_flag_gets_the_one_it_most_likely_means(command, typed, meant):
    """A long name for an option spelt short (and a misspelling) gets a did-you-mean, as a loss name does, under a
    one-line usage rather than the command's whole option list."""
    done = subprocess.run(PGLOSS + [command, typed, "3"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"usage: pgloss {command} [options] (pgloss {command} --help lists them)",
        f"pgloss {command}: error: unrecognized arguments: {typed} 3 (did you mean {meant}?)",
    ], done.stderr


def test_closest_option_reads_initials_both_ways():
    from pgloss.cli import closest_option

    options = ["--lr", "--max-grad-norm", "--seed", "-h", "--help"]
    assert closest_option("--learning-rate", options) == "--lr"
    assert closest_option("--mgn", options) == "--max-grad-norm"
    assert closest_option("--sed", options) == "--seed"
    assert closest_option("--temperature", options) is None


def test_help_describes_every_command_in_the_users_words():
    """The top-level help names each subcommand in its prose (conformance included), and no internal name."""
    out = run("--help")
    prose = " ".join(out.split("positional arguments:")[0].split())
    commands = pgloss.cli.build_parser()._subparsers._group_actions[0].choices
    assert set(commands) >= {"list", "losses", "train", "compare", "experiment", "report", "grads", "conformance"}
    for command in commands:
        assert f"({command})" in prose, command
    assert "COMMANDS" not in out and "DESCRIPTION" not in out
