"""The policy-gradient distillation term (`distill_coef`, terms/distillation.py) and `distill_ppo` against their
float64 loop (tests/loops/distillation.py) with a gradient check, and against verl 0.9.1's own
`verl/trainer/distillation/losses.py` `distillation_loss` (with `compute_distillation_loss_reverse_kl_estimator`)
beside its `vanilla` policy loss, imported from the installed package.

verl's `distillation_loss` reads padded tensors through `no_padding_2_padding` (a layout function): the test passes
padded `[B, T]` tensors and replaces it by the identity. Measured (float64, 3 seeds, B = 6, T = 7, one empty row,
the four estimators, clamp 10 and None, use_policy_gradient True and False, coefficient 1 and 0.5): |Δ loss| ≤ 4.5e-16,
|Δ ∂/∂log π| ≤ 1.2e-16 (asserted 1e-12).
"""

from __future__ import annotations

import loops
import pytest
import torch
from conftest import make_batch

import pgloss

ESTIMATORS = ("k1", "k2", "k3", "abs")
VERL_MODES = {"k1": "k1", "k2": "mse", "k3": "low_var_kl", "abs": "abs"}  # verl's names for the same estimators


def data(seed, spread=0.6):
    batch = make_batch(batch=6, length=7, seed=seed, spread=spread, per_token_adv=False)
    gen = torch.Generator().manual_seed(50 + seed)
    batch["teacher_log_prob"] = (
        batch["old_log_prob"] + 1.5 * torch.randn(6, 7, generator=gen, dtype=torch.float64)
    ).clamp(max=0)
    return batch


def weights(mask, mode):
    """The aggregation weight of each token: the loop's aggregate of a one-hot value."""
    rows, length = len(mask), len(mask[0])
    out = [[0.0] * length for _ in range(rows)]
    for i in range(rows):
        for t in range(length):
            if mask[i][t]:
                onehot = [[1.0 if (j, s) == (i, t) else 0.0 for s in range(length)] for j in range(rows)]
                out[i][t] = loops.aggregate(onehot, mask, mode)
    return torch.tensor(out, dtype=torch.float64)


def term_loss(alg, batch):
    """(loss, ∂loss/∂log π) of `alg` with the policy term off (`policy_coef=0`): the distillation term alone."""
    lp = batch["log_prob"].clone().requires_grad_(True)
    out = alg(lp, batch["old_log_prob"], batch["advantages"], batch["mask"], teacher_log_prob=batch["teacher_log_prob"])
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("clamp", [10.0, 0.3, None])
def test_policy_gradient_term_matches_loop(seed, estimator, clamp):
    batch = data(seed)
    alg = pgloss.get("distill_ppo", distill_estimator=estimator, distill_clamp=clamp, distill_coef=0.7, policy_coef=0.0)
    out, grad = term_loss(alg, batch)
    lp, old, teacher, mask = (batch[k].tolist() for k in ("log_prob", "old_log_prob", "teacher_log_prob", "mask"))
    values, grads = loops.distill_pg(lp, old, teacher, estimator=estimator, clamp=clamp)
    expected = 0.7 * loops.aggregate(values, mask, "token-mean")
    assert out.loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-14)
    expected_grad = 0.7 * torch.tensor(grads, dtype=torch.float64) * weights(mask, "token-mean")
    torch.testing.assert_close(grad, expected_grad, rtol=1e-12, atol=1e-14)
    assert out.metrics["distill_loss"].item() == pytest.approx(expected / 0.7, rel=1e-12, abs=1e-14)


def test_clip_and_dual_clip_are_reached():
    """The batches above reach both clips and the dual clip (else the gradient check proves less)."""
    batch = data(0, spread=1.0)
    lp, old, teacher = (batch[k].tolist() for k in ("log_prob", "old_log_prob", "teacher_log_prob"))
    _, grads = loops.distill_pg(lp, old, teacher, estimator="k1")
    flat = [g for row, m in zip(grads, batch["mask"].tolist(), strict=True) for g, v in zip(row, m, strict=True) if v]
    assert 0 < sum(g == 0.0 for g in flat) < len(flat)


