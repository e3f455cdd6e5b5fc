"""Trinity-RFT 0.6.0's policy-loss modules, loaded by path: its package import pulls in the whole
trainer, so stub packages stand in for `trinity`, `trinity.algorithm` and
`trinity.algorithm.policy_loss_fn`, the light files the losses import are loaded first, and
`sys.modules` is restored afterwards."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

PACKAGES = ("trinity", "trinity.algorithm", "trinity.algorithm.policy_loss_fn")


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _trinity(module: str) -> bool:
    return module == "trinity" or module.startswith("trinity.")


@contextlib.contextmanager
def policy_loss_modules(root: str, *names: str) -> Iterator[dict[str, types.ModuleType]]:
    """The modules `names` of trinity/algorithm/policy_loss_fn/ under `root` (an unpacked wheel), in order."""
    algorithm = Path(root) / "trinity" / "algorithm"
    saved = {k: v for k, v in sys.modules.items() if _trinity(k)}
    try:
        for package in PACKAGES:
            sys.modules[package] = types.ModuleType(package)
        _load("trinity.algorithm.key_mapper", algorithm / "key_mapper.py")
        _load("trinity.algorithm.utils", algorithm / "utils.py")
        yield {
            name: _load(f"trinity.algorithm.policy_loss_fn.{name}", algorithm / "policy_loss_fn" / f"{name}.py")
            for name in ("policy_loss_fn", *names)
        }
    finally:
        for k in [k for k in sys.modules if _trinity(k)]:
            del sys.modules[k]
        sys.modules.update(saved)
