"""TRL 1.16's GRPOTrainer with pgloss under accelerate's FSDP2 plugin: two gloo processes on CPU,
every parameter an FSDP2 shard (`fully_shard` per Qwen2 decoder layer and the root), GA = 2, plain
and fused. The gradient FSDP2 leaves on the shards, gathered, is one plain call's on the window of
both ranks' micro-batches (uneven tokens per rank).

accelerate turns its FSDP plugin on only for accelerator devices; on CPU it silently trains with DDP.
The worker presents the gloo group as a device one (`force_fsdp_on_cpu`) so that the plugin's own
`fsdp2_prepare_model` shards the model; the rest of the step is accelerate's and TRL's unchanged."""

import os

import pytest
import torch

import pgloss

pytest.importorskip("trl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from trl_window import relative_error, run_two_ranks, trl_tiny, window_gradient


def test_two_fsdp2_ranks_give_the_window_gradient(tmp_path):
    from trl_fsdp2_worker import CASES

    model_dir = trl_tiny.make_tiny_model(str(tmp_path / "model"))
    records = run_two_ranks("trl_fsdp2_worker.py", tmp_path, CASES, model_dir)
    for case, (name, hyperparameters, _) in CASES.items():
        ranks = records[case]
        tokens = [sum(int(b["completion_mask"].sum()) for b in rank["inputs"]) for rank in ranks]
        assert tokens[0] != tokens[1], case
        for key, value in ranks[0]["params"].items():
            torch.testing.assert_close(ranks[1]["params"][key], value, rtol=0, atol=0)
        algorithm = pgloss.get(name, **hyperparameters)
        reference, _ = window_gradient(
            model_dir, ranks[0]["inputs"] + ranks[1]["inputs"], ranks[0]["params"], algorithm
        )
        assert sum(float(g.norm()) for g in reference.values()) > 0
        for rank in ranks:
            assert sorted(rank["grads"]) == sorted(reference), case
            error = relative_error(rank["grads"], reference)
            print(f"{case}: rank tokens {tokens}, relative gradient error {error:.2e}")
            assert error < 2e-5, case
