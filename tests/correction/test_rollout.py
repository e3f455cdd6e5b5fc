"""Rollout correction against plain float64 loops: weights, bounds, KL rejection, the off-policy
sequence mask, batch normalisation over a step, the mismatch metrics and bad input."""

import math

import loops
import pytest
import torch
from conftest import log_probs, make_batch

from pgloss.correction.rejection import REJECTION_OPTIONS, Rejection
from pgloss.correction.rollout import RolloutCorrection


def mismatched(seed=0, spread=0.4):
    data = make_batch(batch=7, length=9, seed=seed)
    gen = torch.Generator().manual_seed(seed + 100)
    data["rollout_log_prob"] = log_probs(
        data["old_log_prob"] + spread * torch.randn(data["mask"].shape, generator=gen, dtype=torch.float64)
    )
    return data


def apply(correction, data, **kwargs):
    """The correction of `data` as one call sees it; without `weight_mean`, `data` is the whole step."""
    mask = data["mask"]
    zero = lambda x: torch.where(mask, x, 0.0)  # noqa: E731  (as TokenBatch.prepare hands them over)
    if correction.batch_normalize and "weight_mean" not in kwargs:
        kwargs["weight_mean"] = correction.step_weight_mean(mask, data["old_log_prob"], data["rollout_log_prob"])
    return correction.apply(
        log_prob=zero(data["log_prob"]),
        old_log_prob=zero(data["old_log_prob"]),
        rollout_log_prob=zero(data["rollout_log_prob"]),
        mask=mask,
        seq_advantages=data["advantages"],
        **kwargs,
    )


