"""The ms-swift part of `pgloss conformance` on ms-swift 4.6.0's GRPO loss: every case agrees or differs as
documented, and a changed ms-swift is reported."""

import pytest
from conformance.trainer_fixtures import trainer_cases, trainer_installed  # noqa: F401 (the fixtures)

from pgloss.conformance import AGREE, DIFFERS, DOCUMENTED
from pgloss.conformance import ms_swift as conformance


def test_every_case_agrees_or_is_documented(cases):
    bad = [c for c in cases if c.status == DIFFERS]
    assert not bad, "\n".join(f"{c.algorithm} {c.setting}: {c.loss_error:.2e} {c.grad_error:.2e}" for c in bad)
    documented = {(c.algorithm, c.setting): c for c in cases if c.status == DOCUMENTED}
    assert set(documented) == {
        ("grpo", "beta=0.0, an empty completion"),
        ("dr_grpo", "beta=0.0, an empty completion"),
        ("bnpo", "beta=0.0, off_policy_sequence_mask_delta=0.02"),
        ("dapo", "beta=0.0, top_entropy_quantile=0.5"),
        ("real", "defaults"),
    }
    for key in [("grpo", "beta=0.0, an empty completion"), ("dr_grpo", "beta=0.0, an empty completion")]:
        assert documented[key].loss_error == pytest.approx(0.2, rel=1e-9)  # one empty row of six: 6/5 - 1
    assert documented[("dapo", "beta=0.0, top_entropy_quantile=0.5")].loss_error == pytest.approx(1.0, abs=0.1)
    assert 1e-6 < documented[("real", "defaults")].loss_error < 1e-3  # REAL's KL: token mean vs per group
    assert all("docs/reference.md" in c.reason for c in documented.values())
    agree = [c for c in cases if c.status == AGREE]
    assert len(agree) == 42 and max(max(c.loss_error, c.grad_error) for c in agree) < 1e-12


def test_coverage(cases):
    """Every ms-swift loss_type pgloss computes, the three ratio levels, and the four rollout IS modes."""
    agree = [c for c in cases if c.status == AGREE]
    assert {c.algorithm for c in agree} == {"grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "fipo", "real"}
    settings = " ".join(c.setting for c in agree)
    for piece in (
        "importance_sampling_level='sequence'",
        "importance_sampling_level='sequence_token'",
        *[
            f"rollout_importance_sampling_mode='{m}'"
            for m in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
        ],
        "off_policy_sequence_mask_delta",
        "delta=1.5",
        "fipo_clip_range=None",
        "real_tau=0.2",
    ):
        assert piece in settings, piece


def test_a_changed_trainer_is_reported(monkeypatch):
    """If ms-swift's rollout importance weights change, the cases that use them say DIFFERS."""
    code, defaults = conformance._code()
    code = dict(code)
    original = code["_apply_rollout_importance_sampling"]
    code["_apply_rollout_importance_sampling"] = lambda self, *a: 1.01 * original(self, *a)
    monkeypatch.setattr(conformance, "_code", lambda: (code, defaults))
    weighted = [c for c in conformance.cases() if "rollout_importance_sampling_mode" in c.setting]
    assert len(weighted) == 16 and all(c.status == DIFFERS for c in weighted)
