"""The libraries the benchmarks measure pgloss against: which are installed and at which version, how
to install the missing ones from a folder of wheels (a GPU machine may have no network), and verl's
policy loss read from its released files.

verl's package imports ray (`verl/__init__.py` imports `verl.protocol`), and its loss module imports
its config classes; a machine that has verl's files but not ray still has the loss: `verl_policy_loss`
cuts `compute_policy_loss_vanilla` and `agg_loss` out of `verl/trainer/ppo/core_algos.py` and the
masked reductions they call out of `verl/utils/torch_functional.py`, and executes them beside torch,
without importing the package (the same reading as the parity tests of tests/advantages/trainer_sources.py).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional


@dataclass(frozen=True)
class Peer:
    module: str
    """the import name"""
    distribution: str
    """the name on the package index, and in a folder of wheels"""
    needs_cuda: bool = False
    """True when its route runs only on a CUDA device (Triton kernels)"""
    no_deps: bool = False
    """installed without its requirements (verl: its loss is read from its files, see verl_policy_loss)"""


PEERS = {
    "trl": Peer("trl", "trl"),
    "liger": Peer("liger_kernel", "liger-kernel"),
    "cce": Peer("cut_cross_entropy", "cut-cross-entropy", needs_cuda=True),
    "verl": Peer("verl", "verl", no_deps=True),
}
"""The peers by the name the benchmarks give them. The versions `make gpu-wheels` fetches are pinned in the
Makefile (GPU_PEERS), beside the versions `make test` installs."""

REPORTED = ("torch", "triton", "transformers", *(peer.distribution for peer in PEERS.values()))
"""The distributions whose versions a report's header names."""


def installed(module: str) -> bool:
    """Whether `module` can be found, without importing it (verl's import would pull in ray)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """{distribution: version or None} for REPORTED."""
    return {name: version(name) for name in REPORTED}


def install_missing(wheels: str | os.PathLike, peers: dict[str, Peer] = PEERS) -> dict[str, str]:
    """Install each missing one of `peers` (default: PEERS) that has a wheel in the folder `wheels`, in
    their order, from that folder alone (`pip install --no-index --find-links`): {peer: what happened}.
    A requirement the folder lacks and the environment does not hold leaves that peer uninstalled, with
    pip's reason; the others go on."""
    folder = Path(wheels)
    outcome = {}
    for name, peer in peers.items():
        if installed(peer.module):
            continue
        prefix = peer.distribution.replace("-", "_")
        if not any(folder.glob(f"{prefix}-*.whl")):
            outcome[name] = f"no {prefix}-*.whl in {folder}"
            continue
        command = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--find-links",
            str(folder),
            *(["--no-deps"] if peer.no_deps else []),
            peer.distribution,
        ]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode == 0:
            importlib.invalidate_caches()
            outcome[name] = f"installed {version(peer.distribution)} from {folder}"
        else:
            reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
            outcome[name] = f"pip install from {folder} failed: {reason[:200]}"
    return outcome


def load_definitions(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """Execute the top-level functions and classes `names` of the file `path`, without their decorators,
    in `namespace` (which holds what they refer to); raise LookupError naming the missing ones."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    found = {
        node.name: "".join(lines[node.lineno - 1 : node.end_lineno])
        for node in ast.parse(text).body
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in names
    }
    missing = [name for name in names if name not in found]
    if missing:
        raise LookupError(f"{path} defines none of {missing}")
    for name in names:
        exec(compile(found[name], str(path), "exec"), namespace)
    return namespace


@dataclass
class VerlActorConfig:
    """The fields of verl's `ActorConfig` (verl/workers/config/actor.py) that `compute_policy_loss_vanilla`
    reads, with verl 0.9.1's defaults; `global_batch_info` is what verl's `ppo_loss` fills for `agg_loss`."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0
    global_batch_info: dict = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def verl_policy_loss() -> dict:
    """{"compute_policy_loss_vanilla": ..., "agg_loss": ...}: verl's own functions, read from the installed
    package's files (found without importing it). Raise ModuleNotFoundError without verl's files."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("verl is not installed (its files are read, not imported: ray is not needed)")
    import torch

    root = Path(list(spec.submodule_search_locations)[0])
    functional = load_definitions(
        root / "utils" / "torch_functional.py", ("masked_sum", "masked_mean"), {"torch": torch}
    )

    class AlgoConfig:  # compute_policy_loss_vanilla asserts that its config is not verl's AlgoConfig
        pass

    namespace = {
        "torch": torch,
        "Optional": Optional,
        "Any": Any,
        "ActorConfig": VerlActorConfig,
        "AlgoConfig": AlgoConfig,
        "verl_F": SimpleNamespace(masked_sum=functional["masked_sum"], masked_mean=functional["masked_mean"]),
    }
    return load_definitions(
        root / "trainer" / "ppo" / "core_algos.py", ("agg_loss", "compute_policy_loss_vanilla"), namespace
    )
