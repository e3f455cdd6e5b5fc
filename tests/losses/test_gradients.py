"""Gradients: autograd against finite differences and against the analytic forms of the papers."""

import pytest
import torch
from conftest import algorithm, make_batch

import pgloss
from pgloss.core.aggregate import token_weights
from pgloss.core.normalizer import Normalizer

# Losses whose value is a smooth function of log_prob (away from measure-zero kinks): gradcheck applies.
DIFFERENTIABLE = ["ppo", "dual_clip_ppo", "grpo", "sample_grpo", "gspo", "dapo", "bnpo", "dr_grpo", "sapo"]
# Losses with a stop-gradient by design; their gradient is checked against the analytic form.
STOP_GRADIENT = ["gspo_token", "cispo", "fipo"]


def weights(alg, data):
    """w_{i,t}: the aggregation weight of each token, so that ∇_t loss = w_t · ∂ℓ_t/∂ log π_t."""
    n = Normalizer.count(data["mask"], group_ids=data["group_ids"], reduce=False)
    return token_weights(
        data["mask"], alg.loss_agg_mode, n, norm_constant=alg.norm_constant, group_ids=data["group_ids"]
    )


@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_gradcheck(name):
    data = make_batch(batch=4, length=5, seed=11, spread=0.5)
    alg = algorithm(name, entropy_coef=0.05)

    def loss(log_prob, entropy):
        return alg(
            log_prob,
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            ref_log_prob=data["ref_log_prob"],
            entropy=entropy,
        ).loss

    inputs = (data["log_prob"].clone().requires_grad_(True), data["entropy"].clone().requires_grad_(True))
    assert torch.autograd.gradcheck(loss, inputs, eps=1e-7, atol=1e-6)


@pytest.mark.parametrize("name", DIFFERENTIABLE + STOP_GRADIENT)
def test_ratio_one_gives_the_reinforce_gradient(name):
    """π_θ = π_old: every ratio-based loss has gradient -Â·w_{i,t} (w: its aggregation weight)."""
    data = make_batch(seed=12)
    alg = algorithm(name, kl_coef=0.0)
    log_prob = data["old_log_prob"].clone().requires_grad_(True)
    alg(log_prob, data["old_log_prob"], data["advantages"], data["mask"]).loss.backward()
    adv = data["advantages"][:, None].expand_as(log_prob)
    w = weights(alg, data)
    if name == "sample_grpo":
        # ∂ρ_i/∂log π_t = ρ_i = 1 for every token: the per-sequence loss sums over tokens
        # (seq-mean-token-sum), which is the point of "OpenR1 in practice (6): sample-level vs token-level loss" (2025-06-04).
        w = data["mask"] / data["mask"].any(dim=1).sum()
    torch.testing.assert_close(log_prob.grad, -adv * w, rtol=1e-12, atol=1e-15)


