"""Extreme values, low precision, empty batches and bad input. (Non-finite values under the mask:
test_nonfinite_under_mask.py.)"""

import pytest
import torch
from conftest import algorithm, make_batch

import pgloss

NAMES = pgloss.names()


def call(alg, data, log_prob=None, **extra):
    # Group ids, raw scores and the teacher for the families that need them (REAL, TOPR, OPD); the others
    # ignore them.
    for key in ("group_ids", "scores", "teacher_log_prob"):
        extra.setdefault(key, data[key])
    return alg(
        data["log_prob"] if log_prob is None else log_prob,
        data["old_log_prob"],
        data["advantages"],
        data["mask"],
        ref_log_prob=data["ref_log_prob"],
        entropy=data["entropy"],
        **extra,
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("magnitude", [1e4, -1e4])
def test_huge_log_ratios_stay_finite(name, magnitude):
    data = make_batch(seed=42, per_token_adv=True)
    # log π_θ - log π_old = ±magnitude, every log-prob <= 0: the larger one is the base value
    shift = magnitude * torch.sign(torch.randn_like(data["old_log_prob"]))
    base = data["old_log_prob"]
    log_prob = (base - shift.clamp(max=0).abs()).requires_grad_(True)
    data["old_log_prob"] = base - shift.clamp(min=0)
    out = call(algorithm(name, kl_coef=0.1), data, log_prob)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert torch.isfinite(log_prob.grad).all()
    assert all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_inputs_agree_with_float32(name):
    data = make_batch(seed=43, dtype=torch.float32)
    alg = algorithm(name, kl_coef=0.1)
    bf = {k: (v.bfloat16() if v.is_floating_point() else v) for k, v in data.items()}
    # Both runs see the same (bfloat16-representable) values: the comparison isolates the computation.
    f32 = {k: (v.float() if v.is_floating_point() else v) for k, v in bf.items()}
    lp_bf = bf["log_prob"].clone().requires_grad_(True)
    lp_32 = f32["log_prob"].clone().requires_grad_(True)
    out_bf, out_32 = call(alg, bf, lp_bf), call(alg, f32, lp_32)
    assert out_bf.loss.dtype == torch.float32  # upcast inside
    out_bf.loss.backward()
    out_32.loss.backward()
    torch.testing.assert_close(out_bf.loss, out_32.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp_bf.grad.float(), lp_32.grad, rtol=1e-2, atol=1e-3)  # grad rounded to bf16


LOSS_METRICS = {"pg_loss", "kl_loss"}  # loss values: 0 over no tokens (and each declared term's); the rest are means


def empty_batches():
    """All-masked, no rows (B = 0) and no positions (T = 0)."""
    masked = make_batch(seed=44)
    masked["mask"] = torch.zeros_like(masked["mask"])
    yield "all-masked", masked
    full = make_batch(seed=44)
    yield "B=0", {k: v[:0] for k, v in full.items()}
    yield "T=0", {k: (v if v.ndim == 1 else v[:, :0]) for k, v in full.items()}


@pytest.mark.parametrize("name", NAMES)
def test_empty_and_all_masked_batches_give_zero_loss_and_nan_metrics(name):
    for label, data in empty_batches():
        log_prob = data["log_prob"].clone().requires_grad_(True)
        alg = algorithm(name, kl_coef=0.1, entropy_coef=0.1)
        out = call(alg, data, log_prob, group_ids=data["group_ids"])
        out.loss.backward()
        assert out.loss.item() == 0.0, label
        assert (log_prob.grad == 0).all(), label
        assert out.per_token.shape == data["mask"].shape
        losses = LOSS_METRICS | {term.loss_metric for term in alg.declared_terms}
        for key, value in out.metrics.items():
            if key in losses:
                assert value.item() == 0.0, (label, key)
            else:  # a mean over no tokens is undefined, never a made-up 0
                assert torch.isnan(value), (label, key, value)


@pytest.mark.parametrize("name", NAMES)
def test_empty_batches_from_hidden(name):
    for label, data in empty_batches():
        gen = torch.Generator().manual_seed(0)
        B, T = data["mask"].shape
        hidden = torch.randn(B, T, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        weight = torch.randn(6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
        targets = torch.randint(0, 6, (B, T), generator=gen)
        out = algorithm(name, kl_coef=0.1).from_hidden(
            hidden,
            weight,
            targets,
            old_log_prob=data["old_log_prob"],
            advantages=data["advantages"],
            mask=data["mask"],
            ref_log_prob=data["ref_log_prob"],
            group_ids=data["group_ids"],
            scores=data["scores"],
            teacher_log_prob=data["teacher_log_prob"],
        )
        out.loss.backward()
        assert out.loss.item() == 0.0, label
        assert (hidden.grad == 0).all() and (weight.grad == 0).all(), label


def test_float_mask_equals_bool_mask():
    data = make_batch(seed=45)
    a = call(pgloss.get("grpo"), data)
    data["mask"] = data["mask"].float()
    b = call(pgloss.get("grpo"), data)
    assert torch.equal(a.loss, b.loss)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="valid names: ppo, dual_clip_ppo"):
        pgloss.get("grpoo")


def test_unknown_hyperparameter_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'clip_ratio'"):
        pgloss.get("grpo", clip_ratio=0.2)
    with pytest.raises(TypeError, match="'tau_pos'"):
        pgloss.get("grpo", tau_pos=1.0)


@pytest.mark.parametrize(
    "name, hyperparameters, message",
    [
        ("dual_clip_ppo", dict(dual_clip=1.0), "dual_clip must be > 1"),
        ("ppo", dict(clip_low=-0.1), "clip_low must be >= 0"),
        ("ppo", dict(clip_high=-0.1), "clip_high must be >= 0"),
        ("ppo", dict(delta=1.1), "delta must be > 1 \\+ clip_high"),
        ("ppo", dict(loss_agg_mode="token-max"), "loss_agg_mode must be one of"),
        ("dr_grpo", dict(), "requires norm_constant"),
        ("dr_grpo", dict(norm_constant=0), "requires norm_constant"),
        ("grpo", dict(kl_estimator="k4"), "kl_estimator must be one of"),
        ("grpo", dict(kl_coef=-1.0), "kl_coef must be >= 0"),
        ("sapo", dict(tau_neg=0.0), "tau_pos and tau_neg must be > 0"),
        ("cispo", dict(clip_low=-1.0), "clip_low must be >= 0"),
        ("fipo", dict(fipo_clip_range=1.5), "fipo_clip_range"),
        ("ppo", dict(ratio_level="word"), "ratio_level must be one of"),
    ],
)
def test_impossible_hyperparameters_are_refused(name, hyperparameters, message):
    with pytest.raises(ValueError, match=message):
        pgloss.get(name, **hyperparameters)


def test_bad_tensors_are_refused_naming_the_argument():
    data = make_batch(seed=46)
    alg = pgloss.get("dapo")
    lp, old, adv, mask = data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"]
    with pytest.raises(ValueError, match="old_log_prob must have the shape of log_prob"):
        alg(lp, old[:, :-1], adv, mask)
    with pytest.raises(ValueError, match="log_prob must have 2 dimensions"):
        alg(lp[0], old, adv, mask)
    with pytest.raises(ValueError, match="advantages of shape \\[B\\]"):
        alg(lp, old, adv[:-1], mask)
    with pytest.raises(ValueError, match="mask must have shape"):
        alg(lp, old, adv, mask[:, :-1])
    with pytest.raises(TypeError, match="old_log_prob has dtype torch.float32 but log_prob has torch.float64"):
        alg(lp, old.float(), adv, mask)
    with pytest.raises(TypeError, match="log_prob must be a floating tensor"):
        alg(lp.long(), old, adv, mask)
    with pytest.raises(TypeError, match="advantages must be a torch.Tensor"):
        alg(lp, old, [1.0] * 5, mask)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        alg(lp, old, adv, mask.float() * 2)
    with pytest.raises(ValueError, match="needs ref_log_prob"):
        pgloss.get("grpo")(lp, old, adv, mask)
    with pytest.raises(ValueError, match="needs entropy"):
        pgloss.get("grpo", kl_coef=0.0, entropy_coef=0.1)(lp, old, adv, mask)
    with pytest.raises(ValueError, match="needs group_ids"):
        pgloss.get("dapo", loss_agg_mode="group-mean-token-mean")(lp, old, adv, mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_mismatched_devices_are_refused():
    data = make_batch(seed=47)
    with pytest.raises(ValueError, match="is on"):
        pgloss.get("dapo")(data["log_prob"].cuda(), data["old_log_prob"], data["advantages"], data["mask"].cuda())


def test_mismatched_devices_are_refused_on_meta():
    data = make_batch(seed=47)
    with pytest.raises(ValueError, match="old_log_prob is on meta but log_prob is on cpu"):
        pgloss.get("dapo")(data["log_prob"], data["old_log_prob"].to("meta"), data["advantages"], data["mask"])
