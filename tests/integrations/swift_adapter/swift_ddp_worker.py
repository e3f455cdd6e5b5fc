"""One rank of the two-process ms-swift check (torchrun, gloo, CPU): ms-swift's pipeline on each rank, one
off-policy generation, and one optimizer step per name through ms-swift's training_step on the DDP-wrapped model;
writes this rank's gradients and micro-batches to OUT/rank<r>.pt. Usage: torchrun --nproc_per_node 2 THIS OUT."""

import sys
from pathlib import Path

import swift_window as sw
import torch
import torch.distributed as dist

NAMES = ("dapo", "clip_cov", "real", "topr")
ROLLOUT = dict(rollout_importance_sampling_mode="token_truncate", rollout_importance_sampling_threshold=1.2)


def main(out: str) -> None:
    from pgloss.integrations.swift import PGLossSwiftGRPOTrainer

    root = Path(out)
    args = sw.arguments(root / "work", beta=0.04, loss_type="pgloss:dapo", **ROLLOUT)
    trainer = sw.build_trainer(args, PGLossSwiftGRPOTrainer)
    trainer.disable_rollout_importance_sampling = False  # the recorded rollout log-probs stand for vLLM's
    rank = dist.get_rank()
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    batches = sw.off_policy(trainer, seed=rank, rollout=True)
    trainer.model_wrapped = trainer.accelerator.prepare_model(trainer.model)  # DDP, as Trainer.train wraps it
    assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    results = {}
    for number, name in enumerate(NAMES):
        trainer.accelerator.unwrap_model(trainer.model_wrapped).load_state_dict(initial)
        algorithm = sw.named_algorithm(trainer.args, name)
        grads, logged = sw.drive_step(trainer, algorithm, batches, number + 1)
        results[name] = dict(grads=grads, logged=logged, records=sw.records(trainer, batches))
    torch.save(dict(results=results, initial=initial, temperature=trainer.temperature), root / f"rank{rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
