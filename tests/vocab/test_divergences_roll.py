"""The skewed KLs and AKL against ROLL's own functions. ROLL (alibaba/ROLL) is not on the package index: its source is
read from a checkout under $PGLOSS_ROLL_SRC (alibaba/ROLL commit 8eb27cc2d), the test skipped without it. The methods
`compute_forward_kl_divergence`, `compute_reverse_kl_divergence`, `compute_adaptive_kl_divergence`,
`compute_skewed_forward_kl_divergence` and `compute_skewed_reverse_kl_divergence` of `VariousDivergence`
(roll/pipeline/distill/various_divergence.py) are cut from the file and run unchanged on a stand-in `self` holding
`kd_temperature` and the config's `skew_lambda` / `adaptive_kl_alpha`; the teacher's probabilities come from ROLL's
`InferenceStrategy.op_compute_topk_probs_and_indices` (roll/distributed/strategy/strategy.py, top-k 0: the whole
vocabulary), as its distill worker computes them. ROLL's AKL takes α = 1 − μ (vocab/adaptive_kl.py).

ROLL's softmaxes pass dtype=torch.float32, so its code runs in float32 whatever the logits' dtype. Measured on the
same inputs (B, T, V = 3, 5, 37; τ ∈ {1, 0.7}; λ ∈ {0.1, 0.5}; α ∈ {0.5, 0.3, 0.8}), per-token values and the
gradient of Σ upstream · D to the student's logits:

- ROLL's code run in float64 (`torch` and `F` in its namespace handed a stand-in whose softmax and log_softmax keep the
  input's dtype, nothing else changed) against ours in float64, max abs: skewed forward KL values 1.6e-15, gradients
  3.1e-16; skewed reverse KL 2.0e-15, 1.0e-15; AKL 7.1e-15, 1.2e-14 (whole rows and tiles of 10 columns).
- ROLL's code as it is (float32) against ours in float32, max abs: skewed forward KL values 7.2e-7, gradients
  1.6e-7; skewed reverse KL 1.4e-6, 1.0e-6; AKL 3.8e-6, 4.3e-6 (ours in float64: 4.1e-7, 6.4e-8; 5.8e-7, 7.1e-7;
  1.7e-6, 2.1e-6): ROLL's float32 rounding.
"""

from __future__ import annotations

import ast
import os
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional

from pgloss.conformance import sources
from pgloss.vocab.divergence import divergence_from_logits

DIVERGENCE = "roll/pipeline/distill/various_divergence.py"
STRATEGY = "roll/distributed/strategy/strategy.py"
CONFIG = "roll/pipeline/distill/distill_config.py"
METHODS = (
    "compute_forward_kl_divergence",
    "compute_reverse_kl_divergence",
    "compute_adaptive_kl_divergence",
    "compute_skewed_forward_kl_divergence",
    "compute_skewed_reverse_kl_divergence",
)
B, T, V = 3, 5, 37


def _file(relative: str) -> Path:
    root = os.environ.get("PGLOSS_ROLL_SRC")
    if not root:
        pytest.skip("PGLOSS_ROLL_SRC is not set (the root of an alibaba/ROLL checkout)")
    path = Path(root) / relative
    if not path.is_file():
        pytest.skip(f"PGLOSS_ROLL_SRC={root} holds no {relative}")
    return path


class _KeepDtype:
    """`torch` or `torch.nn.functional` with softmax and log_softmax that ignore a `dtype=` (ROLL's float32), so that
    ROLL's lines run in the logits' float64; every other name is the module's own."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def softmax(self, x, dim=-1, dtype=None):
        return self._module.softmax(x, dim=dim)

    def log_softmax(self, x, dim=-1, dtype=None):
        return self._module.log_softmax(x, dim=dim)


def roll(float64: bool):
    """ROLL's methods, cut from its files, in a namespace whose `torch` / `F` keep float64 when `float64`."""
    namespace = {
        "torch": _KeepDtype(torch) if float64 else torch,
        "F": _KeepDtype(torch.nn.functional) if float64 else torch.nn.functional,
    }
    sources.load(_file(DIVERGENCE), METHODS, namespace, within="VariousDivergence")
    sources.load(
        _file(STRATEGY),
        ("op_compute_topk_logits", "op_compute_topk_probs_and_indices"),
        namespace,
        within="InferenceStrategy",
    )
    names = METHODS + ("op_compute_topk_logits", "op_compute_topk_probs_and_indices")
    return type("Roll", (), {name: namespace[name] for name in names})


