"""The off-policy sequence mask and the top-entropy mask against TRL 1.16's own functions
(`GRPOTrainer.get_off_policy_mask`, `GRPOTrainer.get_high_entropy_mask` on one process)."""

import types

import pytest
import torch
from conftest import make_batch

from pgloss.correction.rollout import RolloutCorrection
from pgloss.correction.token_masks import entropy_threshold, top_entropy_mask

pytest.importorskip("trl")
from trl.trainer.grpo_trainer import GRPOTrainer


def test_off_policy_mask_matches_trl():
    d = make_batch(batch=9, length=7, seed=61)
    gen = torch.Generator().manual_seed(62)
    sampling = d["old_log_prob"] + 0.5 * torch.randn(d["mask"].shape, generator=gen, dtype=torch.float64)
    dropped = []
    for delta in (0.0, 0.3, 2.0):
        theirs = GRPOTrainer.get_off_policy_mask(
            d["advantages"][:, None], d["log_prob"], sampling, d["mask"].double(), delta
        )
        ours = (
            RolloutCorrection(weight_level=None, off_policy_mask=delta)
            .apply(
                log_prob=d["log_prob"],
                old_log_prob=d["old_log_prob"],
                rollout_log_prob=sampling,
                mask=d["mask"],
                seq_advantages=d["advantages"],
            )
            .mask
        )
        assert torch.equal(ours, d["mask"] & theirs.bool())
        dropped.append(int((theirs[:, 0] == 0).sum()))
    assert dropped[0] > dropped[-1], dropped  # the threshold matters: the comparison can fail


@pytest.mark.parametrize("top", [0.2, 0.5])
def test_top_entropy_mask_matches_trl_on_one_process(top):
    d = make_batch(batch=9, length=7, seed=63)
    identity = types.SimpleNamespace(pad_across_processes=lambda t, dim, pad_index: t, gather=lambda t: t)
    theirs = GRPOTrainer.get_high_entropy_mask(
        types.SimpleNamespace(accelerator=identity), d["entropy"].float(), d["mask"].int(), 1 - top
    )
    entropy = d["entropy"].float()
    ours = top_entropy_mask(entropy, d["mask"], entropy_threshold(entropy, d["mask"], top=top))
    assert torch.equal(ours, theirs)
