"""Trinity-RFT 0.6.0's `corrected_k3` (`trinity/algorithm/kl_fn/kl_fn.py` CorrectedK3Fn, read from its released
source under $PGLOSS_TRINITY_SRC; `make test` sets it): k3 · clamp(π_θ/π_old, 0, 2), the ratio differentiable.
pgloss's `kl_correction="ratio_weighted"` (TRL's) does not clamp the ratio; `kl_correction="ratio_clamped"` with
`kl_correction_cap=2.0` is Trinity's, on value and gradient (float64, 1e-12)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

import pytest
import torch
from conftest import make_batch

import pgloss
from pgloss.conformance import sources
from pgloss.kl.corrections import kl_term

KL_FN = "trinity/algorithm/kl_fn/kl_fn.py"


@pytest.fixture(scope="module")
def trinity():
    root = os.environ.get("PGLOSS_TRINITY_SRC")
    if not root:
        pytest.skip("PGLOSS_TRINITY_SRC is not set (the root of the unpacked trinity-rft 0.6.0 wheel)")
    path = Path(root) / KL_FN
    if not path.is_file():
        pytest.skip(f"PGLOSS_TRINITY_SRC={root} holds no {KL_FN}")
    registry = (Path(root) / "trinity/algorithm/kl_fn/__init__.py").read_text()
    assert '"corrected_k3": "trinity.algorithm.kl_fn.kl_fn.CorrectedK3Fn"' in registry
    namespace = {"torch": torch, "ABC": ABC, "abstractmethod": abstractmethod}
    return sources.load(path, ("KLFn", "CorrectedK3Fn"), namespace)["CorrectedK3Fn"]()


def _data(seed):
    data = make_batch(batch=6, length=9, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    noise = torch.randn(data["old_log_prob"].shape, generator=gen, dtype=torch.float64)
    data["log_prob"] = (data["old_log_prob"] + noise).clamp(max=-1e-3)  # ratios well beyond 2 on some tokens
    ratio = (data["log_prob"] - data["old_log_prob"]).exp()[data["mask"]]
    assert bool((ratio > 2).any()) and bool((ratio < 2).any())
    return data


def _value_and_grad(fn, data):
    leaf = data["log_prob"].clone().requires_grad_(True)
    per_token = fn(leaf)
    total = torch.where(data["mask"], per_token, 0.0).sum()
    (grad,) = torch.autograd.grad(total, leaf)
    return torch.where(data["mask"], per_token.detach(), 0.0), grad


@pytest.mark.parametrize("seed", range(4))
def test_ratio_clamped_is_trinity_corrected_k3(trinity, seed):
    data = _data(seed)
    ref, old = data["ref_log_prob"], data["old_log_prob"]
    theirs = _value_and_grad(lambda x: trinity.calculate_kl(x, ref, old), data)
    ours = _value_and_grad(
        lambda x: kl_term(x, ref, old, estimator="k3", correction="ratio_clamped", correction_cap=2.0), data
    )
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(2))
def test_ratio_weighted_differs_from_corrected_k3_where_the_ratio_passes_2(trinity, seed):
    """The documented difference: TRL's form (pgloss's ratio_weighted) weighs by the whole ratio."""
    data = _data(seed)
    ref, old = data["ref_log_prob"], data["old_log_prob"]
    theirs, _ = _value_and_grad(lambda x: trinity.calculate_kl(x, ref, old), data)
    ours, _ = _value_and_grad(lambda x: kl_term(x, ref, old, estimator="k3", correction="ratio_weighted"), data)
    above = data["mask"] & ((data["log_prob"] - old).exp() > 2)
    below = data["mask"] & ~above
    torch.testing.assert_close(ours[below], theirs[below], rtol=0, atol=1e-12)
    assert bool(((ours - theirs)[above].abs() > 1e-9).all())


def test_ratio_clamped_through_an_algorithm():
    """The option on a named algorithm: the KL term is k3·min(r, cap), its gradient 0 through r above the cap."""
    data = _data(0)
    kwargs = dict(ref_log_prob=data["ref_log_prob"])
    base = pgloss.get("grpo", kl_coef=0.0)
    alg = pgloss.get("grpo", kl_coef=0.5, kl_correction="ratio_clamped", kl_correction_cap=2.0)
    x = data["log_prob"].clone().requires_grad_(True)
    y = data["log_prob"].clone().requires_grad_(True)
    args = (data["old_log_prob"], data["advantages"], data["mask"])
    kl_loss = alg(x, *args, **kwargs).loss - base(y, *args).loss
    want = kl_term(data["log_prob"], data["ref_log_prob"], data["old_log_prob"], estimator="k3")
    r = (data["log_prob"] - data["old_log_prob"]).exp().clamp(max=2.0)
    m = data["mask"].double()
    w = m / m.sum(-1, keepdim=True).clamp(min=1) / data["mask"].any(-1).sum()  # seq-mean-token-mean
    torch.testing.assert_close(kl_loss, 0.5 * (w * want * r).sum(), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="kl_correction"):
        pgloss.get("grpo", kl_correction="ratio_clamp")
