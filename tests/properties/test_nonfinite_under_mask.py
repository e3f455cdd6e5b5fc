"""Non-finite values under the mask never reach a value, a gradient or a metric (DESIGN.md, "One effective
mask"), on every path of the plain call: every registered name, every loss_agg_mode, every KL estimator and
its corrections, every kind of rollout correction, with or without the step's `Normalizer` (counted on the
poisoned tensors), and every real input of the call (the tensors of `core/inputs.py`'s table included, so a
new input is covered when it is added).

"Under the mask" means a position whose mask is 0 for a `[B, T]` input, and a row with no valid token for a
`[B]` input (`advantages` of one value per sequence, `scores`). NaN, +inf and -inf are put at random such
positions of random inputs; the loss, `per_token`, every metric and every gradient (∂/∂log_prob and the other
inputs that keep theirs) must equal, bit for bit, the run with finite values there, and ∂/∂input at masked
positions must be exactly 0.

Where the mask is 1 the behaviour is today's, as `pgloss.core.checks` documents it (held by the last tests).
"""

import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from properties.call_inputs import LEAVES, ROW_INPUTS, ROWS, TOKEN_INPUTS, WIDTH, call_with_gradients, finite_inputs

import pgloss
from pgloss.core.aggregate import AGGREGATIONS
from pgloss.core.inputs import OPTIONAL_INPUTS
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection
from pgloss.kl.corrections import FULL, KL_CORRECTIONS, KL_OPTIONS

POISONS = (math.nan, math.inf, -math.inf)
REAL_INPUTS = TOKEN_INPUTS + ROW_INPUTS + ("advantages",)
"""Every real input of the call: where a non-finite value can be."""

CORRECTIONS = {
    "none": None,
    "token TIS": RolloutCorrection(upper=1.5),
    "token IcePop": RolloutCorrection(weight_mode="mask", lower=0.5, upper=1.5),
    "sequence product": RolloutCorrection(weight_level="sequence_product", upper=2.0),
    "sequence geometric, batch-normalised": RolloutCorrection(
        weight_level="sequence_geometric", lower=0.5, upper=2.0, batch_normalize=True
    ),
    "token batch-normalised, KL weighted": RolloutCorrection(upper=2.0, batch_normalize=True, weight_kl=True),
    "chained rejection": RolloutCorrection(
        weight_level=None,
        rejection=(
            Rejection("token_k1", upper=2.0),
            Rejection("seq_mean_k3", upper=0.5),
            Rejection("seq_max_k2", upper=1.0),
            Rejection("seq_sum_k2", upper=2.0),
        ),
    ),
    "off-policy mask": RolloutCorrection(weight_level=None, off_policy_mask=0.05),
    "bypass": RolloutCorrection(bypass=True, upper=1.5, off_policy_mask=0.05),
}


def configurations():
    """Every registered name with every loss_agg_mode its family allows."""
    for name in pgloss.names():
        fixed = pgloss.get(name, generation_budget=WIDTH).fixed_agg_mode
        for mode in [fixed] if fixed else AGGREGATIONS:
            yield pytest.param(name, mode, id=f"{name}-{mode}")


def build(name, mode, estimator, kl_correction, correction):
    if pgloss.get(name, generation_budget=WIDTH).consumes_rollout_log_prob:
        correction = None  # VESPO folds the rollout log-probs into its own weight and takes no correction
    return pgloss.get(
        name,
        generation_budget=WIDTH,
        loss_agg_mode=mode,
        kl_coef=0.1,
        kl_estimator=estimator,
        kl_correction=None if estimator == FULL else kl_correction,
        entropy_coef=0.01,
        positive_nll_coef=0.1,
        rollout_correction=correction,
    )


def poisoned(values, seed, inputs, share=0.5):
    """`values` with NaN, +inf or -inf at random masked positions of each of `inputs` (a `share` of them)."""
    g = torch.Generator().manual_seed(seed)
    mask = values["mask"]
    out = dict(values)
    for name in inputs:
        value = values[name]
        hole = ~mask if value.ndim == 2 else ~mask.any(dim=-1)
        chosen = hole & (torch.rand(value.shape, generator=g) < share)
        fill = torch.tensor(POISONS, dtype=value.dtype)[torch.randint(0, len(POISONS), value.shape, generator=g)]
        out[name] = torch.where(chosen, fill, value)
    return out


