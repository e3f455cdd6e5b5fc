"""CHORD (`pgloss.get("chord")`, arXiv 2508.11408) and its μ schedule (`pgloss.MuSchedule`) against their
float64 loops (tests/loops/terms.py), closed-form gradients, splits of the step, and Trinity-RFT 0.6.0's
own `MIXCHORDPolicyLossFn`, `SFTPhiLossFn`, `SFTISLossFn` and `mu_schedule_function`.

Trinity's source: PGLOSS_TRINITY_SRC, the root of an unpacked Trinity-RFT 0.6.0 wheel; its package import
pulls the whole trainer, so algorithm/key_mapper.py, algorithm/utils.py and policy_loss_fn/{policy_loss_fn,
ppo_policy_loss, sft_loss, chord_policy_loss}.py are loaded by path under stub packages (skipped without it).
Measured (6 seeds, B = 8 with 3 expert rows, T = 7, one micro-batch = the step, Trinity's
`ppo_mini_batch_size` = `ppo_micro_batch_size_per_gpu` = B and `train_batch_size_usual/expert` the
rows of each kind, clip 0.2, dual clip 3; value and gradient w.r.t. log π, max |Δ| relative to the
largest value): MIXCHORD with φ and with plain SFT, μ ∈ {0.1, 0.6} from the schedule at steps 0, 3, 7
(warm-up 4, decay 5), token-mean and seq-mean-token-mean: float64 4.3e-16, float32 3.4e-7;
SFTPhiLossFn with cutoff 0.5 and SFTISLossFn (μ = 1, every row expert): float64 2.3e-16, float32 1.1e-7;
`mu_schedule_function` over steps 0..14: equal. Asserted: relative 1e-13 (float64), 1e-6 (float32).
"""

from __future__ import annotations

import os

import loops
import pytest
import torch
from conftest import make_batch
from properties.micro_batches import cut, split_call
from trinity_losses import policy_loss_modules

import pgloss

TRINITY = os.environ.get("PGLOSS_TRINITY_SRC")
needs_trinity = pytest.mark.skipif(not TRINITY, reason="PGLOSS_TRINITY_SRC (an unpacked Trinity-RFT 0.6.0) is not set")
F64 = dict(dtype=torch.float64)
EXPERT = torch.tensor([True, False, False, True, False, True, False, False])


def batch(seed, dtype=torch.float64, spread=0.5):
    data = make_batch(batch=8, length=7, seed=seed, spread=spread, dtype=dtype)
    data["mask"][3] = data["mask"][2]  # make_batch empties row 3: keep every row non-empty here
    data["expert"] = EXPERT.clone()
    return data


def call(alg, data, log_prob=None, **extra):
    return alg(
        data["log_prob"] if log_prob is None else log_prob,
        data["old_log_prob"],
        data["advantages"],
        data["mask"],
        expert=data["expert"],
        **extra,
    )


def loop(alg, data):
    return loops.chord_loss(
        data["log_prob"].tolist(),
        data["old_log_prob"].tolist(),
        data["advantages"].tolist(),
        data["mask"].tolist(),
        data["expert"].tolist(),
        mu=alg.chord_mu,
        mode=alg.loss_agg_mode,
        sft_mode=alg.sft_loss_agg_mode,
        weight=alg.sft_weight,
        cutoff=alg.sft_cutoff_prob,
        clip=alg.clip_low,
        dual_clip=alg.dual_clip,
    )


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(chord_mu=0.6, sft_weight="none"),
        dict(chord_mu=0.3, sft_weight="is"),
        dict(chord_mu=0.5, sft_cutoff_prob=0.4),
        dict(chord_mu=0.2, loss_agg_mode="seq-mean-token-mean"),
        dict(chord_mu=0.7, sft_loss_agg_mode="seq-mean-token-sum"),
        dict(chord_mu=0.0),
        dict(chord_mu=1.0),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop(settings, seed):
    data = batch(seed, spread=1.0)
    alg = pgloss.get("chord", **settings)
    assert call(alg, data).loss.item() == pytest.approx(loop(alg, data), rel=1e-12, abs=1e-15)


