"""`importance_sampling`, `ipo` (losses/importance_sampling.py) and `rollout_is` (REC's two-side rule with the
importance weight, on the rollout's ratio) against the float64 loops of tests/loops/losses.py, with gradcheck, and against the trainers' own
functions, read from their sources (trainer_sources.py; each test skips when its source is absent):

    SkyRL 0.4.0 importance_sampling_loss      (skyrl/backends/skyrl_train/utils/ppo_utils.py): the loss within
                                              8.9e-16 (a sum of 30-odd tokens), its gradient identical, 3 seeds. Tinker's
                                              `importance_sampling` runs on Tinker's servers; SkyRL's docstring
                                              gives it as the same -Σ r·A, a sum over the tokens (token-sum).
    SkyRL 0.4.0 rollout_is_policy_loss        the loss within 1.2e-8, its gradient 2.9e-9, 3 seeds: SkyRL
                                              computes the ratio in float32 (`safe_exp_delta`); with that one
                                              function in float64, 3.8e-17 and 1.4e-17. Its token_mean (the advantages
                                              divided by the mini-batch's token count) is pgloss's token-mean.
    prime-rl ipo_loss_fn + compute_loss       (src/prime_rl/trainer/rl/loss.py, commit 559b44772, through
                                              PGLOSS_PRIME_RL_SRC): the step's loss within 7e-18, its gradient
                                              identical, 3 seeds, with tokens masked by the trust region on both
                                              sides.
"""

from types import SimpleNamespace

import loops
import pytest
import torch
from advantages.trainer_sources import load, source_file
from conftest import log_probs, make_batch

import pgloss

F64 = dict(dtype=torch.float64)
SKYRL = ("PGLOSS_SKYRL_SRC", "skyrl/backends/skyrl_train/utils/ppo_utils.py")
SKYRL_CORRECTION = ("PGLOSS_SKYRL_SRC", "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py")
SKYRL_TORCH = ("PGLOSS_SKYRL_SRC", "skyrl/backends/skyrl_train/utils/torch_utils.py")
PRIME_RL_LOSS = ("PGLOSS_PRIME_RL_SRC", "src/prime_rl/trainer/rl/loss.py")


def with_rollout(seed, spread=0.25):
    data = make_batch(batch=7, length=8, seed=seed, spread=spread, per_token_adv=True)
    gen = torch.Generator().manual_seed(seed + 50)
    data["rollout_log_prob"] = log_probs(data["log_prob"] + 0.2 * torch.randn(data["mask"].shape, generator=gen, **F64))
    return data


def call(name, data, lp=None, **kw):
    lp = data["log_prob"] if lp is None else lp
    return pgloss.get(name, **kw)(lp, data["old_log_prob"], data["advantages"], data["mask"])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(
    "name, kw, mode",
    [
        ("importance_sampling", dict(threshold=None, kl_tau=0.0), "token-sum"),
        ("ipo", dict(threshold=0.1, kl_tau=1e-3), "token-mean"),
    ],
)
def test_matches_loop(name, kw, mode, seed):
    data = make_batch(batch=7, length=8, seed=seed, spread=0.5, per_token_adv=True)
    lp, old, adv, mask = loops.lists(data)
    expected = loops.aggregate(loops.importance_sampling(lp, old, adv, mask, **kw), mask, mode)
    out = call(name, data)
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)


def test_ipo_masks_both_sides_whatever_the_sign_and_keeps_the_squared_log_ratio():
    data = make_batch(batch=7, length=8, seed=1, spread=0.5, per_token_adv=True)
    diff = (data["log_prob"].exp() - data["old_log_prob"].exp())[data["mask"]]
    adv = data["advantages"][data["mask"]]
    moved = diff.abs() > 0.1
    assert ((diff > 0.1) & (adv > 0)).any() and ((diff < -0.1) & (adv > 0)).any()
    assert ((diff > 0.1) & (adv < 0)).any() or ((diff < -0.1) & (adv < 0)).any()
    out = call("ipo", data)
    per_token = out.per_token[data["mask"]]
    log_r = (data["log_prob"] - data["old_log_prob"])[data["mask"]]
    torch.testing.assert_close(per_token[moved], 1e-3 * log_r[moved].square(), rtol=0, atol=1e-17)
    assert out.metrics["ipo_masked_frac"].item() == pytest.approx(moved.double().mean().item())


