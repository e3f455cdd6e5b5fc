"""The Liger-Kernel part of `pgloss conformance` on liger-kernel 0.8.5: every case agrees or differs as
documented, and a changed Liger is reported."""

import functools

import pytest
from conformance.trainer_fixtures import trainer_cases, trainer_installed  # noqa: F401 (the fixtures)

from pgloss.conformance import AGREE, DIFFERS, DOCUMENTED
from pgloss.conformance import liger as conformance


def test_every_case_agrees_or_is_documented(cases):
    bad = [c for c in cases if c.status == DIFFERS]
    assert not bad, "\n".join(f"{c.algorithm} {c.setting}: {c.loss_error:.2e} {c.grad_error:.2e}" for c in bad)
    documented = {(c.algorithm, c.setting): c for c in cases if c.status == DOCUMENTED}
    assert set(documented) == {
        ("luspo", "beta=0.0"),
        ("grpo", "beta=0.0, an empty completion"),
        ("dr_grpo", "beta=0.0, an empty completion"),
        ("grpo", "log π 3.0 below log π_ref"),
    }
    assert documented[("grpo", "beta=0.0, an empty completion")].loss_error == pytest.approx(0.2, rel=1e-9)
    assert documented[("luspo", "beta=0.0")].grad_error > 0.1  # Liger's gradient reaches the padded positions
    assert all("docs/reference.md" in c.reason for c in documented.values())
    agree = [c for c in cases if c.status == AGREE]
    assert len(agree) == 39


def test_coverage(cases):
    """Every Liger loss_type, on log-probs (to rounding) and through the fused route (to float32's)."""
    agree = [c for c in cases if c.status == AGREE]
    on_log_probs = [c for c in agree if c.function.endswith("ppo_loss_fn")]
    assert {c.algorithm for c in on_log_probs} == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo"}
    assert max(max(c.loss_error, c.grad_error) for c in on_log_probs) < 1e-13
    fused = [c for c in agree if "hidden states" in c.function]
    assert len(fused) == 2 and all(1e-9 < max(c.loss_error, c.grad_error) < 1e-5 for c in fused)


def test_a_changed_trainer_is_reported(monkeypatch):
    """If Liger's loss changes, its cases say DIFFERS (the check can fail)."""
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

    original = LigerFusedLinearGRPOFunction.ppo_loss_fn

    @functools.wraps(original)  # the same signature: the options still reach it
    def changed(*args, **kwargs):
        loss, metrics = original(*args, **kwargs)
        return 1.01 * loss, metrics

    monkeypatch.setattr(LigerFusedLinearGRPOFunction, "ppo_loss_fn", staticmethod(changed))
    loss_error, grad_error = conformance.compare(dict(loss_type="grpo"))
    assert loss_error == pytest.approx(1 - 1 / 1.01, rel=1e-6) and grad_error == pytest.approx(1 - 1 / 1.01, rel=1e-6)
    assert all(
        c.status == DIFFERS for c in conformance.cases() if c.function.endswith("ppo_loss_fn") and c.reason is None
    )
