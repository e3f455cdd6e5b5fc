"""SDAR's gated distillation term (`sdar_coef`, terms/sdar.py), RLSD's token reweighting and its λ schedule
(`pgloss.advantages.rlsd_advantages`, `rlsd_lambda`) and Trinity-RFT's JSD advantage (`jsd_advantages`) against
their float64 loops (tests/loops/distillation.py), with a gradient check for the term, and against the trainers'
own functions cut from their released sources without importing their packages:

    ms-swift 4.6.0  swift/rl_core/advantage.py `compute_sdar_loss` (with `_sdar_agg_loss`), `apply_rlsd_reweight`;
                    swift/rlhf_trainers/grpo_trainer.py `GRPOTrainer._rlsd_effective_lambda`     (PGLOSS_MS_SWIFT_SRC)
    Trinity 0.6.0   trinity/algorithm/advantage_fn/jsd_advantage.py `JSDAdvantage`              (PGLOSS_TRINITY_SRC)

Measured (float64, 3 seeds, B = 6, T = 7, one empty row): SDAR loss ≤ 1.2e-16 and ∂/∂log π exactly equal at
β ∈ {5, 1} (one micro-batch: ms-swift's token mean is the micro-batch's, pgloss's the step's); RLSD exactly equal
(λ ∈ {0.5, 1, 0}, ε_w ∈ {0.2, 0.05}, negative_only both, a zero advantage); the λ schedule exactly, steps 0..40
with warm-up 10 and decay 20; JSD ≤ 4.5e-16 (β ∈ {0.5, 0.2, 0, 1}, kl_coef ∈ {1, 0.5}). Asserted 1e-12.
"""

from __future__ import annotations

from types import SimpleNamespace

import loops
import pytest
import torch
from advantages.trainer_sources import load, source_file
from conftest import make_batch

import pgloss
from pgloss.advantages.distillation import jsd_advantages, rlsd_advantages, rlsd_lambda
from pgloss.conformance import sources

SWIFT_ADVANTAGE = "swift/rl_core/advantage.py"
SWIFT_TRAINER = "swift/rlhf_trainers/grpo_trainer.py"
JSD = "trinity/algorithm/advantage_fn/jsd_advantage.py"


def data(seed):
    batch = make_batch(batch=6, length=7, seed=seed, spread=0.5)
    gen = torch.Generator().manual_seed(70 + seed)
    noise = 1.2 * torch.randn(6, 7, generator=gen, dtype=torch.float64)
    batch["teacher_log_prob"] = (batch["old_log_prob"] + noise).clamp(max=0)
    return batch


def swift(*names):
    namespace = {"torch": torch, "Tuple": tuple, "Dict": dict, "Optional": None, "List": list}
    return load(source_file("PGLOSS_MS_SWIFT_SRC", SWIFT_ADVANTAGE), names, namespace)


# SDAR


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [5.0, 1.0])
@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_sdar_matches_loop(seed, beta, name):
    batch = data(seed)
    lp = batch["log_prob"].clone().requires_grad_(True)
    plain = pgloss.get(name, kl_coef=0.0)
    alg = pgloss.get(name, kl_coef=0.0, sdar_coef=0.1, sdar_gate_beta=beta)
    args = (batch["old_log_prob"], batch["advantages"], batch["mask"])
    out = alg(lp, *args, teacher_log_prob=batch["teacher_log_prob"])
    (grad,) = torch.autograd.grad(out.loss, lp)
    lp0 = batch["log_prob"].clone().requires_grad_(True)
    base = plain(lp0, *args)
    (base_grad,) = torch.autograd.grad(base.loss, lp0)
    mask = batch["mask"].tolist()
    values, grads = loops.sdar(batch["log_prob"].tolist(), batch["teacher_log_prob"].tolist(), gate_beta=beta)
    term = loops.aggregate(values, mask, "token-mean")  # whatever the policy's mode
    assert out.loss.item() == pytest.approx(base.loss.item() + 0.1 * term, rel=1e-12)
    expected = base_grad + 0.1 * torch.tensor(grads, dtype=torch.float64) * batch["mask"] / batch["mask"].sum()
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [5.0, 1.0])
def test_sdar_against_ms_swift(seed, beta):
    compute_sdar_loss = swift("_sdar_agg_loss", "compute_sdar_loss")["compute_sdar_loss"]
    batch = data(seed)
    lp = batch["log_prob"].clone().requires_grad_(True)
    expected, _ = compute_sdar_loss(lp, batch["teacher_log_prob"], batch["mask"].double(), gate_beta=beta)
    (expected_grad,) = torch.autograd.grad(expected, lp)
    alg = pgloss.get("grpo", kl_coef=0.0, policy_coef=0.0, sdar_coef=1.0, sdar_gate_beta=beta)
    lp = batch["log_prob"].clone().requires_grad_(True)
    out = alg(lp, batch["old_log_prob"], batch["advantages"], batch["mask"], teacher_log_prob=batch["teacher_log_prob"])
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert abs(out.loss.item() - expected.item()) <= 1e-12
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


