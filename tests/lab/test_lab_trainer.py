"""A trainer step lowers the loss on a fixed batch; the same seed gives the same metrics."""

import copy

import pytest
import torch

from lab_helpers import TINY, fixed_batch, same_run, tiny_policy
from pgloss.lab.config import LabConfig
from pgloss.lab.trainer import make_algorithm, train, update


def loss_of(policy, algorithm, batch):
    from pgloss.lab.sampling import response_log_probs

    with torch.no_grad():
        log_prob, _ = response_log_probs(policy, batch.rollout, temperature=1.0)
        return float(algorithm(log_prob=log_prob, old_log_prob=batch.old_log_prob, advantages=batch.advantages,
                               mask=batch.rollout.mask, ref_log_prob=batch.ref_log_prob).loss)


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
    assert set(metrics) == {"clip_frac", "clip_frac_high", "clip_frac_low", "ppo_kl", "grad_norm", "grad_clipped", "loss"}
    assert all(torch.isfinite(v) for v in metrics.values())
    assert float(metrics["ppo_kl"]) != 0.0  # later optimizer steps saw ratios away from one


def test_same_seed_same_metrics():
    cfg = LabConfig(algorithm="dapo", steps=2, warm_steps=3, prompts_per_step=4, group_size=4, eval_prompts=4,
                    samples=2, **TINY)
    a, b = train(cfg), train(cfg)
    assert same_run(a, b)
    assert len(a["metrics"]) == 3 and a["metrics"][0]["kl_ref"] == 0.0
