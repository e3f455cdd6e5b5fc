"""The ms-swift adapter's tests (tests/integrations/swift_adapter) in their own environment: ms-swift 4.6.0 needs
TRL < 1.0, beside the TRL 1.16 of this one. `make test` builds it (.venv-swift, the Makefile's `swift` rule); where
it is absent this test skips. One subprocess, so that it runs beside the other tests of this worker's neighbours."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv-swift" / "bin" / "python"


def test_ms_swift_adapter_suite_in_its_environment():
    if not PYTHON.exists():
        pytest.skip("no .venv-swift: `make swift` (or `make test`) builds ms-swift 4.6.0's environment")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [
            str(PYTHON),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:logging",
            "-o",
            "addopts=",
            "-W",
            "ignore::DeprecationWarning",
            str(ROOT / "tests" / "integrations" / "swift_adapter"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    summary = run.stdout.strip().splitlines()[-1] if run.stdout.strip() else ""
    print(summary, file=sys.stderr)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "skipped" not in summary, summary
