"""Every kind of bad input gets a ValueError/TypeError naming the argument, or a documented result."""

import math

import numpy as np
import pytest
import torch
from conftest import algorithm, make_batch, optional_inputs

import pgloss
from pgloss.advantages import gae
from pgloss.kl.estimators import AdaptiveKLController, kl_penalized_rewards

NAMES = pgloss.names()


def call(alg, data, **extra):
    return alg(
        data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"], **(optional_inputs(data) | extra)
    )


def numeric_fields(alg):
    """(name, value) of every real-valued hyperparameter of `alg` that is set."""
    return [(k, v) for k, v in alg.describe().items() if isinstance(v, float)]


@pytest.mark.parametrize("name", NAMES)
def test_every_numeric_hyperparameter_must_be_a_finite_real(name):
    alg = algorithm(name)
    for field, _ in numeric_fields(alg):
        with pytest.raises(TypeError, match=rf"{field} must be a real number.*got '0.2' \(str\)"):
            algorithm(name, **{field: "0.2"})
        with pytest.raises(TypeError, match=rf"{field} must be a real number.*got True \(bool\)"):
            algorithm(name, **{field: True})
        for bad in (math.nan, math.inf, -math.inf):
            with pytest.raises(ValueError, match=rf"{field} must be finite, got {bad}"):
                algorithm(name, **{field: bad})


def test_numbers_of_other_real_types_are_accepted_as_floats():
    alg = pgloss.get("ppo", clip_low=np.float32(0.25), clip_high=1)
    assert type(alg.clip_low) is float and alg.clip_low == pytest.approx(0.25)
    assert type(alg.clip_high) is float and alg.clip_high == 1.0


@pytest.mark.parametrize(
    "field, value, error, message",
    [
        ("max_log_ratio", True, TypeError, "max_log_ratio must be a real number"),
        ("loss_agg_mode", None, TypeError, "loss_agg_mode must be a str, got None"),
        ("kl_estimator", 3, TypeError, "kl_estimator must be a str, got 3"),
        ("dual_clip", "3", TypeError, "dual_clip must be a real number or None"),
        ("kl_coef", torch.tensor(0.1), TypeError, "kl_coef must be a real number"),
    ],
)
def test_other_types_are_refused_by_name(field, value, error, message):
    with pytest.raises(error, match=message):
        pgloss.get("ppo", **{field: value})


def test_fipo_names_ratio_level_before_the_aggregation_it_conflicts_with():
    with pytest.raises(ValueError, match="fipo uses token ratios, got ratio_level='sequence'"):
        pgloss.get("fipo", ratio_level="sequence")


def test_fipo_clip_range_zero_is_refused_and_none_disables_clipping():
    with pytest.raises(ValueError, match="fipo_clip_range must lie in \\(0, 1\\), or be None for no clipping"):
        pgloss.get("fipo", fipo_clip_range=0)
    assert pgloss.get("fipo", fipo_clip_range=None).fipo_clip_range is None


def test_normalizer_of_the_wrong_type_is_a_type_error():
    data = make_batch(seed=1)
    with pytest.raises(TypeError, match="normalizer must be a pgloss.Normalizer .* got int"):
        call(pgloss.get("dapo"), data, normalizer=1024)
    with pytest.raises(TypeError, match="normalizer must be a pgloss.Normalizer .* got Tensor"):
        call(pgloss.get("dapo"), data, normalizer=data["mask"].sum())


def test_group_ids_outside_the_normalizer_are_refused():
    data = make_batch(seed=2)
    alg = pgloss.get("dapo", loss_agg_mode="group-mean-token-mean")
    normalizer = pgloss.Normalizer.count(data["mask"], group_ids=data["group_ids"])  # groups 0 and 1
    for bad in (-1, 2):
        ids = data["group_ids"].clone()
        ids[4] = bad
        with pytest.raises(ValueError, match=rf"group_ids must lie in \[0, 2\) .* got {bad} at row 4"):
            call(alg, data, normalizer=normalizer, group_ids=ids)


def test_huge_group_ids_are_refused_before_allocating():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="group_ids\\[0\\] must number the step's groups from 0 .* got id 10000000000"):
        pgloss.Normalizer.count(mask, group_ids=torch.tensor([0, 10**10]))
    with pytest.raises(ValueError, match="group_ids\\[0\\] must be non-negative, got -3"):
        pgloss.Normalizer.count(mask, group_ids=torch.tensor([0, -3]))
    with pytest.raises(ValueError, match="group_ids\\[0\\] must be integers of shape \\(2,\\)"):
        pgloss.Normalizer.count(mask, group_ids=torch.tensor([0.0, 1.0]))


