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
import re
from pathlib import Path

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
