"""The plain call reads values, never layouts: every input given as a non-contiguous view (column-major, a
strided slice of a wider buffer, transposed then sliced, broadcast with a zero stride) gives the loss, metrics
and gradients of the same values made `.contiguous()`, for every registered name under a rollout correction
and its step's `Normalizer`."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from properties.call_inputs import ARGUMENTS, LEAVES, ROWS, WIDTH, call_with_gradients, finite_inputs

import pgloss
from pgloss.core.aggregate import AGGREGATIONS
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection

LAYOUTS = ("contiguous", "column-major", "strided slice", "transposed slice", "broadcast row", "broadcast column")
CORRECTION = RolloutCorrection(upper=1.5, batch_normalize=True, rejection=(Rejection("seq_mean_k3", upper=0.5),))


def view(x, layout):
    """`x` ([B, T] or [B]) as a view of `layout`. The broadcasts change the values (a row or column repeated);
    the others keep them. Views of a leaf keep its gradient."""
    if layout == "contiguous":
        return x
    if x.ndim == 1:  # [B]: a strided slice, or one value broadcast
        if layout == "broadcast row":
            return x[:1].expand(x.shape)
        buffer = x.new_zeros(2 * x.shape[0] + 1)
        buffer[1::2] = x
        return buffer[1::2]
    rows, cols = x.shape
    if layout == "column-major":
        return x.T.contiguous().T
    if layout == "strided slice":
        buffer = x.new_zeros(2 * rows, cols + 3)
        buffer[::2, 1 : cols + 1] = x
        return buffer[::2, 1 : cols + 1]
    if layout == "transposed slice":
        buffer = x.new_zeros(cols + 2, rows + 1)
        buffer[1 : cols + 1, :rows] = x.T
        return buffer[1 : cols + 1, :rows].T
    if layout == "broadcast row":
        return x[:1].expand(x.shape)
    return x[:, :1].expand(x.shape)  # broadcast column


def run(algorithm, values, layouts, *, contiguous):
    """The call (counted by its step's Normalizer) on `values` given in `layouts`, or those views made contiguous."""

    def given(name, value):
        value = view(value, layouts[name])
        return value.contiguous() if contiguous else value

    return call_with_gradients(algorithm, values, step=True, view=given)


def modes(name):
    fixed = pgloss.get(name, generation_budget=WIDTH).fixed_agg_mode
    return [fixed] if fixed else list(AGGREGATIONS)


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    seed=st.integers(0, 2**16),
    per_token_advantages=st.booleans(),
    layouts=st.fixed_dictionaries({name: st.sampled_from(LAYOUTS) for name in ARGUMENTS}),
)
@pytest.mark.parametrize("name", pgloss.names())
def test_any_layout_equals_contiguous(name, data, seed, per_token_advantages, layouts):
    mode = data.draw(st.sampled_from(modes(name)), label="loss_agg_mode")
    base = pgloss.get(name, generation_budget=WIDTH)
    algorithm = pgloss.get(
        name,
        generation_budget=WIDTH,
        loss_agg_mode=mode,
        kl_coef=0.1,
        entropy_coef=0.01,
        positive_nll_coef=0.1,
        rollout_correction=None if base.consumes_rollout_log_prob else CORRECTION,
    )
    mask = torch.rand(ROWS, WIDTH, generator=torch.Generator().manual_seed(seed)) < 0.7
    values = finite_inputs(seed, mask, per_token_advantages, torch.float64)
    expected, expected_grads = run(algorithm, values, layouts, contiguous=True)
    got, grads = run(algorithm, values, layouts, contiguous=False)
    torch.testing.assert_close(got.loss, expected.loss, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(got.per_token, expected.per_token, rtol=1e-12, atol=1e-15)
    assert sorted(got.metrics) == sorted(expected.metrics)
    for key in expected.metrics:
        torch.testing.assert_close(
            got.metrics[key],
            expected.metrics[key],
            rtol=1e-12,
            atol=1e-15,
            equal_nan=True,
            msg=lambda m, key=key: f"metric {key}: {m}",
        )
    for key in LEAVES:
        torch.testing.assert_close(
            grads[key], expected_grads[key], rtol=1e-12, atol=1e-15, msg=lambda m, key=key: f"∂loss/∂{key}: {m}"
        )


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_the_layouts_are_what_they_say(layout):
    x = torch.arange(ROWS * WIDTH, dtype=torch.float64).view(ROWS, WIDTH)
    v = view(x, layout)
    assert v.shape == x.shape and not v.is_contiguous()
    if layout.startswith("broadcast"):
        assert 0 in v.stride()
    else:
        assert torch.equal(v, x)
