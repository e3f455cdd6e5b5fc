"""A trained lab policy as a file: ``policy.safetensors`` (``pgloss train``) or
``policies/<algorithm>-seed<seed>.safetensors`` (``pgloss compare``), written when a run finishes.

The file holds the model's tensors and, in its metadata, the run's LabConfig (``lab_config``), so
`load` rebuilds the model from the file alone and `batch` samples a batch of the run's task with it
(``pgloss grads --policy RUN``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

FILE, FOLDER = "policy.safetensors", "policies"


def path(out: Path, label: str, seed: int, single: bool) -> Path:
    """Where a finished run's policy goes: ``out/policy.safetensors`` for the one run of `train`
    (`single`), ``out/policies/<run>.safetensors`` for each run of `compare`."""
    from .checkpoint import run_name

    return Path(out) / FILE if single else Path(out) / FOLDER / f"{run_name(label, seed)}.safetensors"


def save(state: dict, cfg, file: Path) -> Path:
    """Write `state` (a lab policy's state dict) with `cfg` in the metadata, whole or not at all."""
    from safetensors.torch import save_file

    file = Path(file)
    file.parent.mkdir(parents=True, exist_ok=True)
    tmp = file.with_name(file.name + ".tmp")
    save_file(
        {k: v.detach().cpu().contiguous().clone() for k, v in state.items()},
        str(tmp),
        metadata={"lab_config": json.dumps(dataclasses.asdict(cfg))},
    )
    tmp.replace(file)
    return file


def find(where: str | Path) -> Path:
    """The policy file `where` names: a ``.safetensors`` file, or a run folder holding one policy.
    ValueError naming what was found instead."""
    where = Path(where)
    if where.is_file():
        return where
    candidates = [where / FILE] if (where / FILE).exists() else sorted((where / FOLDER).glob("*.safetensors"))
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise ValueError(
            f"--policy {where}: no {FILE} or {FOLDER}/*.safetensors there (a finished pgloss "
            "train or compare run writes them)"
        )
    raise ValueError(
        f"--policy {where}: holds {len(candidates)} policies; name one: " + ", ".join(str(c) for c in candidates)
    )


def load(where: str | Path):
    """``(cfg, model)``: the LabConfig and the TinyGPT holding the policy of `where` (see `find`), on the CPU."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from .config import LabConfig
    from .trainer import build

    file = find(where)
    try:
        with safe_open(str(file), "pt") as f:
            settings = json.loads((f.metadata() or {})["lab_config"])
    except (KeyError, OSError, ValueError) as err:
        raise ValueError(f"--policy {file}: not a lab policy file ({type(err).__name__}: {err})") from None
    cfg = LabConfig(**{**settings, "device": "cpu"})
    import torch

    with torch.random.fork_rng():  # building the model does not move the caller's random numbers
        model = build(cfg)[2]
    model.load_state_dict(load_file(str(file)))
    return cfg, model.requires_grad_(False)


def batch(where: str | Path, prompts: int = 8, seed: int = 0) -> dict:
    """A batch of `where`'s policy on its run's task: `prompts` fresh prompts (from `seed`) x the run's group
    size, sampled at its temperature; ``log_prob`` = ``old_log_prob`` = the policy's (ratio one, the
    on-policy step), GRPO's group advantages of the rewards (``scores``), ``group_ids`` and ``mask``."""
    import random

    import torch

    from ..advantages.group import group_advantages
    from .batch import score
    from .sampling import response_log_probs, sample
    from .tasks import make_task
    from .tokenizer import Tokenizer

    cfg, model = load(where)
    tokenizer, task, rng = Tokenizer(), make_task(cfg.task), random.Random(f"grads-{seed}")
    problems = [task.sample(rng) for _ in range(prompts)]
    rollout = sample(
        model,
        [tokenizer.encode(p.prompt) for p in problems],
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        generator=torch.Generator().manual_seed(seed),
    )
    rewards, _ = score(rollout, problems, tokenizer, cfg.group_size)
    with torch.no_grad():
        log_prob, _ = response_log_probs(model, rollout, temperature=cfg.temperature)
    log_prob = log_prob.double()
    return {
        "log_prob": log_prob,
        "old_log_prob": log_prob.clone(),
        "mask": rollout.mask,
        "advantages": group_advantages(rewards.double(), rollout.group_ids),
        "scores": rewards.double(),
        "group_ids": rollout.group_ids,
    }
