"""Top-k distillation from hidden states holds no N x V buffer: its CPU peak memory is the plain log π(y) call's,
measured as benchmarks/topk.py measures it (each variant in its own process, the RSS high-water mark above the
inputs and the room of the two gradients, glibc's large buffers returned at free), at N = 1024, V = 32768, k = 128,
chunks of 128 tokens: one [chunk, V] float32 buffer is 16 MiB, the N x V logits 128 MiB.

Measured (2 cores shared): plain 50 MiB, top-k 53-54 MiB, the materialised logits with verl's formula 389-390 MiB."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
ARGS = "--tokens 1024 --seq-len 256 --hidden 64 --vocab 32768 --k 128 --chunk-size 128 --threads 1".split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads VmHWM from /proc/self/status")
def test_topk_from_hidden_peaks_at_the_plain_call(monkeypatch):
    sys.path.insert(0, str(BENCHMARKS))
    from device import run_variant

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    monkeypatch.setenv("PYTHONPATH", str(BENCHMARKS.parent / "src"))
    script = str(BENCHMARKS / "topk.py")
    peak = {v: run_variant(script, ARGS, v, 300)["peak_mib"] for v in ("plain", "topk", "materialised")}
    assert all(value is not None for value in peak.values()), peak
    chunk_buffer, logits = 16, 128  # MiB
    assert peak["topk"] <= peak["plain"] + chunk_buffer / 2, peak  # the [N, k] arrays: about 4 MiB
    assert peak["materialised"] >= peak["topk"] + 2 * logits, peak
