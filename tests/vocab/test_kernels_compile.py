"""The Triton kernels compile for a GPU, checked on a machine without one (compile_kernels.py).

Here the other kernel tests run the kernels in Triton's interpreter, which executes their Python and never types
it: a kernel the compiler refuses passes them. On an H100 with Triton 3.6, `_head`'s two returns of different
types (a tile's slope, or the scalar scale without a soft-cap) failed every soft-capped head that way. Each kernel
goes through the compiler's front end for sm_90 with every combination of its flags, and through the whole of
`triton.compile` to a cubin with every flag on (the head-kernel route's, whose tl.dot differs by dtype, for a
bfloat16 and a float32 head)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton.backends.nvidia.compiler")
HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory) -> dict:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env |= dict(
        TRITON_CACHE_DIR=str(tmp_path_factory.mktemp("triton-cache")),  # compiled here, not found
        PYTHONPATH=os.pathsep.join(filter(None, [str(SRC), env.get("PYTHONPATH")])),
    )
    done = subprocess.run(
        [sys.executable, str(HERE / "compile_kernels.py"), "--broken"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def compiled(compiled_run) -> dict:
    return compiled_run["compiled"]


@pytest.fixture(scope="module")
def compiled_pointers(compiled_run) -> dict:
    return compiled_run["pointers"]


def test_every_kernel_compiles_for_a_hopper_gpu_with_every_flag(compiled):
    refused = {
        label: message for label, message in compiled.items() if message != "ok" and not label.startswith("broken")
    }
    assert refused == {}
    assert sum(label.startswith("pair_backward ") and "cubin" not in label for label in compiled) == 3 * 2**4
    assert (
        sum(label.startswith("head_log_prob_entropy_backward ") and "cubin" not in label for label in compiled) == 2**8
    )
    assert [" ".join(label.split()[:2]) for label in compiled if "cubin" in label] == [
        "log_prob_entropy_forward bf16",
        "log_prob_entropy_backward bf16",
        "pair_forward bf16",
        "jsd_forward bf16",
        "pair_backward bf16",
        "head_log_prob_entropy_forward bf16",
        "head_log_prob_entropy_forward fp32",
        "head_log_prob_entropy_backward bf16",
        "head_log_prob_entropy_backward fp32",
    ]


def test_the_check_refuses_a_kernel_whose_returns_differ_in_type(compiled):
    """The harness can fail: a helper returning a tile in one static branch and a scalar in the other."""
    assert compiled["broken fp32 FLAG=False BLOCK=64"] == "ok"  # the branch with the tile is not compiled
    assert "_two_return_types(x, FLAG)" in compiled["broken bf16 FLAG=True BLOCK=64"]


def narrow_offsets(additions: list[str]) -> list[str]:
    """The pointer additions of a kernel's IR that could wrap past 2³¹ elements: a 32-bit offset added to a scalar
    pointer (a row's start), or a 32-bit tensor of offsets other than a tile's columns (`%cols`, each below
    `kernels.MAX_WIDTH`)."""
    scalar = [line for line in additions if re.search(r": !tt\.ptr<[^>]+>, i\d+$", line)]
    columns = re.compile(r"tt\.addptr %\w+, %cols\w* :")
    return [line for line in scalar if not line.endswith(", i64")] + [
        line for line in additions if line.endswith("xi32>") and not columns.search(line)
    ]


def test_every_row_offset_in_the_kernels_is_64_bit(compiled_pointers):
    """Each kernel's pointer arithmetic, read from Triton's IR for sm_90 (compile_kernels.py): every offset added
    to a scalar pointer (a row of the tile, the bias's and the targets' offsets, the running state) is 64-bit, and
    a 32-bit offset is a tile's column within a row (< `kernels.MAX_WIDTH`), so that a tile past 2³¹ elements
    (Cut Cross-Entropy #39) cannot wrap. The check flags a kernel whose row offset is 32-bit."""
    kernels = {name: lines for name, lines in compiled_pointers.items() if not name.startswith("broken")}
    assert set(kernels) == {
        "log_prob_entropy_forward",
        "log_prob_entropy_backward",
        "pair_forward",
        "jsd_forward",
        "pair_backward",
        "head_log_prob_entropy_forward",
        "head_log_prob_entropy_backward",
    }
    assert all(lines for lines in kernels.values())
    assert {name: narrow_offsets(lines) for name, lines in kernels.items()} == dict.fromkeys(kernels, [])
    assert narrow_offsets(compiled_pointers["broken rows in 32 bits"])
