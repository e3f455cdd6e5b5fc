"""The name table: register, get, names, families; and the options every family shares (KL term, token-sum)."""

import importlib
import pkgutil
import re
from pathlib import Path

import loops
import pytest
import torch
from conftest import make_batch

import pgloss
import pgloss.losses
from pgloss.algorithms import _TABLE, NAMED, SOURCES, ClippedPolicy


@pytest.fixture
def registered():
    """Names registered by a test, removed afterwards so that every other test sees the built-in table."""
    added = []
    yield added
    for name in added:
        NAMED.pop(name, None)
        SOURCES.pop(name, None)


ROOT = Path(__file__).resolve().parents[1]


def test_every_name_has_a_family_a_source_and_builds():
    table = [row[0] for row in _TABLE]
    assert pgloss.names() == table and len(set(table)) == len(table)
    for name in pgloss.names():
        family, defaults = NAMED[name]
        assert issubclass(family, pgloss.Algorithm) and SOURCES[name]
        alg = pgloss.get(name, norm_constant=8.0) if name == "dr_grpo" else pgloss.get(name)
        assert type(alg) is family and alg.name == name
    assert pgloss.families()["DPPO"] == ["dppo_tv", "dppo_kl"]
    assert [n for members in pgloss.families().values() for n in members] == sorted(table, key=table.index)
    assert sorted(n for members in pgloss.families().values() for n in members) == sorted(table)


def _loss_families() -> dict[str, list[type]]:
    """Each file of losses/ -> the Algorithm subclasses it defines (its families, and bases such as
    GroupContrast)."""
    out = {}
    for info in pkgutil.iter_modules(pgloss.losses.__path__):
        module = importlib.import_module(f"pgloss.losses.{info.name}")
        out[info.name] = [
            cls
            for cls in vars(module).values()
            if isinstance(cls, type) and issubclass(cls, pgloss.Algorithm) and cls.__module__ == module.__name__
        ]
    return out


def test_every_family_file_has_a_name():
    """A family in losses/ whose names all left the table fails here (a base of other families, like
    GroupContrast, counts through them), so a name cannot disappear with its whole family unnoticed."""
    named = {family for family, _ in NAMED.values()}
    files = _loss_families()
    assert files["dppo"] == [pgloss.algorithms.DPPO] and files["closed_form"] == []
    for module, classes in files.items():
        for cls in classes:
            assert cls in named or any(issubclass(family, cls) for family in named), (
                f"losses/{module}.py defines {cls.__name__} but no name in algorithms._TABLE uses it"
            )
    assert named <= {cls for classes in files.values() for cls in classes}


def test_every_name_is_documented_and_tested():
    """docs/reference.md's table of algorithms lists exactly the registered names, and each name is
    called by a test under tests/losses/ or tests/test_algorithms.py (its float64 loop): a row that
    leaves the table, or a name added without its documentation or test, fails here."""
    text = (ROOT / "docs" / "reference.md").read_text()
    section = text.split("## The algorithms", 1)[1].split("\n#", 1)[0]
    documented = [m.group(1) for m in re.finditer(r"^\| `([a-z0-9_]+)` \|", section, flags=re.M)]
    assert len(documented) == len(set(documented))
    assert set(documented) == set(pgloss.names()), (
        f"undocumented: {sorted(set(pgloss.names()) - set(documented))}; "
        f"documented but not registered: {sorted(set(documented) - set(pgloss.names()))}"
    )
    tests = "".join(
        path.read_text()
        for path in [*(ROOT / "tests" / "losses").glob("test_*.py"), ROOT / "tests" / "test_algorithms.py"]
    )
    untested = [name for name in pgloss.names() if f'"{name}"' not in tests]
    assert not untested, f"no test under tests/losses/ names {untested}"