def test_sdar_bad_beta_is_named():
    with pytest.raises(ValueError, match="sdar_gate_beta"):
        pgloss.get("grpo", sdar_coef=0.1, sdar_gate_beta=0.0)
    batch = data(0)
    with pytest.raises(ValueError, match="teacher_log_prob"):
        pgloss.get("dapo", sdar_coef=0.1)(batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"])


# RLSD

RLSD_CASES = [
    dict(lam=0.5, clip_range=0.2, negative_only=False),
    dict(lam=1.0, clip_range=0.05, negative_only=False),
    dict(lam=0.5, clip_range=0.2, negative_only=True),
    dict(lam=0.0, clip_range=0.2, negative_only=False),
]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", RLSD_CASES, ids=str)
def test_rlsd_matches_loop_and_ms_swift(seed, case):
    apply_rlsd_reweight = swift("apply_rlsd_reweight")["apply_rlsd_reweight"]
    batch = data(seed)
    teacher, old, mask, adv = batch["teacher_log_prob"], batch["old_log_prob"], batch["mask"], batch["advantages"]
    adv = torch.where(torch.arange(6) == 1, 0.0, adv)  # a zero advantage: sign 0, weight 1
    ours = rlsd_advantages(adv, teacher, old, mask, **case)
    loop = loops.rlsd(adv.tolist(), teacher.tolist(), old.tolist(), mask.tolist(), **case)
    torch.testing.assert_close(ours, torch.tensor(loop, dtype=torch.float64), rtol=1e-13, atol=1e-15)
    theirs = apply_rlsd_reweight(
        adv, mask.double(), teacher, old, case["lam"], case["clip_range"], case["negative_only"]
    )
    assert (ours - theirs).abs().max().item() <= 1e-12
    assert (torch.sign(ours) == torch.where(mask, torch.sign(adv)[:, None], 0.0)).all()  # never flips a sign


def test_rlsd_per_token_advantages_and_bad_input():
    batch = data(4)
    teacher, old, mask, adv = batch["teacher_log_prob"], batch["old_log_prob"], batch["mask"], batch["advantages"]
    per_token = rlsd_advantages(adv[:, None].expand(6, 7), teacher, old, mask)
    torch.testing.assert_close(per_token, rlsd_advantages(adv, teacher, old, mask), rtol=0, atol=0)
    with pytest.raises(ValueError, match="lam"):
        rlsd_advantages(adv, teacher, old, mask, lam=1.5)
    with pytest.raises(ValueError, match="clip_range"):
        rlsd_advantages(adv, teacher, old, mask, clip_range=-0.1)
    with pytest.raises(ValueError, match="teacher_log_prob"):
        rlsd_advantages(adv, teacher[:, :3], old, mask)
    with pytest.raises(ValueError, match="advantages"):
        rlsd_advantages(adv[:3], teacher, old, mask)


@pytest.mark.parametrize(("warmup", "decay"), [(0, 0), (10, 0), (0, 20), (10, 20)])
def test_rlsd_lambda_matches_loop_and_ms_swift(warmup, decay):
    path = source_file("PGLOSS_MS_SWIFT_SRC", SWIFT_TRAINER)
    method = sources.load(path, ("_rlsd_effective_lambda",), {}, within="GRPOTrainer")
    for step in range(41):
        trainer = SimpleNamespace(
            state=SimpleNamespace(global_step=step),
            rlsd_lambda_warmup_steps=warmup,
            rlsd_lambda_decay_steps=decay,
            rlsd_lambda=0.5,
        )
        ours = rlsd_lambda(step, 0.5, warmup_steps=warmup, decay_steps=decay)
        assert ours == method["_rlsd_effective_lambda"](trainer)
        assert ours == pytest.approx(loops.rlsd_lambda(step, 0.5, warmup, decay), abs=1e-15)


# Trinity's JSD advantage


def trinity_jsd(batch, beta, coef):
    class AdvantageFn:
        pass

    namespace = {"torch": torch, "AdvantageFn": AdvantageFn, "DataProto": object, "Dict": dict, "Optional": None}
    namespace["Tuple"] = tuple
    cls = load(source_file("PGLOSS_TRINITY_SRC", JSD), ("JSDAdvantage",), namespace)["JSDAdvantage"]
    exps = SimpleNamespace(
        batch={
            "old_log_probs": batch["old_log_prob"],
            "teacher_logprobs": batch["teacher_log_prob"],
            "response_mask": batch["mask"].double(),
        }
    )
    out, _ = cls(lambda_coef=beta, kl_coef=coef)(exps)
    return out.batch["advantages"]


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("beta", [0.5, 0.2, 0.0, 1.0])
@pytest.mark.parametrize("coef", [1.0, 0.5])
def test_jsd_matches_loop_and_trinity(seed, beta, coef):
    batch = data(seed)
    teacher, old, mask = batch["teacher_log_prob"], batch["old_log_prob"], batch["mask"]
    ours = jsd_advantages(teacher, old, mask, beta=beta, coef=coef)
    loop = loops.jsd_advantage(teacher.tolist(), old.tolist(), mask.tolist(), beta=beta, coef=coef)
    torch.testing.assert_close(ours, torch.tensor(loop, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert (ours - trinity_jsd(batch, beta, coef)).abs().max().item() <= 1e-12


def test_jsd_at_zero_is_opd_and_bad_beta_is_named():
    batch = data(5)
    teacher, old, mask = batch["teacher_log_prob"], batch["old_log_prob"], batch["mask"]
    expected = torch.where(mask, teacher - old, 0.0)
    torch.testing.assert_close(jsd_advantages(teacher, old, mask, beta=0.0), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="beta"):
        jsd_advantages(teacher, old, mask, beta=1.5)
