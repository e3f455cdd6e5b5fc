"""One process of `torchrun --nproc_per_node 2 trl_fsdp2_worker.py DIR`: for each case under DIR, two
optimizer steps of the real PGLossGRPOTrainer under accelerate's FSDP2 plugin (gloo, CPU, every
decoder layer and the root sharded), then this rank's record of the second step (its micro-batches,
the whole gradient gathered from the shards FSDP2 averaged, the whole parameters) saved to
DIR/<case>/rank<r>.pt."""

import os
import sys

import torch
from torch.distributed.tensor import DTensor
from trl_window import RecordingTrainer, train

import pgloss

CASES = {  # case -> (name, hyperparameters, fused)
    "dapo": ("dapo", {}, False),
    "grpo-group": ("grpo", dict(loss_agg_mode="group-mean-token-mean"), False),
    "gspo-fused": ("gspo", {}, True),
    "dr_grpo-fused": ("dr_grpo", dict(norm_constant=8.0), True),
}
FSDP2 = dict(fsdp=True, fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]})


def force_fsdp_on_cpu() -> None:
    """accelerate enables its FSDP plugin only on accelerator devices (`AcceleratorState` turns
    MULTI_GPU, MULTI_XPU, ... into FSDP, never MULTI_CPU): on CPU it falls back to DDP without a word.
    Present this gloo process group as a device one when the trainer builds its Accelerator, so that
    the plugin's own preparation (`fsdp2_prepare_model`: `fully_shard` per decoder layer and root) runs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = RecordingTrainer.create_accelerator_and_postprocess

    def create(self):
        PartialState().distributed_type = DistributedType.MULTI_XPU
        return original(self)

    RecordingTrainer.create_accelerator_and_postprocess = create


def whole(tensors: dict) -> dict:
    """The full tensors of a rank's shards (a collective: every rank gathers the same keys in order)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sorted(tensors.items())}


if __name__ == "__main__":
    root, rank = sys.argv[1], int(os.environ["RANK"])
    force_fsdp_on_cpu()
    for case, (name, hyperparameters, fused) in CASES.items():
        algorithm = pgloss.get(name, **hyperparameters)
        rate = 2e-2 if algorithm.ratio_level == "token" else 1e-6  # as in test_trl.py
        trainer = train(os.path.join(root, case), algorithm, fused=fused, learning_rate=rate, **FSDP2)
        assert trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2, "accelerate's FSDP2 plugin is on"
        sharded = [k for k, v in trainer.snapshot["grads"].items() if isinstance(v, DTensor)]
        assert len(sharded) == len(trainer.snapshot["grads"]) > 0, "every gradient is an FSDP2 shard"
        torch.save(
            {
                "grads": whole(trainer.snapshot["grads"]),
                "inputs": trainer.snapshot["inputs"],
                "params": whole(trainer.snapshot["params"]),
            },
            os.path.join(root, case, f"rank{rank}.pt"),
        )