@pytest.mark.parametrize("name", ["importance_sampling", "ipo"])
def test_gradcheck(name):
    data = make_batch(batch=6, length=5, seed=5, spread=0.4, per_token_adv=True)
    x = data["log_prob"].clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda y: call(name, data, y).loss, (x,))


def test_importance_sampling_gradient_is_the_unclipped_ratio_times_reinforce():
    data = make_batch(batch=6, length=5, seed=6, spread=0.6, per_token_adv=True)
    x = data["log_prob"].clone().requires_grad_()
    call("importance_sampling", data, x).loss.backward()
    r = (data["log_prob"] - data["old_log_prob"]).exp()
    torch.testing.assert_close(x.grad, torch.where(data["mask"], -data["advantages"] * r, 0.0), rtol=1e-14, atol=0)


def rollout_is_call(data, lp=None, **kw):
    """SkyRL's ratio is to the rollout's log-probs: they are the call's old_log_prob."""
    lp = data["log_prob"] if lp is None else lp
    return pgloss.get("rollout_is", **kw)(lp, data["rollout_log_prob"], data["advantages"], data["mask"])


def test_rollout_is_with_both_log_probs_and_a_bypass_correction_is_the_same_loss():
    data = with_rollout(2)
    bypass = pgloss.get("rollout_is", rollout_correction=pgloss.RolloutCorrection(weight_level=None, bypass=True))
    out = bypass(
        data["log_prob"],
        data["old_log_prob"],
        data["advantages"],
        data["mask"],
        rollout_log_prob=data["rollout_log_prob"],
    )
    torch.testing.assert_close(out.loss, rollout_is_call(data).loss, rtol=0, atol=1e-16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollout_is_matches_loop(seed):
    data = with_rollout(seed)
    lp, _, adv, mask = loops.lists(data)
    per_token = loops.rollout_is(lp, data["rollout_log_prob"].tolist(), adv, mask)
    # the band's zeroed tokens stay in the count (as SkyRL's scaled advantages keep them)
    expected = sum(sum(row) for row in per_token) / data["mask"].sum().item()
    assert rollout_is_call(data).loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    r = (data["log_prob"] - data["rollout_log_prob"]).exp()[data["mask"]]
    assert 0 < ((r < 0.8) | (r > 1.2)).sum() < r.numel()  # both kinds of token occur


def test_rollout_is_gradient_is_the_detached_kept_ratio_times_reinforce():
    """The weight is detached (gradcheck's finite differences would move it): ∇ = -sg[r·1(r in band)]·Â / N."""
    data = with_rollout(4)
    x = data["log_prob"].clone().requires_grad_()
    rollout_is_call(data, x).loss.backward()
    mask = data["mask"]
    r = (data["log_prob"] - data["rollout_log_prob"]).exp()
    kept = torch.where((r >= 0.8) & (r <= 1.2) & mask, r, 0.0)
    torch.testing.assert_close(x.grad, -kept * data["advantages"] / mask.sum(), rtol=1e-14, atol=1e-17)


# -- SkyRL ---------------------------------------------------------------------------------------------------------


def skyrl(*names, exp64=False):
    ns = {"torch": torch, "Optional": None, "Tuple": None}
    load(source_file(*SKYRL_TORCH), ("masked_mean", "safe_exp_delta"), ns)
    if exp64:  # the one float32 step of SkyRL's ratio, in float64
        ns["safe_exp_delta"] = lambda delta, clip=20.0, out_dtype=None: delta.clamp(-clip, clip).exp()
    load(
        source_file(*SKYRL_CORRECTION),
        ("off_policy_correction_enabled", "compute_off_policy_correction", "apply_off_policy_correction"),
        ns,
    )
    return load(source_file(*SKYRL), ("reduce_loss", *names), ns)


OFF = SimpleNamespace(
    tis_ratio_type=None,
    sequence_mask_metric=None,
    outlier_token_is_threshold_low=None,
    outlier_token_is_threshold_high=None,
    token_mask_is_threshold_low=None,
    token_mask_is_threshold_high=None,
)
SKYRL_CONFIG = SimpleNamespace(eps_clip_low=0.2, eps_clip_high=0.2, off_policy_correction=OFF)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_importance_sampling_matches_skyrl_and_tinker(seed):
    ns = skyrl("importance_sampling_loss")
    data = make_batch(batch=7, length=8, seed=seed, spread=0.5, per_token_adv=True)
    theirs, ours = (data["log_prob"].clone().requires_grad_() for _ in range(2))
    loss_theirs, _ = ns["importance_sampling_loss"](
        theirs, data["old_log_prob"], data["advantages"], SKYRL_CONFIG, data["mask"].double()
    )
    loss_ours = call("importance_sampling", data, ours).loss
    (loss_theirs + loss_ours).backward()
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=2e-15)
    assert torch.equal(ours.grad, theirs.grad)


