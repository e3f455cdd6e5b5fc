"""One process of `torchrun --nproc_per_node 2 trl_ddp_worker.py DIR`: for each case under DIR, two
optimizer steps of the real PGLossGRPOTrainer (DDP over gloo), then this rank's record of the second
step (its micro-batches, the DDP-averaged gradient, the parameters, the logged metrics) saved to
DIR/<case>/rank<r>.pt."""

import os
import sys

import torch
from trl_window import train

import pgloss

CASES = {  # case -> (name, hyperparameters, fused)
    "dapo": ("dapo", {}, False),
    "grpo-group": ("grpo", dict(loss_agg_mode="group-mean-token-mean"), False),
    "gspo-fused": ("gspo", {}, True),
    "dr_grpo-fused": ("dr_grpo", dict(norm_constant=8.0), True),
}

if __name__ == "__main__":
    root, rank = sys.argv[1], int(os.environ["RANK"])
    for case, (name, hyperparameters, fused) in CASES.items():
        algorithm = pgloss.get(name, **hyperparameters)
        rate = 2e-2 if algorithm.ratio_level == "token" else 1e-6  # as in test_trl.py
        trainer = train(os.path.join(root, case), algorithm, fused=fused, learning_rate=rate)
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
        logged = [row for row in trainer.state.log_history if "pgloss/pg_loss" in row][-1]
        torch.save(
            {
                "grads": trainer.snapshot["grads"],
                "inputs": trainer.snapshot["inputs"],
                "params": trainer.snapshot["params"],
                "logged": logged,
            },
            os.path.join(root, case, f"rank{rank}.pt"),
        )
