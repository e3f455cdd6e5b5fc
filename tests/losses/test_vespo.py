"""VESPO (losses/vespo.py) against the plain loop: the gamma weight, its detachment, φ(1) = 1."""

import math

import loops
import pytest
import torch
from conftest import make_batch

import pgloss
from pgloss.core.batch import TokenBatch
from pgloss.losses.vespo import rollout_log_weight, vespo_loss, vespo_phi

SHAPE = dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("spread", [0.1, 0.6])
def test_matches_loop_and_gradient_is_phi_weighted_reinforce(per_token_adv, spread):
    data = make_batch(seed=7, spread=spread, per_token_adv=per_token_adv)
    mask = data["mask"]
    adv = data["advantages"]
    adv = adv[:, None].expand_as(mask) if adv.ndim == 1 else adv
    lp, old = torch.where(mask, data["log_prob"], 0.0), torch.where(mask, data["old_log_prob"], 0.0)
    x = lp.clone().requires_grad_()
    phi = vespo_phi(x - old, adv, mask, **SHAPE)
    loss = torch.where(mask, vespo_loss(x, phi, adv), 0.0)
    torch.testing.assert_close(
        loss, torch.tensor(loops.vespo(*loops.lists(data), **SHAPE), dtype=torch.float64), rtol=1e-12, atol=1e-14
    )
    loss.sum().backward()
    assert not phi.requires_grad
    torch.testing.assert_close(x.grad, torch.where(mask, -phi * adv, 0.0), rtol=1e-12, atol=1e-14)


def test_phi_is_one_at_ratio_one_and_peaks_at_k_over_lambda():
    mask = torch.ones(3, 1, dtype=torch.bool)
    adv = torch.ones(3, 1, dtype=torch.float64)
    log_w = torch.tensor([[0.0], [math.log(2 / 3)], [math.log(0.5)]], dtype=torch.float64)
    phi = vespo_phi(log_w, adv, mask, **SHAPE).squeeze(-1)
    assert phi[0].item() == pytest.approx(1.0, abs=1e-15)
    assert phi[1] > phi[0] and phi[1] > phi[2]  # w = k/λ = 2/3 is the mode for A ≥ 0


def test_rollout_log_ratio_enters_the_sequence_weight():
    mask = torch.ones(1, 2, dtype=torch.bool)
    adv = -torch.ones(1, 2, dtype=torch.float64)
    zero = torch.zeros(1, 2, dtype=torch.float64)
    shift = torch.tensor([[0.1, -0.3]], dtype=torch.float64)
    torch.testing.assert_close(
        vespo_phi(zero, adv, mask, **SHAPE, rollout_log_ratio=shift), vespo_phi(shift, adv, mask, **SHAPE)
    )


def test_extreme_ratios_give_finite_zero_weight():
    mask = torch.ones(2, 3, dtype=torch.bool)
    delta = torch.tensor([[1e4] * 3, [-1e4] * 3], dtype=torch.float64)
    phi = vespo_phi(delta, torch.ones(2, 3, dtype=torch.float64), mask, **SHAPE)
    assert torch.isfinite(phi).all() and (phi < 1e-6).all()


def rollout_batch(seed, *, outliers=0.05):
    """A batch whose rollout log-probs mostly agree with π_old, with a few tokens far off (|log ρ| ~ 1.5)."""
    data = make_batch(batch=6, length=9, seed=seed, spread=0.1)
    gen = torch.Generator().manual_seed(seed + 100)
    noise = 0.02 * torch.randn(data["old_log_prob"].shape, generator=gen, dtype=torch.float64)
    far = torch.rand(noise.shape, generator=gen) < outliers
    noise = torch.where(far, 1.5 * torch.randn(noise.shape, generator=gen, dtype=torch.float64), noise)
    data["rollout_log_prob"] = data["old_log_prob"] - noise
    return data


