"""The OpenRLHF part of `pgloss conformance` on OpenRLHF 0.11.2's loss files: every case agrees or differs as
documented, and a changed OpenRLHF is reported."""

from conformance.trainer_fixtures import trainer_cases, trainer_installed  # noqa: F401 (the fixtures)

from pgloss.conformance import AGREE, DIFFERS, DOCUMENTED
from pgloss.conformance import openrlhf as conformance


def test_every_case_agrees_or_is_documented(cases):
    bad = [c for c in cases if c.status == DIFFERS]
    assert not bad, "\n".join(f"{c.algorithm} {c.setting}: {c.loss_error:.2e} {c.grad_error:.2e}" for c in bad)
    documented = {c.setting: c for c in cases if c.status == DOCUMENTED}
    assert len(documented) == 3 and all("docs/reference.md" in c.reason for c in documented.values())
    # the KL (or entropy) term as a token mean beside a sequence-mean policy term: small but real
    assert all(1e-5 < c.loss_error < 1e-2 and 1e-4 < c.grad_error < 5e-2 for c in documented.values())
    assert sum(c.status == AGREE for c in cases) == 27


def test_coverage(cases):
    """PPO and GSPO, the dual clip, both aggregations, every ratio gate, the binary-KL and TV gates at token and
    sequence level, every KL estimator with and without the unbiased gradient, and the entropy bonus."""
    agree = [c for c in cases if c.status == AGREE]
    assert {c.algorithm for c in agree} == {"ppo", "gspo"}
    settings = " ".join(c.setting for c in agree)
    for piece in (
        "dual_clip=3.0",
        "token_level_loss=False",
        "is_correction_mode='clip'",
        "is_correction_level='seq'",
        "entropy_coef=0.01",
        *(
            f"is_correction_level='{level}', is_correction_gating='{gating}'"
            for level in ("token", "seq")
            for gating in ("binary_kl", "tv")
        ),
    ):
        assert piece in settings
    kl = {c.setting for c in agree if c.function.endswith("compute_approx_kl")}
    assert kl == {
        f"kl_coef=0.01, kl_estimator='{k}', unbiased_gradient={u}" for k in ("k1", "k2", "k3") for u in (False, True)
    }
    # float64 policy terms agree to rounding; the KL, which OpenRLHF computes in float32, to its rounding
    assert max(max(c.loss_error, c.grad_error) for c in agree if c.setting not in kl) < 1e-13
    assert max(max(c.loss_error, c.grad_error) for c in agree if c.setting in kl) < 1e-7


def test_a_changed_trainer_is_reported(installed, monkeypatch):
    """If OpenRLHF's KL changes, its KL cases say DIFFERS (the check can fail)."""
    code = dict(conformance._namespace())
    original = code["compute_approx_kl"]
    code["compute_approx_kl"] = lambda *a, **k: 1.01 * original(*a, **k)
    monkeypatch.setattr(conformance, "_namespace", lambda: code)
    kl = [
        c
        for c in conformance.cases()
        if c.function.endswith("compute_approx_kl") and c.algorithm == "ppo" and "token_level_loss" not in c.setting
    ]
    assert len(kl) == 6 and all(c.status == DIFFERS for c in kl)


def test_unavailable_names_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv(conformance.VARIABLE, str(tmp_path))
    assert conformance.available() == f"${conformance.VARIABLE}={tmp_path} holds no openrlhf/models/loss.py"
    monkeypatch.delenv(conformance.VARIABLE)
    monkeypatch.setattr("pgloss.conformance.sources.distribution", _absent)
    assert conformance.available().startswith("openrlhf is not installed (pip install --no-deps openrlhf==0.11.2")


def _absent(name):
    from importlib.metadata import PackageNotFoundError

    raise PackageNotFoundError(name)