def test_without_expert_rows_it_is_the_clipped_loss_scaled():
    data = batch(2)
    ppo = pgloss.get("dual_clip_ppo", loss_agg_mode="token-mean")
    alg = pgloss.get("chord", chord_mu=0.25)
    plain = ppo(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"]).loss
    out = alg(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    torch.testing.assert_close(out.loss, 0.75 * plain, rtol=1e-14, atol=0)


@pytest.mark.parametrize(("weight", "cutoff"), [("phi", 1.0), ("phi", 0.4), ("none", 1.0), ("is", 1.0)])
def test_expert_gradient_is_the_weighted_sft_step(weight, cutoff):
    """∂L/∂log p on an expert token = −μ·w(p)/N_E (token-mean): w = φ(p) (0 above the cutoff), 1, or p."""
    data = batch(3, spread=1.5)
    data["log_prob"] = data["log_prob"] * 0.3  # probabilities spread over (0, 1): φ and the cutoff matter
    lp = data["log_prob"].clone().requires_grad_(True)
    alg = pgloss.get("chord", chord_mu=0.4, sft_weight=weight, sft_cutoff_prob=cutoff)
    call(alg, data, lp).loss.backward()
    p = data["log_prob"].exp()
    w = {"phi": p * (1 - p) * (p <= cutoff), "none": torch.ones_like(p), "is": p}[weight]
    tokens = data["mask"] & data["expert"][:, None]
    expected = torch.where(tokens, -0.4 * w / tokens.sum(), 0.0)
    torch.testing.assert_close(torch.where(tokens, lp.grad, 0.0), expected, rtol=1e-13, atol=1e-16)
    if cutoff < 1:
        assert bool(((p > cutoff) & tokens).any()) and bool(((p <= cutoff) & tokens).any())


def test_gradcheck():
    """Plain SFT on the expert rows (φ and p are stop-gradient weights, whose derivative the numerical check
    would see: test_expert_gradient_is_the_weighted_sft_step holds their gradient in closed form)."""
    data = batch(4)
    alg = pgloss.get(
        "chord", chord_mu=0.3, sft_weight="none", loss_agg_mode="seq-mean-token-mean", kl_coef=0.1, entropy_coef=0.01
    )

    def loss(log_prob, entropy):
        return alg(
            log_prob,
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            expert=data["expert"],
            ref_log_prob=data["ref_log_prob"],
            entropy=entropy,
        ).loss

    assert torch.autograd.gradcheck(
        loss, (data["log_prob"].clone().requires_grad_(True), data["entropy"].clone().requires_grad_(True))
    )


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "group-mean-token-mean", "delta-l-norm"])
@pytest.mark.parametrize("parts", [[slice(0, 3), slice(3, 8)], [slice(0, 1), slice(1, 5), slice(5, 8)]])
def test_micro_batches_add_up(mode, parts):
    data = batch(5)
    alg = pgloss.get(
        "chord",
        chord_mu=0.4,
        loss_agg_mode=mode,
        norm_constant=7.0,
        kl_coef=0.05,
        sft_loss_agg_mode="seq-mean-token-mean",
    )
    whole_lp = data["log_prob"].clone().requires_grad_(True)
    whole = call(alg, data, whole_lp, ref_log_prob=data["ref_log_prob"], group_ids=data["group_ids"]).loss
    whole.backward()
    norm = alg.step_normalizer(
        cut(data["mask"], parts), expert=cut(data["expert"], parts), group_ids=cut(data["group_ids"], parts)
    )
    total, grad = split_call(
        alg,
        data["log_prob"],
        parts,
        norm,
        old_log_prob=data["old_log_prob"],
        advantages=data["advantages"],
        mask=data["mask"],
        expert=data["expert"],
        ref_log_prob=data["ref_log_prob"],
        group_ids=data["group_ids"],
    )
    torch.testing.assert_close(total, whole.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_lp.grad, rtol=1e-12, atol=1e-14)


