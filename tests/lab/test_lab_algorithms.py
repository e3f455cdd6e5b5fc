"""Every algorithm of ``pgloss.names()`` runs in the lab: one update on a fixed batch, and the loop."""

import copy
import math

import pytest
import torch
from lab_helpers import TINY, fixed_batch, tiny_policy

import pgloss
from pgloss.lab.config import LabConfig
from pgloss.lab.trainer import build, make_algorithm, train, warm_start
from pgloss.lab.update import update

LOOP = dict(steps=2, warm_steps=3, prompts_per_step=4, group_size=4, eval_prompts=4, samples=1, **TINY)


@pytest.fixture(scope="module")
def warm_state():
    cfg = LabConfig(**LOOP)
    tokenizer, task, model = build(cfg)
    warm_start(model, task, tokenizer, cfg)
    return model.state_dict()


@pytest.mark.parametrize("name", pgloss.names())
def test_every_algorithm_updates_the_policy(name):
    policy = tiny_policy()
    start = [p.detach().clone() for p in policy.parameters()]
    batch = fixed_batch(policy, copy.deepcopy(policy))  # half right, half wrong: real advantages
    cfg = LabConfig(algorithm=name, epochs=2, minibatches=2, micro_batches=2, **TINY)
    algorithm = make_algorithm(cfg)
    metrics = update(
        policy,
        torch.optim.AdamW(policy.parameters(), lr=3e-3),
        algorithm,
        batch,
        cfg,
        6,
        torch.Generator().manual_seed(0),
    )
    assert math.isfinite(float(metrics["loss"])) and math.isfinite(float(metrics["ppo_kl"]))
    assert float(metrics["grad_norm"]) > 0 and 0 <= float(metrics["grad_clipped"]) <= 1
    assert max(float((p.detach() - s).abs().max()) for p, s in zip(policy.parameters(), start, strict=True)) > 1e-4
    reports_clip = (
        "pg_clipfrac"
        in algorithm(
            batch.old_log_prob, batch.old_log_prob, batch.advantages, batch.rollout.mask, **batch.inputs(algorithm)
        ).metrics
    )
    assert math.isnan(float(metrics["clip_frac"])) == (not reports_clip)  # SAPO has no clip: None, not an error
    if reports_clip:
        assert float(metrics["clip_frac"]) == pytest.approx(
            float(metrics["clip_frac_high"]) + float(metrics["clip_frac_low"]), abs=1e-6
        )


@pytest.mark.parametrize("name", pgloss.names())
def test_every_algorithm_runs_the_loop(name, warm_state):
    cfg = LabConfig(algorithm=name, **LOOP)
    seen = []
    result = train(cfg, warm_state, on_step=seen.append)
    assert [r["step"] for r in result["metrics"]] == [0, 1, 2] and seen == result["metrics"]
    assert all(r["algorithm"] == name and 0 <= r["reward"] <= 1 and r["length"] >= 1 for r in seen)
    assert seen[-1]["grad_norm"] is None and seen[-1]["eval_reward"] is not None  # the final measurement
    assert set(result["samples"]) == {"start", "end"}
