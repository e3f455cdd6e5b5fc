"""Every torch file pgloss reads is read with torch.load(weights_only=True): a file holding a pickled callable
(which torch < 2.6's default, weights_only=False, would call) is refused by name, its code not run, by each
reader: `pgloss grads --batch`, the warm-start cache and the distillation teacher."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pgloss
from pgloss.experiments import distill
from pgloss.lab import warm
from pgloss.lab.config import LabConfig
from pgloss.lab.torch_files import load_tensors


class _RunsCode:
    """Unpickling this calls os.mkdir(marker): the stand-in for arbitrary code in a downloaded file."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _hostile(file: Path, marker: Path) -> Path:
    """A torch file of tensors and one pickled callable; checked to run its code when loaded unsafely."""
    file.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"log_prob": torch.zeros(2, 3), "payload": _RunsCode(marker)}, file)
    torch.load(file, weights_only=False)
    assert marker.is_dir()  # the file is what it claims: loading it the old way runs its code
    marker.rmdir()
    return file


def test_a_batch_holding_a_callable_is_refused_by_pgloss_grads(tmp_path):
    batch, marker = _hostile(tmp_path / "batch.pt", tmp_path / "ran"), tmp_path / "ran"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(Path(pgloss.__file__).parent.parent)
    done = subprocess.run(
        [sys.executable, "-m", "pgloss.cli", "grads", "--batch", str(batch), "--out", str(tmp_path / "g.png")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"pgloss grads: --batch: {batch} holds a pickled posix.mkdir"), done.stderr
    assert "weights_only=True" in done.stderr and not marker.exists()


def test_a_warm_start_cache_file_holding_a_callable_is_refused_not_replaced(tmp_path):
    cfg, marker = LabConfig(), tmp_path / "ran"
    file = _hostile(warm.path(cfg, tmp_path), marker)
    with pytest.raises(ValueError, match=rf"warm-start cache: {file} holds a pickled posix.mkdir"):
        warm.trained(cfg, tmp_path)
    assert not marker.exists() and file.exists()


def test_a_teacher_file_holding_a_callable_is_refused_before_the_student_trains(tmp_path):
    marker = tmp_path / "ran"
    file = _hostile(distill.teacher_path(tmp_path, 0), marker)
    with pytest.raises(ValueError, match=rf"distillation teacher: {file} holds a pickled posix.mkdir"):
        distill._student(distill.DistillExperiment(), "opd", 0, str(tmp_path))
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_tensors_numbers_and_containers_load_as_saved(tmp_path):
    saved = {"w": torch.arange(6.0).reshape(2, 3), "step": 3, "config": {"task": "chain", "lr": [1e-3, 2]}}
    torch.save(saved, tmp_path / "ok.pt")
    loaded = load_tensors(tmp_path / "ok.pt", "test")
    assert torch.equal(loaded["w"], saved["w"]) and loaded["step"] == 3 and loaded["config"] == saved["config"]


def test_every_torch_load_in_pgloss_is_load_tensors():
    """One reader: a new torch.load elsewhere in src/ would skip weights_only=True on torch < 2.6."""
    root = Path(pgloss.__file__).parent
    calls = sorted(
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute)
        and node.attr == "load"
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )
    assert calls == ["lab/torch_files.py"], calls
