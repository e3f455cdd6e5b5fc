"""The one-file reading of GRPO (tests/loops/what_grpo_computes.py, shown on docs/contributing.md) is what `pgloss.get("grpo")`
computes: the same value and, by central differences of the loop, the same gradient, in float64."""

import pytest
from conftest import make_batch
from loops.what_grpo_computes import grpo_loss

import pgloss


def lists(batch):
    return [batch[k].tolist() for k in ("log_prob", "old_log_prob", "ref_log_prob", "advantages")] + [
        batch["mask"].int().tolist()
    ]


def test_the_reading_is_what_pgloss_computes():
    batch = make_batch(batch=6, length=7, seed=11, spread=0.5)
    leaf = batch["log_prob"].clone().requires_grad_(True)
    out = pgloss.get("grpo")(
        leaf, batch["old_log_prob"], batch["advantages"], batch["mask"], ref_log_prob=batch["ref_log_prob"]
    )
    out.loss.backward()
    lp, *rest = lists(batch)
    assert out.loss.item() == pytest.approx(grpo_loss(lp, *rest), rel=1e-13)
    step = 1e-6
    for i, t in batch["mask"].nonzero().tolist():
        up, down = [row[:] for row in lp], [row[:] for row in lp]
        up[i][t] += step
        down[i][t] -= step
        numeric = (grpo_loss(up, *rest) - grpo_loss(down, *rest)) / (2 * step)
        assert abs(leaf.grad[i, t].item() - numeric) < 1e-8, (i, t)
    assert leaf.grad[~batch["mask"]].abs().max() == 0
    assert out.metrics["kl"] > 0 and out.metrics["pg_clipfrac"] > 0  # both terms and the clip are exercised
