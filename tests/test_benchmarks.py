"""Every benchmark takes --device cuda and, on a machine without CUDA, refuses in one line with a
non-zero exit and no traceback (the measurements themselves are in BENCHMARKS.md, not in tests)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
EXTRA = {"fsdp2_memory.py": ["--path", "fused"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the refusal cannot be seen")
@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "device.py"))
def test_a_benchmark_refuses_cuda_cleanly_without_it(script):
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), *EXTRA.get(script, []), "--device", "cuda"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith("--device cuda: no CUDA device is visible"), done.stderr
