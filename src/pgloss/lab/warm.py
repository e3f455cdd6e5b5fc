"""The warm start: shipped for the default settings, else cached by what determines it.

A warm start depends on the settings in `FIELDS`, on torch, on the lab's code that builds and
trains the model and on the CPU, nothing else (not the algorithm, not the RL settings): 1500 steps
of AdamW at a high learning rate turn another CPU's rounding into other weights (a warm start of
another CPU answered 0.460 of the held-out prompts where this one answers 0.513), and every RL run
starts from it. So the default task's warm starts are shipped with pgloss (`SHIPPED`: seeds 0-7,
trained once by ``python -m pgloss.lab.warm``, their settings in ``manifest.json``), and a run whose
warm-start settings are those loads its seed's file on every machine.

Any other warm start is trained and cached as ``<cache>/<task>-seed<seed>-<key>.pt``, the key a hash
of the settings, torch and the code, so a later run with the same settings loads it instead of
training it again, and any change of setting, torch or code trains a new one. The default cache is
``$XDG_CACHE_HOME/pgloss/warm`` (``~/.cache/pgloss/warm``).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import time
from pathlib import Path

FIELDS = (
    "task",
    "seed",
    "max_new_tokens",
    "warm_steps",
    "warm_batch",
    "warm_lr",
    "scratchpad_prob",
    "d_model",
    "n_layer",
    "n_head",
    "device",
    "threads",
)
"""The LabConfig fields the warm start reads (max_new_tokens sizes the model's positions)."""
CODE = ("model.py", "tokenizer.py", "tasks.py", "sampling.py", "trainer.py")
"""The lab's modules whose code computes the warm start."""
SHIPPED = Path(__file__).parent / "warm_starts"
"""The shipped warm starts: ``<task>-seed<seed>.safetensors`` and ``manifest.json`` (their settings)."""
SHIPPED_SEEDS = range(8)


def default_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pgloss" / "warm"


def cache_dir(text: str | None) -> Path | None:
    """``--warm-cache``: None (the default cache), ``none`` (no cache) or a directory, created.
    ValueError when it cannot be used."""
    if text is not None and text.lower() == "none":
        return None
    path = default_cache() if text is None else Path(text)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(
            f"--warm-cache {path}: cannot create the directory ({err.strerror}); give another or none"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--warm-cache {path}: the directory is not writable; give another or none")
    return path


def key(cfg) -> str:
    """A hash of the warm start's settings, the torch version and the lab's code."""
    import torch

    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / name).read_bytes() for name in CODE)).hexdigest()
    text = json.dumps(
        {"fields": {f: getattr(cfg, f) for f in FIELDS}, "torch": torch.__version__, "code": code}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path(cfg, cache: Path) -> Path:
    return Path(cache) / f"{cfg.task}-seed{cfg.seed}-{key(cfg)}.pt"


def settings(cfg) -> dict:
    """The warm-start settings of `cfg` that decide its weights (not the device, not the threads)."""
    return {f: getattr(cfg, f) for f in FIELDS if f not in ("seed", "device", "threads")}


@functools.cache
def manifest() -> dict:
    """The shipped warm starts' ``manifest.json`` (their settings, checksums, torch and CPU), read once."""
    return json.loads((SHIPPED / "manifest.json").read_text())


def shipped(cfg) -> Path | None:
    """The shipped warm start of `cfg`'s seed when `cfg`'s warm-start settings are those it was trained
    with (``manifest.json``), else None."""
    if settings(cfg) != manifest()["settings"] or str(cfg.seed) not in manifest()["seeds"]:
        return None
    return SHIPPED / f"{cfg.task}-seed{cfg.seed}.safetensors"


def origin(configs) -> str:
    """Where the warm starts of `configs` come from, for ``config.json`` and the report."""
    if all(shipped(cfg) is not None for cfg in configs):
        return f"shipped with pgloss (trained on {manifest()['trained_on']}, torch {manifest()['torch']})"
    if any(shipped(cfg) is not None for cfg in configs):
        return "shipped with pgloss for the seeds it ships, trained on this machine for the others"
    return "trained on this machine"


def cached(cfg, cache: Path | None) -> bool:
    """Whether the warm start of `cfg` needs no training: shipped, or in `cache`."""
    return shipped(cfg) is not None or (cache is not None and path(cfg, cache).exists())


def state(cfg, cache: Path | None, on_steps=None) -> dict:
    """The warm-started policy of `cfg` (a CPU state dict): the shipped one, or loaded from `cache`, or
    trained and saved there (None: trained, not saved). `on_steps(steps, seconds)` is told of the
    training's progress."""
    if (file := shipped(cfg)) is not None:
        from safetensors.torch import load_file

        return load_file(file)
    return trained(cfg, cache, on_steps)


def trained(cfg, cache: Path | None, on_steps=None) -> dict:
    """The warm start of `cfg` trained on this machine: loaded from `cache`, or trained and saved there."""
    import torch

    from . import trainer
    from .torch_files import load_tensors

    file = None if cache is None else path(cfg, cache)
    if file is not None and file.exists():
        try:
            return load_tensors(file, "warm-start cache")
        except ValueError:  # a file holding more than tensors was not written here: refused, not replaced
            raise
        except Exception:
            pass
    torch.set_num_threads(cfg.threads)
    tokenizer, task, model = trainer.build(cfg)
    last = [time.perf_counter()]

    def tick(step: int) -> None:
        now = time.perf_counter()
        if on_steps is not None:
            on_steps(1, now - last[0])
        last[0] = now

    trainer.warm_start(model, task, tokenizer, cfg, on_step=tick)
    result = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if file is not None:
        tmp = file.with_name(f"{file.name}.{os.getpid()}.tmp")
        torch.save(result, tmp)
        tmp.replace(file)  # a complete file or none: a run stopped while saving leaves no half file
    return result


def _ship_one(cfg) -> dict:
    """Train the warm start of `cfg` and write it under `SHIPPED`; what the manifest says of it."""
    from . import policy, trainer

    weights = trained(cfg, None)
    file = policy.save(weights, cfg, SHIPPED / f"{cfg.task}-seed{cfg.seed}.safetensors")
    tokenizer, task, model = trainer.build(cfg)
    model.load_state_dict(weights)
    reward = float(trainer.sampled_reward(model, trainer.eval_problems(task, cfg), tokenizer, cfg))
    return {"sha256": hashlib.sha256(file.read_bytes()).hexdigest(), "eval_reward": reward}


def main() -> None:
    """Train the shipped warm starts (seeds 0-7 of the lab's default settings, two processes at once)
    and write their manifest. Their weights depend on the CPU: run it once, on one machine."""
    import multiprocessing as mp

    import torch

    from .config import LabConfig
    from .provenance import machine

    configs = [LabConfig(seed=s) for s in SHIPPED_SEEDS]
    with mp.get_context("spawn").Pool(2) as pool:
        seeds = dict(zip((str(c.seed) for c in configs), pool.map(_ship_one, configs), strict=True))
    written = {
        "settings": settings(configs[0]),
        "seeds": seeds,
        "torch": torch.__version__,
        "trained_on": f"{machine()}, one torch thread",
    }
    (SHIPPED / "manifest.json").write_text(json.dumps(written, indent=1) + "\n")


if __name__ == "__main__":
    main()
