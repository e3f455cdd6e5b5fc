"""`pgloss conformance` as a user runs it: a subprocess, its output and its exit status."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pgloss.conformance import run as conformance

SRC = str(Path(__file__).resolve().parents[1] / "src")


def pgloss_conformance(*options, path=()):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, *map(str, path)]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "pgloss.conformance.run", "conformance", *options],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_trl_agrees_or_differs_as_documented():
    pytest.importorskip("trl")
    done = pgloss_conformance("--trainer", "trl")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "TRL:"
    agree = [line for line in lines if line.strip().startswith("agree ")]
    documented = [line for line in lines if line.strip().startswith("differs as documented")]
    assert len(agree) >= 30 and len(documented) >= 4
    assert "DIFFERS" not in done.stdout.replace("0 DIFFERS", "")
    assert any("vllm_importance_sampling_mode='sequence_mask'" in line for line in agree)
    assert (
        done.stdout.splitlines()[-1] == f"pgloss conformance: {len(agree)} agree, {len(documented)} differ as "
        "documented, 0 DIFFER"
    )


def test_openrlhf_as_a_user_runs_it():
    """The OpenRLHF module from the command line: its cases, the documented differences with their reasons, a
    summary per trainer and in all, exit 0."""
    from pgloss.conformance import openrlhf

    why = openrlhf.available()
    if why is not None:
        pytest.skip(why)
    done = pgloss_conformance("--trainer", "openrlhf")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "OpenRLHF:"
    assert lines[-2] == "  OpenRLHF: 27 agree, 3 differs as documented, 0 DIFFERS"
    assert lines[-1] == "pgloss conformance: 27 agree, 3 differ as documented, 0 DIFFER"
    assert sum("'Conformance with OpenRLHF'" in line for line in lines) == 3  # each reason printed under its case


def test_an_undocumented_difference_exits_non_zero(tmp_path):
    """A module with a real but undocumented difference (TRL's grpo counts an empty completion; the case
    gives no reason): the command prints DIFFERS and exits 1."""
    pytest.importorskip("trl")
    (tmp_path / "broken_trainer.py").write_text(
        textwrap.dedent("""
        from pgloss.conformance import Case
        from pgloss.conformance.trl import compare

        TRAINER = "TRL, undocumented"

        def available():
            return None

        def cases():
            loss, grad = compare(dict(loss_type="grpo"), empty_row=True)
            yield Case(trainer=TRAINER, function="GRPOTrainer._compute_loss", algorithm="grpo",
                       setting="an empty completion", loss_error=loss, grad_error=grad, tolerance=1e-9)
    """)
    )
    done = pgloss_conformance("--module", "broken_trainer", path=[tmp_path])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DIFFERS                grpo       an empty completion" in done.stdout
    assert done.stdout.splitlines()[-1] == "pgloss conformance: 0 agree, 0 differ as documented, 1 DIFFER"


def test_unavailable_and_missing_modules(tmp_path):
    (tmp_path / "absent_trainer.py").write_text(
        "TRAINER = 'Absent'\ndef available():\n    return 'not installed'\ndef cases():\n    return iter(())\n"
    )
    done = pgloss_conformance("--module", "absent_trainer", path=[tmp_path])
    assert done.returncode == 1  # nothing could be checked
    assert "Absent: not run (not installed)" in done.stdout
    assert conformance._load("no_such_trainer", builtin=True) is None  # a trainer module not written is skipped
    assert "verl" in conformance.MODULES  # discovered by name, e.g. pgloss.conformance.verl


def test_every_documented_reason_names_a_section_of_the_reference():
    """A reason's "docs/reference.md, '<section>'" names a heading that exists, or its start (the difference
    is sized there)."""
    import re

    root = Path(__file__).resolve().parents[1]
    headings = {
        line.lstrip("#").strip()
        for line in (root / "docs" / "reference.md").read_text().splitlines()
        if line.startswith("#")
    }
    cited = set()
    for name in conformance.MODULES:
        text = (root / "src" / "pgloss" / "conformance" / f"{name}.py").read_text()
        cited |= set(re.findall(r"docs/reference\.md, '([^']+)'", text))
    assert {
        "Conformance with TRL",
        "Conformance with ms-swift",
        "Conformance with Liger-Kernel",
        "Conformance with OpenRLHF",
    } <= cited
    assert all(any(h.startswith(c) for h in headings) for c in cited), cited - headings  # a heading or its start
