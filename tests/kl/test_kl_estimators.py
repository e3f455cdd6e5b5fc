"""KL estimators, KL in the reward, and the controllers."""

import math

import loops
import pytest
import torch

import pgloss
from pgloss.kl.estimators import AdaptiveKLController, FixedKLController, kl_estimate, kl_penalized_rewards


@pytest.mark.parametrize("estimator", pgloss.KL_ESTIMATORS)
def test_estimators_match_loop(estimator):
    gen = torch.Generator().manual_seed(0)
    lp = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(4, 6, generator=gen, dtype=torch.float64) * 3
    expected = torch.tensor(
        [
            [loops.kl(a, b, estimator) for a, b in zip(ra, rb, strict=True)]
            for ra, rb in zip(lp.tolist(), ref.tolist(), strict=True)
        ],
        dtype=torch.float64,
    )
    torch.testing.assert_close(kl_estimate(lp, ref, estimator), expected, rtol=1e-12, atol=1e-14)


def test_k3_is_nonnegative_and_unbiased_on_a_small_categorical():
    """The proof in the blog post on PPO/GRPO/GSPO/DAPO losses (2025-10-21), numerically: E_{x~p}[q/p - log(q/p) - 1] = KL(p‖q) when q sums to one."""
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    q = torch.softmax(torch.randn(6, generator=gen, dtype=torch.float64), 0)
    exact = (p * (p / q).log()).sum().item()
    # Exact expectation over the support, then a Monte-Carlo mean with a tolerance from its std.
    k3 = kl_estimate(p.log(), q.log(), "k3")
    assert (k3 >= 0).all()
    assert (p * k3).sum().item() == pytest.approx(exact, rel=1e-12)
    samples = torch.multinomial(p, 400_000, replacement=True, generator=gen)
    draws = kl_estimate(p.log()[samples], q.log()[samples], "k3")
    assert (draws >= 0).all()
    stderr = draws.std().item() / math.sqrt(draws.numel())
    assert abs(draws.mean().item() - exact) < 4 * stderr
    k1 = kl_estimate(p.log()[samples], q.log()[samples], "k1")
    assert draws.var() < k1.var()  # the low-variance estimator, as the name says


def test_k3_clamps_are_documented_bounds():
    lp = torch.tensor([0.0, 0.0], dtype=torch.float64)
    ref = torch.tensor([100.0, -100.0], dtype=torch.float64)
    out = kl_estimate(lp, ref, "k3", max_log_ratio=20.0, max_kl=10.0)
    # -d = 100 and -100 are clamped to ±20 first: e^{20} - 21 and e^{-20} + 19 both exceed max_kl = 10.
    assert out.tolist() == [10.0, 10.0]


def test_unknown_estimator_is_refused():
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        kl_estimate(torch.zeros(1), torch.zeros(1), "k5")


def test_kl_in_reward_subtracts_beta_times_kl_on_valid_tokens():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -3.0]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-2.0, -0.5, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    out, kl = kl_penalized_rewards(rewards, old, ref, mask, kl_coef=0.1)
    expected_kl = torch.tensor([[0.5, -1.0, 0.0], [1.0, -0.5, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(kl, expected_kl)
    torch.testing.assert_close(out, rewards - 0.1 * expected_kl)


def test_adaptive_controller_follows_ziegler():
    ctl = AdaptiveKLController(value=0.1, target=6.0, horizon=10000)
    ctl.update(current_kl=12.0, n_steps=256)  # error clipped to +0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000))
    ctl.update(current_kl=4.5, n_steps=256)  # error -0.25 clipped to -0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000) * (1 - 0.2 * 256 / 10000))
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 10)
    assert fixed.value == 0.05
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(value=0.1, target=0.0, horizon=1.0)


def test_algorithm_max_kl_moves_the_k3_clamp():
    lp = torch.full((1, 1), -3.5, dtype=torch.float64)
    ref = torch.zeros(1, 1, dtype=torch.float64)  # k3 = e^{3.5} - 3.5 - 1 ≈ 28.6
    args = (lp, lp, torch.zeros(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool))
    clamped = pgloss.get("grpo")(*args, ref_log_prob=ref).metrics["kl"].item()
    free = pgloss.get("grpo", max_kl=100.0)(*args, ref_log_prob=ref).metrics["kl"].item()
    assert clamped == 10.0
    assert free == pytest.approx(math.exp(3.5) - 4.5)
