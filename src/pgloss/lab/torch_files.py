"""Reading a file written by ``torch.save`` without running code from it: every ``torch.load`` of pgloss goes
through :func:`load_tensors` (a batch for ``pgloss grads --batch``, the warm-start cache, a checkpoint, a
distillation teacher).

``torch.load(weights_only=True)`` rebuilds tensors, numbers, strings and their containers and refuses any other
pickled object. Before torch 2.6 its default was ``weights_only=False``, which unpickles anything, and
unpickling a function or a class's ``__reduce__`` runs it: a file from elsewhere could run arbitrary code."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any


def load_tensors(file: str | Path, what: str) -> Any:
    """What ``torch.save`` wrote to `file`, on the CPU, read with ``torch.load(weights_only=True)``.

    A file that holds another object (a pickled function or class) is a ValueError naming `what` (the role
    of the file, e.g. ``"warm-start cache"``), the file and the object refused. Other failures (a
    missing or damaged file) are torch's own errors."""
    import torch

    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        culprit = f"a pickled {found.group(1)}" if found else "a pickled object other than tensors"
        raise ValueError(
            f"{what}: {file} holds {culprit}, and pgloss reads torch files with "
            "torch.load(weights_only=True), which runs no code from them: save only tensors, numbers, "
            "strings and their dicts, lists and tuples"
        ) from None