def test_inputs_and_hyperparameters_are_checked():
    data = batch(6)
    dapo = pgloss.get("dapo")  # a family that does not read the flags ignores them, as any input it does not need
    torch.testing.assert_close(call(dapo, data).loss, call(dapo, {**data, "expert": None}).loss, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs a Normalizer that counted them apart"):
        call(pgloss.get("chord"), data, normalizer=pgloss.Normalizer.count(data["mask"]))
    with pytest.raises(ValueError, match=r"expert must be a bool tensor of shape \[8\]"):
        call(pgloss.get("chord"), {**data, "expert": data["expert"].long()})
    with pytest.raises(ValueError, match=r"chord_mu must lie in \[0, 1\]"):
        pgloss.get("chord", chord_mu=1.5)
    with pytest.raises(ValueError, match="sft_weight must be one of"):
        pgloss.get("chord", sft_weight="sqrt")
    with pytest.raises(ValueError, match="sft_cutoff_prob applies to sft_weight='phi' only"):
        pgloss.get("chord", sft_weight="none", sft_cutoff_prob=0.5)
    with pytest.raises(ValueError, match="sft_loss_agg_mode 'seq-mean-token-sum-norm' requires norm_constant"):
        pgloss.get("chord", sft_loss_agg_mode="seq-mean-token-sum-norm")
    assert "group_ids" in pgloss.get("chord", sft_loss_agg_mode="group-mean-token-mean").needs


def test_inspect_has_no_closed_form_with_expert_rows():
    from pgloss.diagnostics.inspect import inspect

    data = batch(8)
    alg = pgloss.get("chord", chord_mu=0.3)
    report = inspect(
        alg, data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"], expert=data["expert"]
    )
    assert report.factor is None and "expert rows" in report.reason
    lp = data["log_prob"].clone().requires_grad_(True)
    call(alg, data, lp).loss.backward()
    torch.testing.assert_close(report.grad, lp.grad, rtol=1e-13, atol=1e-16)
    plain = inspect(alg, data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])
    assert plain.factor is not None  # no expert rows: the clipped family's closed form times 1 − μ
    torch.testing.assert_close(plain.grad, -plain.advantage * plain.factor * plain.weight, rtol=1e-12, atol=1e-15)


# -- the μ schedule --------------------------------------------------------------------------------------------

SCHEDULES = [
    dict(warmup_steps=4, decay_steps=5, peak=0.6, valley=0.1),
    dict(warmup_steps=0, decay_steps=3, peak=0.9, valley=0.0),
    dict(warmup_steps=2, decay_steps=0, peak=0.5, valley=0.2),
    dict(),
]


@pytest.mark.parametrize("settings", SCHEDULES)
def test_mu_schedule_matches_loop(settings):
    schedule = pgloss.MuSchedule(**settings)
    full = dict(warmup_steps=0, decay_steps=0, peak=0.1, valley=0.1) | settings
    for step in range(15):
        assert schedule(step) == pytest.approx(loops.chord_mu(step, **full), abs=1e-15)
    assert schedule.algorithm(pgloss.get("chord"), 2).chord_mu == schedule(2)


def test_mu_schedule_checks():
    with pytest.raises(ValueError, match=r"peak must lie in \[0, 1\]"):
        pgloss.MuSchedule(peak=2.0)
    with pytest.raises(ValueError, match="warmup_steps must be >= 0"):
        pgloss.MuSchedule(warmup_steps=-1)
    with pytest.raises(TypeError, match="step must be an integer"):
        pgloss.MuSchedule()(1.5)
    with pytest.raises(TypeError, match="has no chord_mu"):
        pgloss.MuSchedule().algorithm(pgloss.get("dapo"), 0)


# -- Trinity-RFT 0.6.0 -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trinity():
    with policy_loss_modules(TRINITY, "ppo_policy_loss", "sft_loss", "chord_policy_loss") as modules:
        yield modules["chord_policy_loss"]


MEASURED: dict[str, float] = {}
"""case and dtype -> the largest relative |Δ| of this run (`pytest -s` prints them: test_report_measured)."""


def compare(ours_fn, theirs_fn, data, key):
    x = data["log_prob"].clone().requires_grad_()
    y = data["log_prob"].clone().requires_grad_()
    ours, theirs = ours_fn(x), theirs_fn(y)
    ours.backward()
    theirs.backward()
    scale = max(theirs.abs().item(), y.grad.abs().max().item())
    diff = max((ours - theirs).abs().item(), (x.grad - y.grad)[data["mask"]].abs().max().item()) / scale
    assert diff <= (1e-6 if x.dtype == torch.float32 else 1e-13), diff
    assert scale > 1e-4
    key = f"{key} {x.dtype}"
    MEASURED[key] = max(MEASURED.get(key, 0.0), diff)
    return diff