def test_kl_penalized_rewards_checks_its_inputs():
    rewards = torch.zeros(2, 3)
    good = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(
        ValueError, match="ref_log_prob must have the shape of token_rewards \\(2, 3\\), got \\(2, 2\\)"
    ):
        kl_penalized_rewards(rewards, good, good[:, :2], mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="mask must have shape"):
        kl_penalized_rewards(rewards, good, good, mask[:1], kl_coef=0.1)
    with pytest.raises(TypeError, match="old_log_prob must be a torch.Tensor"):
        kl_penalized_rewards(rewards, [0.0], good, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl_penalized_rewards(rewards, good, good, mask, kl_coef=0.1, estimator="k5")


def test_gae_ignores_non_finite_values_at_masked_positions():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    values = torch.randn(3, 6, generator=gen, dtype=torch.float64)
    mask = torch.rand(3, 6, generator=gen) > 0.3
    clean = gae(rewards, values, mask, gamma=0.99, lam=0.95)
    poisoned_r, poisoned_v = rewards.clone(), values.clone()
    poisoned_r[~mask], poisoned_v[~mask] = math.nan, math.inf
    dirty = gae(poisoned_r, poisoned_v, mask, gamma=0.99, lam=0.95)
    for a, b in zip(clean, dirty, strict=True):
        assert torch.equal(a, b)


def test_gae_of_an_empty_batch_is_empty():
    for shape in ((2, 0), (0, 4)):
        adv, ret = gae(torch.zeros(shape), torch.zeros(shape), torch.ones(shape, dtype=torch.bool), gamma=1.0, lam=1.0)
        assert adv.shape == shape and ret.shape == shape
    with pytest.raises(TypeError, match="values must be a torch.Tensor"):
        gae(torch.zeros(1, 2), [[0.0, 0.0]], torch.ones(1, 2), gamma=1.0, lam=1.0)


def test_adaptive_controller_refuses_a_non_finite_kl():
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError, match="current_kl must be finite"):
            ctl.update(bad, 256)
    with pytest.raises(TypeError, match="current_kl must be a real number"):
        ctl.update("1.0", 256)
    with pytest.raises(ValueError, match="n_steps must be an integer >= 0"):
        ctl.update(1.0, -1)
    assert ctl.value == 0.1
    with pytest.raises(ValueError, match="value must be finite"):
        AdaptiveKLController(value=math.nan, target=6.0, horizon=1.0)


# ----- the opt-in anomaly mode -----


def poison(data, key, row, column, value):
    out = {k: v.clone() for k, v in data.items()}
    if out[key].ndim == 1:
        out[key][row] = value
    else:
        out[key][row, column] = value
    return out


def first_valid(mask):
    row, column = mask.nonzero()[1].tolist()  # not (0, 0): the message must name the real position
    return row, column


@pytest.mark.parametrize(
    "key, value",
    [
        ("log_prob", math.nan),
        ("log_prob", -math.inf),
        ("old_log_prob", -math.inf),
        ("ref_log_prob", math.nan),
        ("entropy", math.nan),
    ],
)
def test_detect_anomaly_names_the_tensor_and_the_first_bad_position(key, value):
    data = make_batch(seed=4, per_token_adv=True)
    row, column = first_valid(data["mask"])
    bad = poison(data, key, row, column, value)
    alg = pgloss.get("grpo", entropy_coef=0.01)
    call(alg, bad)  # by default nothing is checked (no sync): the value follows torch's arithmetic
    with pgloss.detect_anomaly():
        with pytest.raises(ValueError, match=rf"{key} is {value} at a valid position \(row {row}, column {column}\)"):
            call(alg, bad)


def test_detect_anomaly_finds_a_nan_sequence_advantage():
    data = make_batch(seed=5)
    bad = poison(data, "advantages", 2, None, math.nan)
    with pgloss.detect_anomaly(), pytest.raises(ValueError, match="advantages is nan at a valid position \\(row 2"):
        call(pgloss.get("dapo"), bad)


@pytest.mark.parametrize("name", NAMES)
def test_detect_anomaly_passes_clean_batches_and_masked_poison(name):
    data = make_batch(seed=6, per_token_adv=True)
    alg = algorithm(name, kl_coef=0.1)
    expected = call(alg, data).loss
    masked = {k: v.clone() for k, v in data.items()}
    for key in ("log_prob", "old_log_prob", "ref_log_prob", "teacher_log_prob", "advantages"):
        masked[key][~data["mask"]] = math.nan
    with pgloss.detect_anomaly():
        assert torch.equal(call(alg, masked).loss, expected)


def test_detect_anomaly_is_scoped():
    assert not pgloss.checks.anomaly_enabled()
    with pgloss.detect_anomaly():
        assert pgloss.checks.anomaly_enabled()
        with pgloss.detect_anomaly(False):
            assert not pgloss.checks.anomaly_enabled()
        assert pgloss.checks.anomaly_enabled()
    assert not pgloss.checks.anomaly_enabled()
