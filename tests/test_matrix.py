"""The supported range as tested: pyproject's torch floor is the one `make matrix` runs, and it reaches the torch
the trainers pin; tests/matrix.py counts and tabulates (tests/test_readme.py: the README states the same range)."""

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import matrix  # noqa: E402 (tests/matrix.py, the runner of `make matrix`)

# The torch the trainers' own releases pin today: a user of each needs no other torch for pgloss.
TRAINER_TORCH = {"verl 0.9.1 (its extras)": "2.11.0", "AReaL 1.0.4 (>= 2.9.1, < 2.11)": "2.9.1", "SkyRL 0.4": "2.13.0"}


def version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def makefile(name: str) -> str:
    return re.search(rf"^{name} := (\S+)$", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_the_floor_is_the_one_the_matrix_tests_and_every_page_states():
    floor = re.search(r'dependencies = \["torch>=([\d.]+)"\]', (ROOT / "pyproject.toml").read_text()).group(1)
    assert makefile("MATRIX_FLOOR") == floor
    newest = makefile("MATRIX_NEWEST")
    assert version(newest) > version(floor)
    for pinned in TRAINER_TORCH.values():
        assert version(floor) <= version(pinned)


def test_the_ci_runs_the_matrix_after_the_tests():
    steps = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("make ")]
    assert steps == ["make test", "make matrix"]


def test_the_matrix_counts_failures_and_errors_as_failed(tmp_path):
    report = tmp_path / "report.xml"
    report.write_text(
        "<testsuites><testsuite>"
        '<testcase name="a"/><testcase name="b"><failure message="x"/></testcase>'
        '<testcase name="c"><error message="y"/></testcase><testcase name="d"><skipped/></testcase>'
        "</testsuite></testsuites>"
    )
    assert matrix.counts(report) == (1, 2, 1)


def test_the_matrix_table_has_a_row_per_torch():
    rows = [
        {
            "torch": "2.9.1",
            "python": "3.10.13",
            "triton": "3.5.1",
            "passed": 10,
            "failed": 0,
            "skipped": 2,
            "seconds": 90,
        },
        {
            "torch": "2.15.0",
            "python": "3.13.0",
            "triton": "3.9.0",
            "passed": 12,
            "failed": 1,
            "skipped": 0,
            "seconds": 60,
        },
    ]
    lines = matrix.table(rows).splitlines()
    assert lines[0].split(" | ")[:5] == ["torch ", "Python ", "Triton", "passed", "failed"]
    assert [line.split(" | ")[0].strip() for line in lines[2:]] == ["2.9.1", "2.15.0"]
    assert lines[3].split(" | ")[4].strip() == "1"