def config_defaults() -> dict:
    """The `field(default=...)` values of ROLL's DistillConfig, read without importing it."""
    tree = ast.parse(_file(CONFIG).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DistillConfig")
    out = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and isinstance(item.value, ast.Call):
            for keyword in item.value.keywords:
                if keyword.arg == "default":
                    out[item.target.id] = ast.literal_eval(keyword.value)
    return out


def test_roll_defaults_are_ours():
    got = config_defaults()
    assert (got["skew_lambda"], got["adaptive_kl_alpha"], got["kd_temperature"]) == (0.1, 0.5, 1)
    from pgloss.vocab.divergence_choice import DEFAULT_MU, DEFAULT_SKEW

    assert DEFAULT_SKEW == got["skew_lambda"] and DEFAULT_MU == 1 - got["adaptive_kl_alpha"]


def make(seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    student = 2.0 * torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    teacher = 2.0 * torch.randn(B, T, V, generator=gen, dtype=torch.float64)
    upstream = torch.randn(B, T, generator=gen, dtype=torch.float64)
    return student.to(dtype), teacher.to(dtype), upstream.to(dtype)


CASES = [
    ("skewed_forward", "compute_skewed_forward_kl_divergence", 0.1),
    ("skewed_forward", "compute_skewed_forward_kl_divergence", 0.5),
    ("skewed_reverse", "compute_skewed_reverse_kl_divergence", 0.1),
    ("skewed_reverse", "compute_skewed_reverse_kl_divergence", 0.5),
    ("adaptive", "compute_adaptive_kl_divergence", 0.5),
    ("adaptive", "compute_adaptive_kl_divergence", 0.3),
    ("adaptive", "compute_adaptive_kl_divergence", 0.8),
]


def run_roll(method, parameter, student, teacher, temperature, float64):
    cls = roll(float64)
    args = types.SimpleNamespace(skew_lambda=parameter, adaptive_kl_alpha=parameter)
    this = cls()
    this.kd_temperature, this.args = temperature, args
    probs, log_probs, _, inf_mask = this.op_compute_topk_probs_and_indices(
        teacher, topk=0, kd_temperature=temperature, teacher_temperature=1
    )
    return getattr(this, method)(student, probs, log_probs, inf_mask)


def run_ours(name, parameter, student, teacher, temperature, vocab_block):
    params = {"adaptive": dict(mu=1 - parameter)}.get(name, dict(skew=parameter))
    return divergence_from_logits(
        student,
        teacher,
        torch.ones(B, T, dtype=torch.bool),
        divergence=name,
        temperature=temperature,
        chunk_size=4,
        vocab_block=vocab_block,
        **params,
    ).per_token


@pytest.mark.parametrize("vocab_block", [None, 10])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_parity_with_roll(dtype, case, temperature, vocab_block):
    """float64: ROLL's lines in float64 (module docstring) within 1e-10 of ours (measured at most 1.2e-14); float32:
    ROLL's lines unchanged, within float32 rounding of ours in float32 and in float64."""
    name, method, parameter = case
    student, teacher, upstream = make(seed=3, dtype=dtype)
    float64 = dtype == torch.float64
    leaf = student.clone().requires_grad_()
    theirs = run_roll(method, parameter, leaf, teacher, temperature, float64)
    (want,) = torch.autograd.grad((theirs * upstream).sum(), leaf)
    assert theirs.dtype == dtype
    results = [dtype] if float64 else [torch.float32, torch.float64]
    for ours_dtype in results:
        mine = student.to(ours_dtype).clone().requires_grad_()
        ours = run_ours(name, parameter, mine, teacher.to(ours_dtype), temperature, vocab_block)
        (grad,) = torch.autograd.grad((ours * upstream.to(ours_dtype)).sum(), mine)
        tolerance = dict(value=1e-10, grad=1e-10) if float64 else dict(value=5e-6, grad=5e-6)
        torch.testing.assert_close(ours.double(), theirs.double().detach(), rtol=0, atol=tolerance["value"])
        torch.testing.assert_close(grad.double(), want.double(), rtol=0, atol=tolerance["grad"])
    assert theirs.min() > 0
