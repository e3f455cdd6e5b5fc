"""A run's checkpoint: what ``trainer.train`` needs to continue from its last finished step exactly.

After every step's record, ``train(..., checkpoint=PATH)`` saves the policy, the reference (the warm
start), the optimizer and learning-rate schedule, every random-number state of the run (the prompts'
and refill prompts' ``random.Random``, the sampling and shuffle generators, torch's global one), the
records and samples so far and the run's settings. A run given a checkpoint that exists continues after
its step and gives the same metrics and final policy, bit for bit, as a run never stopped (on the same
machine, one process). The file is written whole or not at all (a temporary file, then a rename), so a
run killed while saving keeps the checkpoint of the step before.

``pgloss train --resume`` and ``pgloss compare --resume`` keep one per run in ``OUT/checkpoints``
(`path`), each replaced by the next; the one of a finished run holds its final policy and stays.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ..controllers import AdaptiveEntropy

FOLDER = "checkpoints"


def run_name(label: str, seed: int) -> str:
    """A run's name in file names: ``<label>-seed<seed>``, a character other than letters, digits and
    ``._=+-`` in the label (an algorithm spec) as ``_``. Its checkpoint, policy and logs are named so."""
    return f"{re.sub(r'[^A-Za-z0-9._=+-]', '_', label)}-seed{seed}"


def path(out: Path, label: str, seed: int) -> Path:
    """The checkpoint of the run of `label` (an algorithm spec) from `seed` in the run folder `out`."""
    return Path(out) / FOLDER / f"{run_name(label, seed)}.pt"


def differences(saved: dict, mine: dict, name=str) -> list[str]:
    """``NAME THEIRS there, MINE here`` for every key whose value differs (a key one side lacks is None
    there), ``name(key)`` naming it."""
    return [
        f"{name(k)} {saved.get(k)!r} there, {mine.get(k)!r} here"
        for k in dict.fromkeys([*saved, *mine])
        if saved.get(k) != mine.get(k)
    ]


def save(file: Path, state: dict) -> None:
    """Write `state` to `file` whole or not at all."""
    import torch

    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, file)


def load(file: Path, cfg=None) -> dict | None:
    """The checkpoint in `file` (None when there is none); ValueError naming the settings that differ
    when it was saved by a run of other settings than `cfg` (a LabConfig)."""
    from .torch_files import load_tensors

    file = Path(file)
    if not file.exists():
        return None
    state = load_tensors(file, "checkpoint")
    if cfg is not None:
        differ = differences(state["config"], dataclasses.asdict(cfg))
        if differ:
            raise ValueError(f"checkpoint {file} was saved by a run of other settings ({'; '.join(differ)})")
    return state


def step(file: Path) -> int:
    """The last step the checkpoint in `file` finished (-1 when there is none)."""
    state = load(file)
    return -1 if state is None else state["step"]


@dataclass(frozen=True)
class Live:
    """The objects of a running ``trainer.train`` whose state a checkpoint holds: `state` reads them after a
    step, `restore` puts a checkpoint's back into them (the run's settings, records and samples aside)."""

    policy: torch.nn.Module
    reference: torch.nn.Module
    """The frozen warm start (the KL's reference)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """The learning-rate warmup."""
    prompt_rng: random.Random
    """Draws each step's prompts."""
    refill_rng: random.Random
    """Draws DAPO's refill prompts."""
    generator: torch.Generator
    """Samples the completions."""
    shuffle: torch.Generator
    """Cuts the batch into minibatches."""
    entropy_control: AdaptiveEntropy | None
    """The entropy controller of ``--target-entropy`` (None: a fixed coefficient)."""

    def state(self, cfg: Any, step: int, metrics: list[dict], samples: dict) -> dict:
        """The checkpoint after `step` of a run of `cfg` (a LabConfig), with its records and samples so far;
        torch's global random state too."""
        import torch

        return {
            "config": dataclasses.asdict(cfg),
            "step": step,
            "metrics": metrics,
            "samples": samples,
            "policy": self.policy.state_dict(),
            "reference": self.reference.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "prompt_rng": self.prompt_rng.getstate(),
            "refill_rng": self.refill_rng.getstate(),
            "generator": self.generator.get_state(),
            "shuffle": self.shuffle.get_state(),
            "torch_rng": torch.get_rng_state(),
            "entropy_control": None if self.entropy_control is None else self.entropy_control.state_dict(),
        }

    def restore(self, saved: dict) -> None:
        """Every state of the checkpoint `saved` (`state`'s) back in these objects and in torch's global
        random state, as they were after its step (the reference is built from ``saved["reference"]`` before)."""
        import torch

        self.policy.load_state_dict(saved["policy"])
        self.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.prompt_rng.setstate(saved["prompt_rng"])
        self.refill_rng.setstate(saved["refill_rng"])
        self.generator.set_state(saved["generator"])
        self.shuffle.set_state(saved["shuffle"])
        torch.set_rng_state(saved["torch_rng"])
        if self.entropy_control is not None:
            self.entropy_control.load_state_dict(saved["entropy_control"])
