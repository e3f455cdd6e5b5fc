"""The KL term's gradient corrections (kl_variants.py): values and gradients against hand formulas."""

import math

import loops
import pytest
import torch

from pgloss.kl.corrections import kl_term, ratio_weighted, straight_through, unbiased_gradient
from pgloss.kl.estimators import kl_estimate


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lp = -torch.rand(3, 4, generator=gen, dtype=torch.float64) * 2
    ref = lp + 0.5 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    old = lp + 0.5 * torch.randn(3, 4, generator=gen, dtype=torch.float64)
    return lp, ref, old


def value_and_grad(fn, lp):
    x = lp.clone().requires_grad_()
    value = fn(x)
    value.sum().backward()
    return value.detach(), x.grad


@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3"])
def test_straight_through_has_the_estimator_value_and_the_k2_gradient(estimator):
    lp, ref, _ = inputs()
    value, grad = value_and_grad(lambda x: straight_through(kl_estimate(x, ref, estimator), x, ref), lp)
    expected = [
        [loops.kl(a, b, estimator) for a, b in zip(ra, rb, strict=True)]
        for ra, rb in zip(lp.tolist(), ref.tolist(), strict=True)
    ]
    torch.testing.assert_close(value, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, lp - ref, rtol=1e-12, atol=1e-14)  # ∇½d² = d·∇log π


def test_ratio_weighted_multiplies_value_and_gradient_by_a_differentiable_ratio():
    lp, ref, old = inputs(1)
    value, grad = value_and_grad(lambda x: ratio_weighted(kl_estimate(x, ref, "k3"), x - old, max_log_ratio=20.0), lp)
    d, r = lp - ref, torch.exp(lp - old)
    k3 = torch.exp(-d) + d - 1
    torch.testing.assert_close(value, k3 * r, rtol=1e-12, atol=1e-14)
    # d/dlog π [k3·r] = (1 - e^{-d})·r + k3·r
    torch.testing.assert_close(grad, (1 - torch.exp(-d)) * r + k3 * r, rtol=1e-12, atol=1e-14)


def test_unbiased_gradient_keeps_the_value_and_weights_the_k2_gradient_with_a_capped_ratio():
    lp, ref, old = inputs(2)
    old = old.clone()
    old[0, 0] = lp[0, 0] - 3.0  # r = e^3 > cap
    value, grad = value_and_grad(
        lambda x: unbiased_gradient(kl_estimate(x, ref, "k3"), x, ref, x - old, cap=10.0, max_log_ratio=20.0), lp
    )
    torch.testing.assert_close(value, kl_estimate(lp, ref, "k3"), rtol=1e-12, atol=1e-14)
    weight = torch.exp(lp - old).clamp(max=10.0)
    assert weight[0, 0].item() == 10.0 and math.exp(3.0) > 10
    torch.testing.assert_close(grad, weight * (lp - ref), rtol=1e-12, atol=1e-14)


def test_k2_gradient_is_the_exact_kl_gradient_on_policy():
    """Why straight-through: E_π[d·∇log π] = ∇KL(π‖ρ); E_π[∇k3] = E_π[(1 - ρ/π)∇log π] is not."""
    gen = torch.Generator().manual_seed(3)
    z = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    log_pi = torch.log_softmax(z, 0)
    (exact,) = torch.autograd.grad((log_pi.exp() * (log_pi - ref)).sum(), z)
    pi = log_pi.exp().detach()
    expectations = {}
    for name, fn in {
        "k3+": lambda lp: straight_through(kl_estimate(lp, ref, "k3"), lp, ref),
        "k3": lambda lp: kl_estimate(lp, ref, "k3"),
    }.items():
        per_token = fn(torch.log_softmax(z, 0))
        # Σ_y π(y)·∇[estimator at y] with π held fixed: the expected gradient of the sampled estimator.
        (expectations[name],) = torch.autograd.grad((pi * per_token).sum(), z)
    torch.testing.assert_close(expectations["k3+"], exact, rtol=1e-12, atol=1e-14)
    assert (expectations["k3"] - exact).abs().max() > 1e-3


@pytest.mark.parametrize("estimator", ["k1", "k3", "k3+", "abs+"])
@pytest.mark.parametrize("correction", [None, "ratio_weighted", "unbiased_gradient"])
def test_kl_term_composes_the_estimator_and_the_correction(estimator, correction):
    lp, ref, old = inputs(4)
    value, grad = value_and_grad(lambda x: kl_term(x, ref, old, estimator=estimator, correction=correction), lp)
    base = estimator.rstrip("+")
    d, r = lp - ref, torch.exp(lp - old)
    k = torch.tensor(
        [
            [loops.kl(a, b, base) for a, b in zip(ra, rb, strict=True)]
            for ra, rb in zip(lp.tolist(), ref.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    own = {"k1": torch.ones_like(d), "k3": 1 - torch.exp(-d), "abs": torch.sign(d)}[base]  # ∂k/∂log π
    grad_k = d if estimator.endswith("+") else own
    expected_value = k * r if correction == "ratio_weighted" else k
    expected_grad = {None: grad_k, "ratio_weighted": grad_k * r + k * r, "unbiased_gradient": r.clamp(max=10.0) * d}[
        correction
    ]
    torch.testing.assert_close(value, expected_value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)


def test_kl_term_refuses_an_unknown_correction():
    lp, ref, old = inputs()
    with pytest.raises(ValueError, match="kl_correction must be None or one of"):
        kl_term(lp, ref, old, estimator="k3", correction="bias")