def trl_phi(data, *, mode, clip_min, clip_max):
    """TRL 1.16's VESPO weight with its token-level vLLM IS ratio (grpo_trainer.py: the ratio of
    `_generate_and_score_completions`, then `get_gamma_weights`)."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    mask = data["mask"].to(torch.float64)
    ratio = torch.exp((data["old_log_prob"] - data["rollout_log_prob"]) * mask)
    if mode == "truncate":
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        low = -math.inf if clip_min is None else clip_min
        high = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < low) | (ratio > high), 0.0)
    adv = data["advantages"][:, None]
    return GRPOTrainer.get_gamma_weights(adv, data["log_prob"] - data["old_log_prob"], mask, ratio, **SHAPE)


@pytest.mark.parametrize(
    "mode, clip_min, clip_max",
    [("truncate", None, 3.0), ("truncate", 0.5, 2.0), ("mask", 0.5, 2.0), ("mask", None, 3.0)],
)
def test_trl_convention_folds_the_bounded_ratio_as_trl_does(mode, clip_min, clip_max):
    pytest.importorskip("trl")
    data = rollout_batch(4)
    alg = pgloss.get("vespo", vespo_rollout_mode=mode, vespo_rollout_clip_min=clip_min, vespo_rollout_clip_max=clip_max)
    batch = TokenBatch.prepare(
        data["log_prob"],
        data["old_log_prob"],
        data["advantages"],
        data["mask"],
        rollout_log_prob=data["rollout_log_prob"],
    )
    ours = alg.phi(batch)[:, :1]
    torch.testing.assert_close(
        ours, trl_phi(data, mode=mode, clip_min=clip_min, clip_max=clip_max), rtol=1e-12, atol=1e-15
    )
    raw = pgloss.get("vespo").phi(batch)[:, :1]
    assert not torch.allclose(ours, raw, rtol=1e-2)  # the outliers are out of the band: the conventions differ here


def test_the_conventions_agree_when_every_ratio_is_inside_the_bounds():
    data = rollout_batch(5, outliers=0.0)  # |log ρ| ≈ 0.02: inside [0.5, 2]
    args = (data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    raw = pgloss.get("vespo")(*args, rollout_log_prob=data["rollout_log_prob"]).loss
    for mode in ("truncate", "mask"):
        bounded = pgloss.get("vespo", vespo_rollout_mode=mode, vespo_rollout_clip_min=0.5, vespo_rollout_clip_max=2.0)
        assert bounded(*args, rollout_log_prob=data["rollout_log_prob"]).loss.item() == raw.item()


def test_rollout_log_weight_against_the_plain_formulas():
    log_rho = torch.tensor([[math.log(0.25), math.log(0.9), math.log(1.5), math.log(5.0)]], dtype=torch.float64)
    expected = {"raw": [0.25, 0.9, 1.5, 5.0], "truncate": [0.5, 0.9, 1.5, 2.0], "mask": [1e-8, 0.9, 1.5, 1e-8]}
    for mode, values in expected.items():
        bounds = {} if mode == "raw" else dict(clip_min=0.5, clip_max=2.0)
        got = rollout_log_weight(log_rho, mode=mode, **bounds)
        torch.testing.assert_close(got, torch.tensor([[math.log(v) for v in values]], dtype=torch.float64))


def test_rollout_mode_bad_values():
    with pytest.raises(ValueError, match="vespo_rollout_mode must be one of"):
        pgloss.get("vespo", vespo_rollout_mode="token_truncate")
    with pytest.raises(ValueError, match="'raw' folds the unbounded ratio"):
        pgloss.get("vespo", vespo_rollout_clip_max=3.0)
    with pytest.raises(ValueError, match="needs vespo_rollout_clip_min or"):
        pgloss.get("vespo", vespo_rollout_mode="mask")
    with pytest.raises(ValueError, match="vespo_rollout_clip_min must be <="):
        pgloss.get("vespo", vespo_rollout_mode="mask", vespo_rollout_clip_min=2.0, vespo_rollout_clip_max=0.5)
    with pytest.raises(ValueError, match="vespo_rollout_clip_max must be > 0"):
        pgloss.get("vespo", vespo_rollout_mode="truncate", vespo_rollout_clip_max=0.0)