@pytest.mark.parametrize("estimator", ["k2", "k3", "abs"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_direct_term_matches_loop(estimator, mode):
    batch = data(3)
    alg = pgloss.get(
        "distill_ppo", distill_estimator=estimator, distill_policy_gradient=False, policy_coef=0.0, loss_agg_mode=mode
    )
    out, grad = term_loss(alg, batch)
    lp, teacher, mask = (batch[k].tolist() for k in ("log_prob", "teacher_log_prob", "mask"))
    values, grads = loops.distill_direct(lp, teacher, estimator=estimator, clamp=10.0)
    assert out.loss.item() == pytest.approx(loops.aggregate(values, mask, mode), rel=1e-12)
    torch.testing.assert_close(
        grad, torch.tensor(grads, dtype=torch.float64) * weights(mask, mode), rtol=1e-12, atol=1e-14
    )


def test_total_is_task_plus_coefficient_times_term():
    batch = data(4)
    alg = pgloss.get("distill_ppo", distill_coef=0.5)
    full, _ = term_loss(alg, batch)
    task, _ = term_loss(pgloss.get("distill_ppo", distill_coef=0.0), batch)
    alone, _ = term_loss(pgloss.get("distill_ppo", distill_coef=0.5, policy_coef=0.0), batch)
    assert full.loss.item() == pytest.approx(task.loss.item() + alone.loss.item(), rel=1e-14)
    assert full.metrics["pg_loss"].item() == pytest.approx(task.loss.item(), rel=1e-14)


def test_bad_options_are_named():
    with pytest.raises(ValueError, match="distill_estimator.*did you mean 'k3'"):
        pgloss.get("distill_ppo", distill_estimator="low_var_kl")
    with pytest.raises(ValueError, match="distill_policy_gradient"):
        pgloss.get("distill_ppo", distill_estimator="k1", distill_policy_gradient=False)
    with pytest.raises(ValueError, match="distill_dual_clip"):
        pgloss.get("distill_ppo", distill_dual_clip=1.0)
    with pytest.raises(ValueError, match="policy_coef"):
        pgloss.get("distill_ppo", policy_coef=-1.0)
    batch = data(0)
    with pytest.raises(ValueError, match="teacher_log_prob"):
        pgloss.get("distill_ppo")(batch["log_prob"], batch["old_log_prob"], batch["advantages"], batch["mask"])


# verl 0.9.1's own functions, imported from the installed package.


def verl_loss(batch, *, estimator, clamp, policy_gradient, coef):
    """verl's total: `vanilla` on the task's advantages + coef × `distillation_loss` (as `distillation_ppo_loss`
    adds them with use_task_rewards=True), token-mean, with (loss, ∂/∂log π)."""
    losses = pytest.importorskip("verl.trainer.distillation.losses")
    from types import SimpleNamespace

    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    loss_config = DistillationLossConfig(
        loss_mode=VERL_MODES[estimator], loss_max_clamp=clamp, use_policy_gradient=policy_gradient
    )
    mask = batch["mask"]
    info = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(-1) > 0).sum()))
    actor = SimpleNamespace(loss_agg_mode="token-mean", global_batch_info={}, loss_scale_factor=None)
    lp = batch["log_prob"].clone().requires_grad_(True)
    inputs = dict(
        response_mask=mask,
        teacher_logprobs=batch["teacher_log_prob"].unsqueeze(-1),
        old_log_probs=batch["old_log_prob"],
        **info,
    )
    original = losses.no_padding_2_padding
    losses.no_padding_2_padding = lambda tensor, data: tensor  # the tensors are padded [B, T] already
    try:
        distill, _ = losses.distillation_loss(
            actor, DistillationConfig(distillation_loss=loss_config), {"log_probs": lp}, inputs
        )
    finally:
        losses.no_padding_2_padding = original
    task_config = DistillationLossConfig(loss_mode="k1")  # verl's vanilla clip 0.2/0.2, c = 3, for the task
    task_config.global_batch_info.update(info)
    advantages = batch["advantages"][:, None].expand_as(lp)
    task, _ = get_policy_loss_fn("vanilla")(batch["old_log_prob"], lp, advantages, mask, "token-mean", task_config)
    total = task + coef * distill
    (grad,) = torch.autograd.grad(total, lp)
    return total.detach(), grad


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("clamp", [10.0, None])
@pytest.mark.parametrize("policy_gradient", [True, False])
def test_against_verl(seed, estimator, clamp, policy_gradient):
    if estimator == "k1" and not policy_gradient:
        pytest.skip("verl refuses k1 without the policy gradient, as pgloss does")
    coef = 0.5 if seed == 2 else 1.0
    batch = data(seed)
    expected, expected_grad = verl_loss(
        batch, estimator=estimator, clamp=clamp, policy_gradient=policy_gradient, coef=coef
    )
    alg = pgloss.get(
        "distill_ppo",
        distill_estimator=estimator,
        distill_clamp=clamp,
        distill_policy_gradient=policy_gradient,
        distill_coef=coef,
    )
    lp = batch["log_prob"].clone().requires_grad_(True)
    out = alg(lp, batch["old_log_prob"], batch["advantages"], batch["mask"], teacher_log_prob=batch["teacher_log_prob"])
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert abs(out.loss.item() - expected.item()) <= 1e-12
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("task", [True, False])
def test_from_verl_reads_verl_distillation_config(estimator, task):
    """`pgloss.from_verl(actor, distillation=)` maps verl's own `DistillationLossConfig` (trainer_options/
    verl_distillation.py) to the configuration that gives verl's total: the vanilla task loss + coef × distillation,
    or the distillation alone (coefficient 1, as verl's `distillation_ppo_loss` takes it) without task rewards."""
    pytest.importorskip("verl.trainer.distillation.losses")
    from verl.workers.config import DistillationLossConfig

    batch = data(1)
    loss = DistillationLossConfig(loss_mode=VERL_MODES[estimator], distillation_loss_coef=0.5, use_task_rewards=task)
    actor = {"policy_loss": {"loss_mode": "vanilla"}, "loss_agg_mode": "token-mean", "clip_ratio_c": 3.0}
    # verl's `distillation` section: its own loss config (a DistillationConfig with enabled=True needs teachers)
    alg = pgloss.from_verl(actor, distillation={"enabled": True, "distillation_loss": loss})
    expected, expected_grad = verl_loss(batch, estimator=estimator, clamp=10.0, policy_gradient=True, coef=0.5)
    if not task:  # verl's total is then the distillation loss alone: its part of the total above, over 0.5
        task_only, task_grad = verl_loss(batch, estimator=estimator, clamp=10.0, policy_gradient=True, coef=0.0)
        expected, expected_grad = (expected - task_only) / 0.5, (expected_grad - task_grad) / 0.5
    lp = batch["log_prob"].clone().requires_grad_(True)
    out = alg(lp, batch["old_log_prob"], batch["advantages"], batch["mask"], teacher_log_prob=batch["teacher_log_prob"])
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert abs(out.loss.item() - expected.item()) <= 1e-12
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-12)


def test_from_verl_refuses_what_the_policy_loss_cannot_take():
    actor = {"policy_loss": {"loss_mode": "vanilla"}}
    with pytest.raises(ValueError, match="topk_divergence_from_logits"):
        pgloss.from_verl(actor, distillation={"distillation_loss": {"loss_mode": "forward_kl_topk"}})
    with pytest.raises(ValueError, match="no pgloss estimator"):
        pgloss.from_verl(actor, distillation={"distillation_loss": {"loss_mode": "jsd"}})
    assert pgloss.from_verl(actor, distillation={"enabled": False}) == pgloss.from_verl(actor)
