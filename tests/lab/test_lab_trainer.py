"""A trainer step lowers the loss on a fixed batch; the same seed gives the same metrics."""

import copy

import pytest
import torch
from lab_helpers import TINY, fixed_batch, same_run, tiny_policy

from pgloss.lab.config import LabConfig
from pgloss.lab.trainer import make_algorithm, train
from pgloss.lab.update import update


def loss_of(policy, algorithm, batch):
    from pgloss.lab.sampling import response_log_probs

    with torch.no_grad():
        log_prob, _ = response_log_probs(policy, batch.rollout, temperature=1.0)
        return float(
            algorithm(
                log_prob=log_prob,
                old_log_prob=batch.old_log_prob,
                advantages=batch.advantages,
                mask=batch.rollout.mask,
                ref_log_prob=batch.ref_log_prob,
            ).loss
        )


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "sample_grpo"])
def test_update_lowers_the_loss_on_a_fixed_batch(name):
    policy = tiny_policy()
    batch = fixed_batch(policy, copy.deepcopy(policy))
    cfg = LabConfig(algorithm=name, epochs=3, minibatches=2, micro_batches=2, **TINY)
    algorithm = make_algorithm(cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    before = loss_of(policy, algorithm, batch)
    metrics = update(policy, optimizer, algorithm, batch, cfg, 6, torch.Generator().manual_seed(0))
    after = loss_of(policy, algorithm, batch)
    assert after < before - 1e-3, (before, after)
    assert set(metrics) == {
        "clip_frac",
        "clip_frac_high",
        "clip_frac_low",
        "ppo_kl",
        "grad_norm",
        "grad_clipped",
        "loss",
        "entropy_coef",
    }
    assert float(metrics["entropy_coef"]) == algorithm.entropy_coef  # no controller: the fixed coefficient
    assert all(torch.isfinite(v) for v in metrics.values())
    assert float(metrics["ppo_kl"]) != 0.0  # later optimizer steps saw ratios away from one


def test_same_seed_same_metrics():
    cfg = LabConfig(
        algorithm="dapo", steps=2, warm_steps=3, prompts_per_step=4, group_size=4, eval_prompts=4, samples=2, **TINY
    )
    a, b = train(cfg), train(cfg)
    assert same_run(a, b)
    assert len(a["metrics"]) == 3 and a["metrics"][0]["kl_ref"] == 0.0


def test_target_entropy_steers_the_coefficient_toward_the_target_and_is_logged():
    """With --target-entropy the lab builds an AdaptiveEntropy: each optimizer step applies the
    coefficient of the last step's gate and moves it by delta toward holding the entropy at the target.
    A target above any entropy of the run raises the coefficient at every optimizer step: after the
    first (off: no entropy measured yet), each applies delta more than the one before."""
    import math

    delta, steps = 0.01, 2
    base = dict(
        algorithm="grpo",
        steps=steps,
        warm_steps=3,
        prompts_per_step=4,
        group_size=4,
        eval_prompts=4,
        samples=2,
        epochs=1,
        minibatches=2,
        **TINY,
    )
    high = train(LabConfig(target_entropy=50.0, entropy_coef_delta=delta, **base))["metrics"]
    per_update = 1 * 2  # epochs x minibatches optimizer steps per RL step
    # step k applies 0 (first optimizer step only), then delta, 2 delta, ...: the mean of its optimizer steps
    applied = [0.0] + [delta * j for j in range(1, steps * per_update)]
    expected = [sum(applied[k * per_update : (k + 1) * per_update]) / per_update for k in range(steps)]
    assert [r["entropy_coef"] for r in high[:steps]] == pytest.approx(expected, abs=1e-7)
    assert high[-1]["entropy_coef"] is None  # the last record measures the final policy: no update
    # a target below every entropy keeps the bonus off and the coefficient at its floor
    low = train(LabConfig(target_entropy=1e-6, entropy_coef=0.05, entropy_coef_delta=delta, **base))["metrics"]
    assert [r["entropy_coef"] for r in low[:steps]] == [0.0] * steps
    # without a target the coefficient is the fixed one, at every step
    fixed = train(LabConfig(entropy_coef=0.02, **base))["metrics"]
    assert [r["entropy_coef"] for r in fixed[:steps]] == pytest.approx([0.02] * steps)
    assert all(math.isfinite(r["entropy"]) for r in high)


def test_entropy_controller_starts_from_the_coefficient_and_moves_by_delta_per_step():
    from pgloss.lab.trainer import make_entropy_control

    cfg = LabConfig(target_entropy=0.3, entropy_coef=0.02, entropy_coef_delta=0.004, entropy_coef_max=0.1, **TINY)
    control = make_entropy_control(cfg, make_algorithm(cfg))
    assert (control.coef, control.target, control.delta, control.coef_max) == (0.02, 0.3, 0.004, 0.1)
    assert control.update(0.5) == pytest.approx(0.016) and control.applied == 0.0  # above the target: down, off
    assert control.update(0.1) == pytest.approx(0.020) and control.applied == pytest.approx(0.020)  # below: up, on
    assert make_entropy_control(LabConfig(**TINY), make_algorithm(LabConfig(**TINY))) is None


@pytest.mark.parametrize(
    "field, value",
    [
        ("target_entropy", 0.0),
        ("target_entropy", float("inf")),
        ("entropy_coef_delta", -0.1),
        ("entropy_coef_max", float("nan")),
    ],
)
def test_entropy_control_settings_are_checked_by_flag(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be"):
        LabConfig(**{field: value})