def assert_same(got, expected, what):
    """Equal bit for bit, NaN where NaN (a metric over no valid token is NaN in both runs)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape, what
    assert torch.equal(got.isnan(), expected.isnan()), f"{what}: NaN at other places"
    assert torch.equal(torch.nan_to_num(got, nan=0.0), torch.nan_to_num(expected, nan=0.0)), (
        f"{what}: {got} != {expected}"
    )


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    mask_bits=st.lists(st.booleans(), min_size=ROWS * WIDTH, max_size=ROWS * WIDTH),
    per_token_advantages=st.booleans(),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    estimator=st.sampled_from(KL_OPTIONS),
    kl_correction=st.sampled_from((None,) + KL_CORRECTIONS),
    correction=st.sampled_from(sorted(CORRECTIONS)),
    inputs=st.sets(st.sampled_from(REAL_INPUTS), min_size=1),
    step=st.booleans(),
)
@pytest.mark.parametrize("name, mode", list(configurations()))
def test_non_finite_values_under_the_mask_change_nothing(
    name, mode, seed, mask_bits, per_token_advantages, dtype, estimator, kl_correction, correction, inputs, step
):
    algorithm = build(name, mode, estimator, kl_correction, CORRECTIONS[correction])
    mask = torch.tensor(mask_bits).view(ROWS, WIDTH)
    clean = finite_inputs(seed, mask, per_token_advantages, dtype)
    dirty = poisoned(clean, seed + 1, sorted(inputs))
    expected, expected_grads = call_with_gradients(algorithm, clean, step=step)
    got, grads = call_with_gradients(algorithm, dirty, step=step)

    assert_same(got.loss, expected.loss, "loss")
    assert_same(got.per_token, expected.per_token, "per_token")
    assert sorted(got.metrics) == sorted(expected.metrics)
    for key in expected.metrics:
        assert_same(got.metrics[key], expected.metrics[key], f"metric {key}")
    for key in LEAVES:
        assert_same(grads[key], expected_grads[key], f"∂loss/∂{key}")
        masked = grads[key][~mask]
        assert torch.equal(masked, torch.zeros_like(masked)), f"∂loss/∂{key} at masked positions"


def test_the_poison_reaches_the_call():
    """The property is not vacuous: poisoned() writes non-finite values where the mask is 0 (and only there)."""
    mask = torch.rand(ROWS, WIDTH, generator=torch.Generator().manual_seed(0)) < 0.5
    mask[1] = False
    clean = finite_inputs(0, mask, True, torch.float64)
    dirty = poisoned(clean, 1, REAL_INPUTS, share=1.0)
    for name in TOKEN_INPUTS + ("advantages",):
        assert not torch.isfinite(dirty[name][~mask]).any(), name
        assert torch.equal(dirty[name][mask], clean[name][mask]), name
    for name in ROW_INPUTS:
        assert not torch.isfinite(dirty[name][1]), name
        assert torch.equal(dirty[name][mask.any(-1)], clean[name][mask.any(-1)]), name


# -- where the mask is 1: today's behaviour, as pgloss.core.checks documents it -----------------------------------

LOG_PROB_INPUTS = ("log_prob", "old_log_prob") + tuple(name for name, spec in OPTIONAL_INPUTS.items() if spec.log_prob)


def valid_call(name, key, value, anomaly=False):
    algorithm = pgloss.get(name, generation_budget=WIDTH, kl_coef=0.1, entropy_coef=0.01, positive_nll_coef=0.1)
    if key == "full_kl":
        algorithm = pgloss.get(name, generation_budget=WIDTH, kl_coef=0.1, kl_estimator=FULL)
    mask = torch.ones(ROWS, WIDTH, dtype=torch.bool)
    values = finite_inputs(3, mask, True, torch.float64)
    values[key] = values[key].clone()
    values[key][(2, 1) if values[key].ndim == 2 else 2] = value
    with pgloss.detect_anomaly(anomaly):
        return call_with_gradients(algorithm, values, step=False)


@pytest.mark.parametrize("key", REAL_INPUTS)
@pytest.mark.parametrize("value", POISONS, ids=["nan", "+inf", "-inf"])
def test_non_finite_at_a_valid_position_is_refused_inside_detect_anomaly(key, value):
    """Inside `pgloss.detect_anomaly()` every non-finite value at a valid position is a ValueError naming the
    input and its position."""
    where = "(row 2, column 1)" if key in TOKEN_INPUTS or key == "advantages" else "row 2"
    with pytest.raises(ValueError, match=re.escape(f"{key} is {value} at a valid position {where}")):
        valid_call("grpo", key, value, anomaly=True)


@pytest.mark.parametrize("key", LOG_PROB_INPUTS)
def test_positive_infinity_in_a_log_prob_is_refused(key):
    """+inf is a positive log-probability: refused on every device, inside detect_anomaly() or not."""
    with pytest.raises(ValueError, match=f"{key} must hold log-probabilities"):
        valid_call("grpo", key, math.inf)


@pytest.mark.parametrize(
    "key", ("log_prob", "old_log_prob", "advantages", "ref_log_prob", "rollout_log_prob", "entropy", "full_kl")
)
def test_nan_at_a_valid_position_propagates_to_the_loss(key):
    """Outside detect_anomaly() a NaN at a valid position is not checked (no host sync): like any torch
    computation, the loss comes out NaN, for an input this configuration reads (grpo with a KL term, an entropy
    bonus, VAPO's NLL; the rollout log-probs through truncated IS)."""
    out, _ = valid_call("grpo", key, math.nan)
    assert torch.isnan(out.loss)
