"""The verl part of `pgloss conformance` on verl 0.9.1: every case agrees or differs as documented."""

import pytest

pytest.importorskip("verl")

from pgloss.conformance import AGREE, DIFFERS, DOCUMENTED
from pgloss.conformance import verl as conformance
from pgloss.trainer_options.verl import LOSS_MODES


@pytest.fixture(scope="module")
def cases():
    return list(conformance.cases())


def test_interface():
    assert conformance.TRAINER == "verl"
    assert conformance.available() is None  # None: verl 0.9.1 is importable and its cases run


def test_every_case_agrees_or_is_documented(cases):
    bad = [c for c in cases if c.status == DIFFERS]
    assert not bad, "\n".join(f"{c.function} {c.setting}: {c.loss_error:.2e} {c.grad_error:.2e}" for c in bad)
    documented = [c for c in cases if c.status == DOCUMENTED]
    assert [(c.function, c.algorithm) for c in documented] == [("compute_policy_loss_geo_mean", "gmpo")]
    assert documented[0].loss_error == pytest.approx(0.2, rel=1e-6)  # one empty row of six: 6/5 - 1
    assert "docs/reference.md" in documented[0].reason


def test_coverage(cases):
    """Every verl loss pgloss computes, under each of verl's five modes, and every verl KL type."""
    policy = {(c.function, c.setting.split(",")[0]) for c in cases if c.function != "kl_penalty"}
    assert len(policy) == 5 * len(LOSS_MODES)
    assert {c.setting for c in cases if c.function == "kl_penalty"} == {f"kl_penalty={k}" for k in conformance.KL_TYPES}
    assert sum(c.status == AGREE for c in cases) == len(cases) - 1


def test_a_changed_trainer_is_reported(monkeypatch):
    """If verl's function changes, its cases say DIFFERS (the check can fail)."""
    from verl.trainer.ppo import core_algos

    original = core_algos.kl_penalty
    monkeypatch.setattr(core_algos, "kl_penalty", lambda lp, ref, kind: 1.01 * original(lp, ref, kind))
    kl = [conformance._kl_case(kind, seed=1) for kind in conformance.KL_TYPES]
    assert kl and all(c.status == DIFFERS for c in kl)