def test_ppo_gradient_is_exactly_zero_in_clipped_zones_and_cispo_is_not():
    old = torch.full((1, 5), -1.0, dtype=torch.float64)
    lp = old + torch.tensor([[0.5, -0.5, 0.5, -0.5, 0.05]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones_like(lp, dtype=torch.bool)
    # r = e^{0.5} > 1.2 with A > 0 and r = e^{-0.5} < 0.8 with A < 0: clipped. The rest: not.
    grads = {}
    for name in ("ppo", "cispo"):
        x = lp.clone().requires_grad_(True)
        pgloss.get(name, loss_agg_mode="token-mean", clip_high=0.2, clip_low=0.2)(x, old, adv, mask).loss.backward()
        grads[name] = x.grad[0]
    assert grads["ppo"][0].item() == 0.0 and grads["ppo"][1].item() == 0.0
    assert grads["ppo"][2].item() != 0.0 and grads["ppo"][3].item() != 0.0
    r = torch.exp(lp[0] - old[0])
    # PPO unclipped: ∂(-A r)/∂log π = -A r, divided by 5 tokens.
    torch.testing.assert_close(grads["ppo"][2:], (-adv[0] * r)[2:] / 5)
    # CISPO: -sg[clip(r, 0.8, 1.2)]·A/5 everywhere, clipped zones included.
    torch.testing.assert_close(grads["cispo"], -adv[0] * r.clamp(0.8, 1.2) / 5)
    assert (grads["cispo"] != 0).all()


@pytest.mark.parametrize("per_token", [False, True])
def test_gspo_token_gradient_is_sequence_weight_times_token_advantage(per_token):
    """GSPO-token, unclipped: ∇_t = -sg[s_i]·Â_{i,t}·w_{i,t} (2507.18071 eq. 14)."""
    data = make_batch(seed=13, spread=0.02, per_token_adv=per_token)
    alg = pgloss.get("gspo_token", clip_low=10.0, clip_high=10.0)  # bounds never bind
    log_prob = data["log_prob"].clone().requires_grad_(True)
    alg(log_prob, data["old_log_prob"], data["advantages"], data["mask"]).loss.backward()
    m = data["mask"]
    s = torch.exp(((data["log_prob"] - data["old_log_prob"]) * m).sum(1) / m.sum(1).clamp(min=1))
    adv = data["advantages"] if per_token else data["advantages"][:, None].expand_as(m)
    torch.testing.assert_close(log_prob.grad, -s[:, None] * adv * weights(alg, data), rtol=1e-12, atol=1e-15)


def test_fipo_gradient_is_influence_times_clipped_gradient():
    data = make_batch(seed=14, spread=0.3, per_token_adv=True)
    fipo, dapo = pgloss.get("fipo"), pgloss.get("dapo", delta=10.0)
    grads = []
    for alg in (fipo, dapo):
        x = data["log_prob"].clone().requires_grad_(True)
        out = alg(x, data["old_log_prob"], data["advantages"], data["mask"])
        out.loss.backward()
        grads.append(x.grad)
    f = fipo(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"]).per_token
    d = dapo(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"]).per_token
    influence = torch.where(data["mask"], f / torch.where(d == 0, 1.0, d), 0.0)
    torch.testing.assert_close(grads[0], influence * grads[1], rtol=1e-10, atol=1e-14)


def test_gspo_equals_gspo_token_for_per_sequence_advantages():
    clipped = []
    for seed in range(3):
        data = make_batch(seed=seed, spread=1e-3)  # ratios straddle GSPO's 3e-4 / 4e-4 bounds
        outs, grads = [], []
        for name in ("gspo", "gspo_token"):
            x = data["log_prob"].clone().requires_grad_(True)
            out = pgloss.get(name)(x, data["old_log_prob"], data["advantages"], data["mask"])
            out.loss.backward()
            outs.append(out)
            grads.append(x.grad)
        clipped.append(outs[0].metrics["pg_clipfrac"].item())
        torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-13, atol=1e-16)
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-16)
        assert grads[0].abs().sum() > 0
    assert 0 < max(clipped) < 1  # both zones were exercised


def test_entropy_gets_a_gradient_only_when_its_coefficient_is_nonzero():
    data = make_batch(seed=15)
    for coef, expect_grad in ((0.0, False), (0.1, True)):
        entropy = data["entropy"].clone().requires_grad_(True)
        out = pgloss.get("dapo", entropy_coef=coef)(
            data["log_prob"].clone().requires_grad_(True),
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            entropy=entropy,
        )
        out.loss.backward()
        assert (entropy.grad is not None) == expect_grad
        if expect_grad:
            w = weights(pgloss.get("dapo"), data)
            torch.testing.assert_close(entropy.grad, -coef * w)


def test_kl_term_gradient_is_k3_derivative():
    # d/dlp [e^{ref-lp} - (ref-lp) - 1] = 1 - e^{ref-lp}
    data = make_batch(seed=16)
    x = data["old_log_prob"].clone().requires_grad_(True)  # ratio one: the policy term is REINFORCE
    alg = pgloss.get("grpo", kl_coef=0.5)
    alg(x, data["old_log_prob"], data["advantages"], data["mask"], ref_log_prob=data["ref_log_prob"]).loss.backward()
    w = weights(alg, data)
    adv = data["advantages"][:, None]
    expected = -adv * w + 0.5 * (1 - torch.exp(data["ref_log_prob"] - x.detach())) * w
    torch.testing.assert_close(x.grad, expected)


def test_token_gradient_is_zero_beyond_the_log_ratio_clamp():
    """Â < 0 with no dual clip leaves r unbounded above, so only the ±max_log_ratio clamp stops the
    gradient there; inside it the gradient is -Â·r/N (the closed-form backward of token ratios)."""
    old = torch.full((1, 4), -25.0, dtype=torch.float64)
    lp = (old + torch.tensor([[25.0, 19.0, -25.0, -19.0]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0]], dtype=torch.float64)
    out = pgloss.get("ppo", loss_agg_mode="token-mean", clip_low=0.2, clip_high=0.2)(
        lp, old, adv, torch.ones_like(lp, dtype=torch.bool)
    )
    out.loss.backward()
    expected = torch.tensor([0.0, torch.e**19 / 4, 0.0, 0.0], dtype=torch.float64)  # -19: clipped low (r < 0.8)
    torch.testing.assert_close(lp.grad[0], expected, rtol=1e-12, atol=0)
