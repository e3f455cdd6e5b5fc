"""`make matrix`: the core, property and kernel-interpreter tests under each torch of the supported range, each in
its own virtual environment (the Makefile builds them), and one table: torch, Python, Triton, passed, failed.

Usage: python tests/matrix.py VENV [VENV ...] -- PYTEST_ARGS. Every venv runs the same pytest arguments; the exit
status is 1 when any test failed or any run did not finish, so that CI holds the range it claims.
"""

import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VERSIONS = (
    "import platform, torch\n"
    "try:\n    import triton; t = triton.__version__\nexcept ImportError:\n    t = '-'\n"
    "print(torch.__version__, platform.python_version(), t)"
)


def counts(report: Path) -> tuple[int, int, int]:
    """(passed, failed, skipped) from pytest's JUnit XML: a failure or an error counts as failed, an expected
    failure (xfail) as skipped, as the XML records it."""
    passed = failed = skipped = 0
    for case in ET.parse(report).iter("testcase"):
        tags = {child.tag for child in case}
        if tags & {"failure", "error"}:
            failed += 1
        elif "skipped" in tags:
            skipped += 1
        else:
            passed += 1
    return passed, failed, skipped


def run(venv: Path, pytest_args: list[str]) -> dict:
    python = venv / "bin" / "python"
    torch, py, triton = subprocess.run(
        [str(python), "-c", VERSIONS], capture_output=True, text=True, check=True, cwd=ROOT
    ).stdout.split()
    report = venv / "matrix.xml"
    report.unlink(missing_ok=True)
    print(f"== torch {torch} (Python {py}, Triton {triton}): pytest {' '.join(pytest_args)}", flush=True)
    start = time.monotonic()
    done = subprocess.run(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}", *pytest_args], cwd=ROOT
    )
    row = {"torch": torch, "python": py, "triton": triton, "seconds": time.monotonic() - start, "rc": done.returncode}
    if report.is_file():
        row["passed"], row["failed"], row["skipped"] = counts(report)
    else:  # pytest stopped before it wrote a report (a collection error, a crash)
        row["passed"], row["failed"], row["skipped"] = 0, 1, 0
    return row


def table(rows: list[dict]) -> str:
    head = ("torch", "Python", "Triton", "passed", "failed", "skipped", "time")
    lines = [
        (r["torch"], r["python"], r["triton"], str(r["passed"]), str(r["failed"]), str(r["skipped"]),
         f"{r['seconds'] / 60:.1f} min")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(x) for x in column) for column in zip(head, *lines, strict=True)]
    out = [" | ".join(x.ljust(w) for x, w in zip(line, widths, strict=True)) for line in [head, *lines]]
    out.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(out)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit(__doc__)
    split = argv.index("--")
    venvs, pytest_args = [Path(v) for v in argv[:split]], argv[split + 1 :]
    rows = [run(venv, pytest_args) for venv in venvs]
    print()
    print(table(rows))
    bad = [r for r in rows if r["failed"] or r["rc"] not in (0, 5)]
    passed, failed = sum(r["passed"] for r in rows), sum(r["failed"] for r in rows)
    print(f"matrix: {passed} passed, {failed} failed, {sum(r['skipped'] for r in rows)} skipped")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