@pytest.mark.parametrize("level", ["token", "sequence_product", "sequence_geometric"])
@pytest.mark.parametrize(
    "mode, lower, upper", [("truncate", None, 1.1), ("truncate", 0.9, 1.05), ("mask", 0.9, 1.2), ("mask", None, 1.1)]
)
def test_weights_match_loop(level, mode, lower, upper):
    data = mismatched()
    out = apply(RolloutCorrection(weight_level=level, weight_mode=mode, lower=lower, upper=upper), data)
    lists = [data[k].tolist() for k in ("old_log_prob", "rollout_log_prob", "mask")]
    weight, flags = loops.rollout_weights(*lists, level=level, mode=mode, lower=lower, upper=upper)
    torch.testing.assert_close(out.weight, torch.tensor(weight, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert out.weight.requires_grad is False
    mask = data["mask"]
    share = sum(f for row, m in zip(flags, mask.tolist(), strict=True) for f, v in zip(row, m, strict=True) if v) / int(
        mask.sum()
    )
    assert float(out.metrics["rollout_is_bounded_frac"].value) == pytest.approx(share)
    assert share > 0  # the bounds bind: the case tests them
    assert torch.equal(out.mask, mask)


def test_sequence_product_and_geometric_differ_on_long_rows():
    # Σ log ρ grows with length, the mean does not: the product collapses, the geometric mean stays near 1.
    mask = torch.ones(1, 400, dtype=torch.bool)
    old = torch.full((1, 400), -1.0, dtype=torch.float64)
    rollout = old + 0.01
    kw = dict(log_prob=old, old_log_prob=old, rollout_log_prob=rollout, mask=mask)
    prod = RolloutCorrection(weight_level="sequence_product", upper=None).apply(**kw).weight
    geo = RolloutCorrection(weight_level="sequence_geometric", upper=None).apply(**kw).weight
    torch.testing.assert_close(prod[0, 0], torch.tensor(math.exp(-4.0), dtype=torch.float64))
    torch.testing.assert_close(geo[0, 0], torch.tensor(math.exp(-0.01), dtype=torch.float64))


@pytest.mark.parametrize("option", REJECTION_OPTIONS)
def test_kl_rejection_matches_verl_loop(option):
    data = mismatched(seed=3)
    bounds = (
        dict(upper=1.3, lower=0.8)
        if option.endswith("k1")
        else dict(upper=0.05 if "token" in option or "mean" in option else 0.3)
    )
    if option.startswith("seq_max"):
        bounds = dict(upper=1.6, lower=0.5) if option.endswith("k1") else dict(upper=0.2)
    if option == "seq_min_k1":  # SkyRL outlier_token_is_threshold_high = H: lower = 1/H
        bounds = dict(upper=None, lower=1 / 1.5)
    out = apply(RolloutCorrection(weight_level=None, rejection=(Rejection(option, **bounds),)), data)
    keep = loops.kl_rejection_keep(
        data["old_log_prob"].tolist(),
        data["rollout_log_prob"].tolist(),
        data["mask"].tolist(),
        option,
        bounds["upper"],
        bounds.get("lower"),
    )
    expected = data["mask"] & torch.tensor(keep)
    assert torch.equal(out.mask, expected)
    assert 0 < int(expected.sum()) < int(data["mask"].sum()), "the rule should reject some tokens, not all"
    torch.testing.assert_close(
        out.metrics["rollout_rejected_frac"].value, 1 - expected.sum() / data["mask"].sum(), check_dtype=False
    )


def test_rejections_chain_with_and():
    data = mismatched(seed=3)
    a, b = Rejection("token_k2", 0.05), Rejection("seq_mean_k1", 1.1, 0.9)
    both = apply(RolloutCorrection(weight_level=None, rejection=(a, b)), data).mask
    one = apply(RolloutCorrection(weight_level=None, rejection=(a,)), data).mask
    two = apply(RolloutCorrection(weight_level=None, rejection=(b,)), data).mask
    assert torch.equal(both, one & two) and not torch.equal(both, one) and not torch.equal(both, two)
    counted = RolloutCorrection(weight_level=None, rejection=(a, b)).keep_mask(
        data["mask"], data["old_log_prob"], data["rollout_log_prob"]
    )
    assert torch.equal(counted, both)  # the step counts the tokens the call keeps


def test_ms_swift_sequence_mask_is_token_weight_with_geometric_rejection():
    # ms-swift `sequence_mask`: w_t = ρ_t · 1[exp(mean log ρ) ≤ C]; here a token weight and a seq_mean_k1 rule.
    data, cap = mismatched(seed=5, spread=0.3), 1.05
    out = apply(
        RolloutCorrection(
            weight_level="token", upper=None, rejection=(Rejection("seq_mean_k1", upper=None, lower=1 / cap),)
        ),
        data,
    )
    m = data["mask"]
    log_rho = torch.where(m, data["old_log_prob"] - data["rollout_log_prob"], 0.0)
    seq_ok = (log_rho.sum(-1) / m.sum(-1).clamp(min=1)).exp() <= cap
    expected = torch.where(m & seq_ok[:, None], log_rho.exp(), 0.0)
    torch.testing.assert_close(out.weight, expected, rtol=1e-12, atol=0)
    assert 0 < int(seq_ok[m.any(-1)].sum()) < int(m.any(-1).sum())


def test_off_policy_sequence_mask_matches_loop():
    data = mismatched(seed=10, spread=0.5)
    lists = [data[k].tolist() for k in ("log_prob", "rollout_log_prob", "advantages", "mask")]
    kept = []
    for delta in (0.0, 0.1, 0.3):
        out = apply(RolloutCorrection(weight_level=None, off_policy_mask=delta), data)
        keep = torch.tensor(loops.opsm_keep(*lists, delta))
        assert torch.equal(out.mask, data["mask"] & keep[:, None])
        kept.append(int(keep.sum()))
    assert kept[0] < kept[-1], "a larger δ keeps more sequences"


def test_off_policy_mask_without_rollout_uses_old():
    data = mismatched(seed=7, spread=0.5)
    data["old_log_prob"] = data.pop("rollout_log_prob")
    out = RolloutCorrection(weight_level=None, off_policy_mask=0.1).apply(
        log_prob=data["log_prob"],
        old_log_prob=data["old_log_prob"],
        rollout_log_prob=None,
        mask=data["mask"],
        seq_advantages=data["advantages"],
    )
    keep = loops.opsm_keep(
        data["log_prob"].tolist(),
        data["old_log_prob"].tolist(),
        data["advantages"].tolist(),
        data["mask"].tolist(),
        0.1,
    )
    assert torch.equal(out.mask, data["mask"] & torch.tensor(keep)[:, None])


def test_bypass_uses_rollout_as_old_and_detached_current_policy():
    data = mismatched(seed=2)
    log_prob = data["log_prob"].clone().requires_grad_(True)
    data_b = dict(data, log_prob=log_prob)
    out = apply(RolloutCorrection(bypass=True, upper=1.5), data_b)
    m = data["mask"]
    assert torch.equal(out.old_log_prob, torch.where(m, data["rollout_log_prob"], 0.0))
    expected = torch.where(m, (data["log_prob"] - data["rollout_log_prob"]).exp().clamp(max=1.5), 0.0)
    torch.testing.assert_close(out.weight, expected, rtol=1e-12, atol=0)
    assert not out.weight.requires_grad


@pytest.mark.parametrize("level", ["token", "sequence_product", "sequence_geometric"])
def test_batch_normalized_weights_match_loop_and_are_split_invariant(level):
    data = mismatched(seed=4, spread=0.3)
    corr = RolloutCorrection(weight_level=level, upper=1.5, batch_normalize=True)
    whole = apply(corr, data)
    lists = [data[k].tolist() for k in ("old_log_prob", "rollout_log_prob", "mask")]
    weight, _ = loops.rollout_weights(*lists, level=level, mode="truncate", lower=None, upper=1.5, batch_normalize=True)
    torch.testing.assert_close(whole.weight, torch.tensor(weight, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    parts = [slice(0, 2), slice(2, 7)]
    mean = corr.step_weight_mean(
        [data["mask"][p] for p in parts],
        [data["old_log_prob"][p] for p in parts],
        [data["rollout_log_prob"][p] for p in parts],
    )
    pieces = [
        apply(corr, {k: v[p] for k, v in data.items() if k != "group_ids"}, weight_mean=mean).weight for p in parts
    ]
    torch.testing.assert_close(torch.cat(pieces), whole.weight, rtol=1e-12, atol=1e-14)
    local = apply(corr, {k: v[parts[0]] for k, v in data.items() if k != "group_ids"}).weight
    assert not torch.allclose(local, whole.weight[parts[0]]), "a local mean would differ: the test can fail"


def test_weight_metrics_and_ess():
    data = mismatched(seed=1)
    out = apply(RolloutCorrection(upper=1.5), data)
    m = data["mask"]
    w = out.weight[m]
    metrics = {k: stat.value for k, stat in out.metrics.items()}
    torch.testing.assert_close(metrics["rollout_is_weight_min"], w.min())
    torch.testing.assert_close(metrics["rollout_is_weight_max"], w.max())
    torch.testing.assert_close(metrics["rollout_is_weight_mean"], w.mean())
    torch.testing.assert_close(metrics["rollout_is_ess"], w.mean() ** 2 / (w**2).mean())
    seq = apply(RolloutCorrection(weight_level="sequence_product", upper=None), data)
    per_row = seq.weight.amax(-1)[m.any(-1)]
    torch.testing.assert_close(seq.metrics["rollout_is_weight_mean"].value, per_row.mean())
    torch.testing.assert_close(seq.metrics["rollout_is_ess"].value, per_row.mean() ** 2 / (per_row**2).mean())
    assert all(v.requires_grad is False and v.ndim == 0 for v in metrics.values())


def test_mismatch_metrics_match_verl_loop():
    data = mismatched(seed=6)
    out = apply(RolloutCorrection(weight_level=None, rejection=()), data)
    expected = loops.mismatch(data["old_log_prob"].tolist(), data["rollout_log_prob"].tolist(), data["mask"].tolist())
    for name, value in expected.items():
        assert float(out.metrics[name].value) == pytest.approx(value, rel=1e-12), name


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(weight_level="seq"), ValueError, "weight_level"),
        (dict(weight_mode="clip"), ValueError, "weight_mode"),
        (dict(lower=2.0, upper=1.0), ValueError, "lower <= upper"),
        (dict(upper=0.0), ValueError, "upper > 0"),
        (dict(upper="2"), TypeError, "upper"),
        (dict(upper=math.inf), ValueError, "upper must be finite"),
        (dict(weight_mode="mask", upper=None), ValueError, "needs a lower or an upper"),
        (dict(rejection=("token_k1",)), TypeError, "rejection"),
        (dict(off_policy_mask=-1.0), ValueError, "off_policy_mask"),
        (dict(bypass=1), TypeError, "bypass"),
        (dict(batch_normalize=True, bypass=True), ValueError, "bypass"),
        (dict(batch_normalize=True, weight_level=None), ValueError, "weight_level"),
        (dict(max_log_ratio=0.0), ValueError, "max_log_ratio"),
    ],
)
def test_bad_configuration_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        RolloutCorrection(**kwargs)


@pytest.mark.parametrize(
    "args, match",
    [
        (("token_k4", 1.0), "option must be one of"),
        (("token_k2", None), "upper >= 0"),
        (("token_k3", 0.1, 0.01), "only an upper bound"),
        (("seq_mean_k1", None), "needs a ratio bound"),
        (("seq_sum_k1", 0.5, 2.0), "lower <= upper"),
        (("token_k1", -1.0), "must be > 0"),
    ],
)
def test_bad_rejection_is_refused(args, match):
    with pytest.raises(ValueError, match=match):
        Rejection(*args)


def test_missing_inputs_are_named():
    data = mismatched()
    with pytest.raises(ValueError, match="rollout_log_prob"):
        RolloutCorrection().apply(
            log_prob=data["log_prob"], old_log_prob=data["old_log_prob"], rollout_log_prob=None, mask=data["mask"]
        )
    with pytest.raises(ValueError, match="off_policy_mask needs advantages"):
        RolloutCorrection(off_policy_mask=0.1).apply(
            log_prob=data["log_prob"],
            old_log_prob=data["old_log_prob"],
            rollout_log_prob=data["rollout_log_prob"],
            mask=data["mask"],
        )
    with pytest.raises(ValueError, match="batch_normalize is False"):
        apply(RolloutCorrection(), data, weight_mean=torch.tensor(1.0))


def test_normalizer_counts_kept_tokens_and_carries_the_weight_mean():
    import pgloss

    data = mismatched(seed=3)
    corr = RolloutCorrection(upper=1.5, batch_normalize=True, rejection=(Rejection("token_k2", 0.05),))
    parts = [slice(0, 3), slice(3, 7)]
    args = (
        [data["mask"][p] for p in parts],
        [data["old_log_prob"][p] for p in parts],
        [data["rollout_log_prob"][p] for p in parts],
    )
    norm = corr.normalizer(*args)
    kept = [corr.keep_mask(*a) for a in zip(*args, strict=True)]
    expected = pgloss.Normalizer.count(kept)
    assert isinstance(norm, pgloss.Normalizer)
    assert float(norm.tokens) == float(expected.tokens) < float(data["mask"].sum())
    assert float(norm.sequences) == float(expected.sequences)
    torch.testing.assert_close(corr.weight_mean(norm), corr.step_weight_mean(*args))
    assert float(corr.normalizer(*args, count_rejected=True).tokens) == float(data["mask"].sum())
    assert RolloutCorrection().weight_mean(RolloutCorrection().normalizer(*args)) is None


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_batches_give_nan_metrics_and_no_error(shape):
    zeros = torch.zeros(shape, dtype=torch.float64)
    mask = torch.ones(shape, dtype=torch.bool)
    corr = RolloutCorrection(
        weight_level="sequence_geometric",
        batch_normalize=True,
        off_policy_mask=0.1,
        rejection=(Rejection("seq_max_k3", 0.1), Rejection("seq_sum_k1", 2.0)),
    )
    out = apply(
        corr,
        dict(
            log_prob=zeros,
            old_log_prob=zeros,
            rollout_log_prob=zeros,
            mask=mask,
            advantages=torch.zeros(shape[0], dtype=torch.float64),
        ),
    )
    assert out.weight.shape == shape and out.mask.shape == shape
    assert torch.isnan(out.metrics["rollout_is_weight_mean"].value) and torch.isnan(out.metrics["rollout_kl"].value)
