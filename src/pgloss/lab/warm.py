"""The warm start, cached by what determines it.

A warm start depends on the settings in `FIELDS`, on torch and on the lab's code that builds and
trains the model, nothing else (not the algorithm, not the RL settings). Its state dict is saved as
``<cache>/<task>-seed<seed>-<key>.pt``, the key a hash of all of that, so a later run with the same
settings loads it instead of training it again, and any change of setting, torch or code trains a
new one. The default cache is ``$XDG_CACHE_HOME/pgloss/warm`` (``~/.cache/pgloss/warm``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

FIELDS = ("task", "seed", "max_new_tokens", "warm_steps", "warm_batch", "warm_lr", "scratchpad_prob", "d_model",
          "n_layer", "n_head", "device", "threads")
"""The LabConfig fields the warm start reads (max_new_tokens sizes the model's positions)."""
CODE = ("model.py", "tokenizer.py", "tasks.py", "sampling.py", "trainer.py")
"""The lab's modules whose code computes the warm start."""


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
        raise ValueError(f"--warm-cache {path}: cannot create the directory ({err.strerror}); "
                         "give another or none") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--warm-cache {path}: the directory is not writable; give another or none")
    return path


def key(cfg) -> str:
    """A hash of the warm start's settings, the torch version and the lab's code."""
    import torch

    here = Path(__file__).parent
    code = hashlib.sha256(b"".join((here / name).read_bytes() for name in CODE)).hexdigest()
    text = json.dumps({"fields": {f: getattr(cfg, f) for f in FIELDS}, "torch": torch.__version__, "code": code},
                      sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def path(cfg, cache: Path) -> Path:
    return Path(cache) / f"{cfg.task}-seed{cfg.seed}-{key(cfg)}.pt"


def cached(cfg, cache: Path | None) -> bool:
    return cache is not None and path(cfg, cache).exists()


def state(cfg, cache: Path | None, on_steps=None) -> dict:
    """The warm-started policy of `cfg` (a CPU state dict): loaded from `cache`, or trained and saved
    there (None: trained, not saved). `on_steps(steps, seconds)` is told of the training's progress."""
    import torch

    from . import trainer

    file = None if cache is None else path(cfg, cache)
    if file is not None and file.exists():
        try:
            return torch.load(file, map_location="cpu")
        except Exception:  # noqa: BLE001 (an unreadable cache file is trained again)
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