@needs_trinity
@pytest.mark.parametrize("phi", [True, False])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("step", [0, 3, 7])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_trinity_mix_chord(trinity, phi, mode, step, seed, dtype):
    data = batch(seed, dtype, spread=0.8)
    expert = data["expert"]
    n_expert = int(expert.sum())
    schedule = dict(mu_warmup_steps=4, mu_decay_steps=5, mu_peak=0.6, mu_valley=0.1)
    fn = trinity.MIXCHORDPolicyLossFn(
        **schedule,
        enable_phi_function=phi,
        clip_range=0.2,
        ppo_mini_batch_size=8,
        ppo_micro_batch_size_per_gpu=8,
        ngpus_trainer=1,
        train_batch_size_usual=8 - n_expert,
        train_batch_size_expert=n_expert,
        loss_agg_mode=mode,
    )
    mu = pgloss.MuSchedule(peak=0.6, valley=0.1, warmup_steps=4, decay_steps=5)
    assert mu(step) == trinity.mu_schedule_function(step, 4, 5, 0.6, 0.1)
    alg = mu.algorithm(pgloss.get("chord", loss_agg_mode=mode, sft_weight="phi" if phi else "none"), step)
    adv = data["advantages"][:, None] * data["mask"]
    compare(
        lambda x: call(alg, data, x).loss,
        lambda y: fn(
            logprob=y,
            old_logprob=data["old_log_prob"],
            action_mask=data["mask"],
            advantages=adv,
            expert_mask=expert,
            step=torch.full((8,), step),
        )[0],
        data,
        "mix_chord",
    )


@needs_trinity
@pytest.mark.parametrize("weight", ["phi", "is"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_sft_parts_match_trinity(trinity, weight, seed, dtype):
    """Trinity's standalone SFTPhiLossFn (with its cutoff, which MIXCHORD does not pass) and SFTISLossFn:
    pgloss's CHORD with μ = 1 on all-expert rows."""
    data = batch(seed, dtype, spread=1.5)
    data["log_prob"] = data["log_prob"] * 0.3
    data["expert"] = torch.ones(8, dtype=torch.bool)
    if weight == "phi":
        fn, alg = trinity.SFTPhiLossFn(cutoff_prob=0.5), pgloss.get("chord", chord_mu=1.0, sft_cutoff_prob=0.5)
    else:
        fn, alg = trinity.SFTISLossFn(), pgloss.get("chord", chord_mu=1.0, sft_weight="is")
    compare(lambda x: call(alg, data, x).loss, lambda y: fn(logprob=y, action_mask=data["mask"])[0], data, weight)


@needs_trinity
def test_report_measured():
    for key, value in sorted(MEASURED.items()):
        print(f"CHORD parity {key}: {value:.1e}")


@pytest.mark.parametrize("key", ["advantages", "old_log_prob"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "+inf", "-inf"])
def test_an_expert_rows_advantage_and_old_log_prob_reach_nothing(key, value):
    """The SFT term of an expert row reads neither its advantage nor its old log-prob (a demonstration has no
    reward): the clipped term runs on the on-policy rows alone (`TokenBatch.restricted`), so a non-finite value
    there leaves the loss and the gradient those of the loop. (Before: a finite loss with a NaN gradient on the
    expert row, from the clipped term's value discarded by a `where`.)"""
    clean = batch(seed=3)
    data = {k: v.clone() for k, v in clean.items()}
    at = int(EXPERT.nonzero()[0, 0]) if key == "advantages" else (int(EXPERT.nonzero()[0, 0]), 0)  # Â is [B]
    data[key][at] = -abs(value) if key == "old_log_prob" else value  # a log-prob is never above 0
    alg = pgloss.get("chord", chord_mu=0.4)
    leaf = data["log_prob"].clone().requires_grad_(True)
    out = call(alg, data, leaf)
    out.loss.backward()
    assert torch.isfinite(leaf.grad).all()
    assert out.loss.item() == pytest.approx(loop(alg, clean), rel=1e-12, abs=1e-14)
    reference = clean["log_prob"].clone().requires_grad_(True)
    call(alg, clean, reference).loss.backward()
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-12, atol=1e-15)