@pytest.mark.parametrize("exp64, atol", [(False, (3e-8, 1e-8)), (True, (2e-16, 5e-17))])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rollout_is_matches_skyrl(seed, exp64, atol):
    ns = skyrl("rollout_is_policy_loss", exp64=exp64)
    data = with_rollout(seed)
    mask = data["mask"]
    scaled = data["advantages"] / mask.sum()  # SkyRL's token_mean: apply_loss_reduction_to_advantages_minibatch
    theirs, ours = (data["log_prob"].clone().requires_grad_() for _ in range(2))
    loss_theirs, _ = ns["rollout_is_policy_loss"](
        theirs, data["old_log_prob"], scaled, SKYRL_CONFIG, mask.double(), data["rollout_log_prob"]
    )
    loss_ours = rollout_is_call(data, ours).loss
    (loss_theirs + loss_ours).backward()
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=atol[0])
    torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=atol[1])


# -- prime-rl ------------------------------------------------------------------------------------------------------


def prime_rl_step(log_prob, inference, advantages, mask, threshold=0.1, kl_tau=1e-3):
    ns = dict(torch=torch, LossInputs=SimpleNamespace, LossOutputs=SimpleNamespace)
    load(
        source_file(*PRIME_RL_LOSS),
        ("_safe_mean", "compute_importance_ratio_and_mismatch_kl", "ipo_loss_fn", "compute_loss"),
        ns,
    )
    config = SimpleNamespace(ipo_threshold=threshold, adv_tau=1.0, kl_tau=kl_tau)
    rows = lambda x: list(x.unbind(0))  # noqa: E731  one packed sample per row
    loss, _ = ns["compute_loss"](
        rows(log_prob),
        rows(inference),
        None,
        rows(advantages),
        rows(mask),
        None,
        None,
        None,
        lambda inputs: ns["ipo_loss_fn"](inputs, config),
        int(mask.sum()),
        1,
        1,
    )
    return loss


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ipo_matches_prime_rl(seed):
    data = make_batch(batch=7, length=8, seed=seed, spread=0.5, per_token_adv=True)
    theirs, ours = (data["log_prob"].clone().requires_grad_() for _ in range(2))
    loss_theirs = prime_rl_step(theirs, data["old_log_prob"], data["advantages"], data["mask"])
    loss_ours = call("ipo", data, ours).loss
    (loss_theirs + loss_ours).backward()
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=0, atol=3e-17)
    assert torch.equal(ours.grad, theirs.grad)
    moved = (data["log_prob"].exp() - data["old_log_prob"].exp()).abs() > 0.1
    assert (moved & data["mask"]).any() and (~moved & data["mask"]).any()