def test_register_adds_a_name_that_works_everywhere(registered):
    pgloss.register("dapo_wide", ClippedPolicy, source="a test", loss_agg_mode="token-mean", clip_high=0.4)
    registered.append("dapo_wide")
    assert pgloss.names()[-1] == "dapo_wide" and pgloss.families()["ClippedPolicy"][-1] == "dapo_wide"
    alg = pgloss.get("dapo_wide", clip_low=0.1)
    assert (alg.clip_low, alg.clip_high, alg.loss_agg_mode) == (0.1, 0.4, "token-mean")
    data = make_batch(seed=1)
    reference = pgloss.get("dapo", clip_low=0.1, clip_high=0.4)
    args = (data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    assert torch.equal(alg(*args).loss, reference(*args).loss)


def test_register_takes_a_family_by_the_name_pgloss_list_prints(registered):
    pgloss.register("dapo_named", "ClippedPolicy", clip_high=0.35)
    registered.append("dapo_named")
    assert NAMED["dapo_named"][0] is ClippedPolicy and pgloss.get("dapo_named").clip_high == 0.35
    with pytest.raises(
        ValueError,
        match=r"^family 'ClipedPolicy' is not a registered family \(did you mean "
        r"'ClippedPolicy'\?\); families: ClippedPolicy, ",
    ):
        pgloss.register("mine", "ClipedPolicy")
    assert "mine" not in pgloss.names()


def test_register_refuses_duplicates_bad_families_and_unknown_hyperparameters(registered):
    with pytest.raises(ValueError, match="'grpo' is already registered; taken names: ppo, dual_clip_ppo"):
        pgloss.register("grpo", ClippedPolicy)
    with pytest.raises(TypeError, match="family must be a subclass of pgloss.Algorithm"):
        pgloss.register("mine", dict)
    with pytest.raises(TypeError, match="family must be a subclass of pgloss.Algorithm"):
        pgloss.register("mine", pgloss.Algorithm)
    with pytest.raises(TypeError, match="mine has no hyperparameter 'clip_hihg'"):
        pgloss.register("mine", ClippedPolicy, clip_hihg=0.3)
    with pytest.raises(ValueError, match="identifier"):
        pgloss.register("my loss", ClippedPolicy)
    assert "mine" not in pgloss.names()
    pgloss.register("mine", ClippedPolicy, clip_high=-1.0)  # values are checked when built
    registered.append("mine")
    with pytest.raises(ValueError, match="clip_high must be >= 0"):
        pgloss.get("mine")


def test_a_miss_lists_the_valid_names():
    with pytest.raises(
        ValueError, match=r"unknown algorithm 'gmop' \(did you mean 'gmpo'\?\); valid names: ppo, .*, gmpo, .*, real"
    ):
        pgloss.get("gmop")


def test_cispo_absolute_convention_is_trls_cap():
    data = make_batch(seed=2, spread=0.6)
    alg = pgloss.get("cispo", cispo_convention="absolute", clip_high=1.1)
    out = alg(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    r = torch.exp(data["log_prob"] - data["old_log_prob"])
    adv = data["advantages"][:, None]
    per_token = torch.where(data["mask"], -r.clamp(max=1.1) * adv * data["log_prob"], 0.0)
    torch.testing.assert_close(out.per_token, per_token, rtol=1e-12, atol=1e-14)
    assert (r[data["mask"]] > 1.1).any()  # the cap binds somewhere
    relative = pgloss.get("cispo", clip_high=0.1)  # the same cap written the paper's way
    torch.testing.assert_close(
        relative(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"]).loss,
        out.loss,
        rtol=1e-12,
        atol=1e-14,
    )
    with pytest.raises(ValueError, match="has no lower bound"):
        pgloss.get("cispo", cispo_convention="absolute", clip_low=0.2)
    with pytest.raises(ValueError, match="cispo_convention must be one of"):
        pgloss.get("cispo", cispo_convention="trl")
    assert pgloss.get("cispo").cispo_convention == "relative"


def test_token_sum_is_the_plain_sum():
    data = make_batch(seed=3, per_token_adv=True)
    alg = pgloss.get("gpg", loss_agg_mode="token-sum")
    out = alg(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    expected = loops.aggregate(
        [
            [-a * p for a, p in zip(ra, rp, strict=True)]
            for ra, rp in zip(data["advantages"].tolist(), data["log_prob"].tolist(), strict=True)
        ],
        data["mask"].tolist(),
        "token-sum",
    )
    assert out.loss.item() == pytest.approx(expected, rel=1e-12)
    assert out.loss.item() == pytest.approx(
        float(torch.where(data["mask"], -data["advantages"] * data["log_prob"], 0.0).sum()), rel=1e-12
    )


@pytest.mark.parametrize(
    "option",
    [
        dict(kl_estimator="k3+"),
        dict(kl_correction="ratio_weighted"),
        dict(kl_correction="unbiased_gradient"),
        dict(kl_estimator="k1+"),
    ],
)
def test_kl_options_change_the_kl_term_as_documented(option):
    data = make_batch(seed=4)
    plain = pgloss.get("grpo", kl_coef=0.5)
    alg = pgloss.get("grpo", kl_coef=0.5, **option)
    grads, losses = [], []
    for a in (plain, alg):
        x = data["log_prob"].clone().requires_grad_()
        out = a(x, data["old_log_prob"], data["advantages"], data["mask"], ref_log_prob=data["ref_log_prob"])
        out.loss.backward()
        grads.append(x.grad)
        losses.append(out)
    mask = data["mask"]
    d = data["log_prob"] - data["ref_log_prob"]
    r = torch.exp(data["log_prob"] - data["old_log_prob"])
    m = mask.double()
    w = m / m.sum(-1, keepdim=True).clamp(min=1) / mask.any(-1).sum()  # seq-mean-token-mean weights
    k3_grad = 1 - torch.exp(-d)
    own = {"k3": k3_grad, "k1": torch.ones_like(d)}[option.get("kl_estimator", "k3").rstrip("+")]
    plain_kl_grad = 0.5 * w * k3_grad
    if option.get("kl_estimator", "").endswith("+"):
        new_kl_grad = 0.5 * w * d
    elif option.get("kl_correction") == "ratio_weighted":
        k3 = torch.exp(-d) + d - 1
        new_kl_grad = 0.5 * w * (own * r + k3 * r)
    else:
        new_kl_grad = 0.5 * w * r.clamp(max=10.0) * d
    if option.get("kl_estimator") == "k1+":  # k1's value is reported, k2's gradient is followed
        torch.testing.assert_close(losses[1].metrics["kl"], d[mask].mean())
    torch.testing.assert_close(
        grads[1] - grads[0], torch.where(mask, new_kl_grad - plain_kl_grad, 0.0), rtol=1e-10, atol=1e-13
    )


def test_inspect_closed_form_follows_the_cispo_convention():
    from pgloss.diagnostics.inspect import inspect

    data = make_batch(seed=5, spread=0.6)
    alg = pgloss.get("cispo", cispo_convention="absolute", clip_high=1.1)
    result = inspect(alg, data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    torch.testing.assert_close(result.closed_form, result.policy_grad, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize(
    "name, hyperparameters, message",
    [
        ("gmpo", dict(clip_low=-0.1), "clip_low must be >= 0"),
        ("gmpo", dict(loss_agg_mode="token-mean"), "gmpo defines its loss over sequences"),
        ("clip_cov", dict(clip_cov_ratio=0.0), "clip_cov_ratio must be > 0"),
        ("clip_cov", dict(clip_cov_lb=5.0, clip_cov_ub=1.0), "clip_cov_lb must be < clip_cov_ub"),
        ("kl_cov", dict(kl_cov_ratio=-1e-4), "kl_cov_ratio must be > 0"),
        ("kl_cov", dict(ppo_kl_coef=-0.1), "ppo_kl_coef must be >= 0"),
        ("tis_pg", dict(tis_lower_bound=2.0), "tis bounds must satisfy"),
        ("topr", dict(tis_upper_bound=0.0), "tis bounds must satisfy"),
        ("dppo_tv", dict(divergence="js"), "divergence must be one of"),
        ("dppo_kl", dict(truncation=0.0), "truncation must be > 0"),
        ("dro", dict(dro_beta=0.0), "dro_beta must be > 0"),
        ("vespo", dict(vespo_lambda_neg=-1.0), "vespo_lambda_neg must be >= 0"),
        ("luspo", dict(loss_agg_mode="seq-mean-token-mean"), "luspo defines its loss over sequences"),
        ("ce_gppo", dict(dual_clip=1.0), "dual_clip must be > 1"),
        ("ce_gppo", dict(gppo_beta_low=-0.5), "gppo_beta_low and gppo_beta_high must be >= 0"),
        ("real", dict(real_tau=0.0), "real_tau must be > 0"),
        ("real", dict(loss_agg_mode="token-mean"), "real defines its loss over groups"),
        ("grpo", dict(kl_estimator="k4+"), "kl_estimator must be one of"),
        ("grpo", dict(kl_correction="bias"), "kl_correction must be None or one of"),
        ("grpo", dict(kl_correction_cap=0.0), "kl_correction_cap must be > 0"),
    ],
)
def test_impossible_hyperparameters_of_the_new_families_are_refused(name, hyperparameters, message):
    with pytest.raises(ValueError, match=message):
        pgloss.get(name, **hyperparameters)


def test_clip_cov_generator_must_be_a_generator():
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got int"):
        pgloss.get("clip_cov", generator=3)


def test_a_misspelt_name_is_answered_with_the_closest_one():
    with pytest.raises(ValueError, match=r"unknown algorithm 'grpoo' \(did you mean 'grpo'\?\); valid names: ppo"):
        pgloss.get("grpoo")
    with pytest.raises(TypeError, match=r"no hyperparameter 'clip_hgh' \(did you mean 'clip_high'\?\); valid: "):
        pgloss.get("dapo", clip_hgh=0.3)
    with pytest.raises(ValueError, match=r"unknown algorithm 'zzz'; valid names"):  # nothing close: no guess
        pgloss.recipe("zzz")
