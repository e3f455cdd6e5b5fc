"""Where a run was made, as ``config.json`` and the report record it: the versions of pgloss, torch and
Python, the git commit of the source, and the machine (what makes float32 rounding, and so a run, differ
from one CPU to another)."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path


def _git_version() -> str | None:
    """``git describe --always --dirty`` of the checkout pgloss runs from; None outside one."""
    import pgloss

    src = Path(pgloss.__file__).resolve().parent
    try:
        tracked = subprocess.run(
            ["git", "-C", str(src), "ls-files", "--error-unmatch", "__init__.py"], capture_output=True, timeout=10
        )
        if tracked.returncode != 0:
            return None
        done = subprocess.run(
            ["git", "-C", str(src), "describe", "--always", "--dirty", "--abbrev=12"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None


def machine() -> str:
    """The CPU's model name and architecture and the instruction set torch's kernels use: what makes
    float32 rounding, and so a run, differ between machines."""
    import torch

    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    name = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor()
    )
    return f"{name or 'unknown CPU'} ({platform.machine()}, torch kernels {torch.backends.cpu.get_cpu_capability()})"


def versions() -> dict:
    """pgloss, torch, Python, the git commit of the source and the machine, for ``config.json``."""
    import torch

    import pgloss

    return {
        "pgloss": pgloss.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "git": _git_version(),
        "machine": machine(),
    }
