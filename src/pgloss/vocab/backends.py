"""The backends that run a vocabulary statistic, and the one choice of a backend for a loop.

A statistic (`statistic.Statistic`: `entropy.LogProbEntropy`, `support.SupportLogProbEntropy` (torch only),
`full_kl.FullKL`, `divergence.ForwardKL`, `divergence.Normalisers`, `jsd.GeneralisedJSD`, and torch only
`skewed.SkewedKL`, `adaptive_kl.AdaptiveKL`, `adaptive_kl.HeadSearch`) says what a loop computes: its per-token
values, its running state over vocabulary tiles and its gradient. A backend says how, and holds the table of the statistics it runs:

- `TORCH` ("torch"; the reference, and the route on CPU): each tile of logits is formed in float32 by torch ops
  (`head.HeadKind.transform_`) and walked by the statistic's own torch code. It runs every statistic.
- `TRITON_TILES` ("kernel"; chosen automatically for LM heads on CUDA with a Triton that runs the kernels): the
  tile is the matmul's own output r = x Wᵀ in the head's dtype (`kernels.RawTile`), and one Triton kernel per tile
  applies the head (bias, logit scale, soft-cap, τ) in registers and reads the tile once: forward, the statistic's
  running sums; backward, ∂L/∂r written over the tile, which the two gradient matmuls take as it is
  (`triton_kernels.py`). Its table holds each statistic's launches (`TileOps`), added beside the statistic.
- `TRITON_HEAD` ("head-kernel"; opt-in, `use("head-kernel")`): no tile of logits at all. Each kernel forms its
  block of x Wᵀ with tl.dot inside it (`head_tile_kernels.py`, `head_tile.py`); its table holds log π(y) and H.

`choose(...)` decides for every loop, once per call (`plan.plan` calls it and hands the backend down);
`use("torch" | "kernel" | "head-kernel" | "auto")` overrides it for a block of code (a test of the kernels on CPU
tensors under `TRITON_INTERPRET=1`, or the torch route on CUDA to compare). float64 heads always take the torch
route; "auto" never takes the head-kernel route, nor the kernels on a Triton older than `MIN_TRITON`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["use", "route", "choose", "Backend", "TileOps", "Plan", "TORCH", "TRITON_TILES", "TRITON_HEAD"]

ROUTES = ("auto", "torch", "kernel", "head-kernel")
_chosen = {"route": "auto"}  # a plain global, which torch.compile can read (it guards on its value)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# The oldest Triton whose compiler takes the kernels. Triton 3.0 and 3.1 refuse them ("arange's arguments must be
# of type tl.constexpr": a block size handed on as a tl.constexpr argument); 3.2, 3.3, 3.4 and 3.6 run them, each
# measured on this package's kernels (both Triton routes, log π and H, the exact KL) in Triton's interpreter.
MIN_TRITON = (3, 2)


def _triton_version() -> tuple[int, ...] | None:
    """The installed Triton's (major, minor, patch), read from its package metadata (Triton itself is imported
    only by a route that launches its kernels), or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    for name in ("triton", "pytorch-triton", "pytorch-triton-rocm", "pytorch-triton-xpu"):
        try:
            text = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return tuple(int(part) for part in re.findall(r"\d+", text)[:3])
    import triton  # a Triton without package metadata (a source checkout): its own word

    return tuple(int(part) for part in re.findall(r"\d+", triton.__version__)[:3])


TRITON_VERSION = _triton_version()  # read once: compiled code reads a constant
TRITON = TRITON_VERSION is not None


def _version(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version)


@contextlib.contextmanager
def use(which: str) -> Iterator[None]:
    """Within the block, the vocabulary loop takes route `which`: "kernel" (Triton; refused where it cannot
    run), "head-kernel" (the logits formed inside Triton kernels: log π(y) and H of one LM head; refused
    elsewhere), "torch", or "auto" (the kernel route for LM heads on CUDA with a Triton that runs the kernels,
    else torch)."""
    if which not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {which!r}")
    before, _chosen["route"] = _chosen["route"], which
    try:
        yield
    finally:
        _chosen["route"] = before


class TileOps(NamedTuple):
    """A statistic's Triton launches on raw tiles (`kernels.RawTile`), an entry of `TRITON_TILES`'s table: the
    statistic's `tile_forward` and `tile_grad` with the statistic first, and (where the kernels compute a whole
    vocabulary otherwise than as one tile, JSD(β): both normalisers first) its whole-vocabulary `forward`."""

    tile_forward: Callable[..., Any]
    tile_grad: Callable[..., Any]
    forward: Callable[..., None] | None = None


def _kind_of(statistic: object) -> type:
    """The statistic's class (`statistic` may be an instance or its class): the key of a backend's table."""
    return statistic if isinstance(statistic, type) else type(statistic)


class Backend:
    """How a loop runs a statistic. The loop (`chunks.ChunkLoop`, the one pass of the loss) calls the statistic's
    tile interface through its backend: `forward` / `grad` over the whole vocabulary (one tile), `tile_forward`,
    `tile_finish`, `tile_grad` over vocabulary tiles. This one, `TORCH`, runs each statistic's own torch code."""

    name = "torch"
    raw_tiles = False  # whether a head source hands out the matmul's raw tile (`kernels.RawTile`) for kernels

    def runs(self, statistic: object) -> bool:
        return True

    def forward(self, statistic: Any, zs: list, rows: slice, values: list[Tensor]) -> None:
        statistic.forward(zs, rows, values)

    def tile_forward(self, statistic: Any, zs: list, rows: slice, cols: slice, state: Any) -> Any:
        return statistic.tile_forward(zs, rows, cols, state)

    def tile_finish(self, statistic: Any, state: Any, rows: slice, values: list[Tensor]) -> None:
        statistic.tile_finish(state, rows, values)

    def grad(self, statistic: Any, zs: list, rows: slice, values: list[Tensor], grads: Any, temperature: float):
        return statistic.grad(zs, rows, values, grads, temperature)

    def tile_grad(
        self, statistic: Any, zs: list, rows: slice, cols: slice, values: list[Tensor], grads: Any, temperature: float
    ) -> Tensor:
        return statistic.tile_grad(zs, rows, cols, values, grads, temperature)


class TritonTiles(Backend):
    """The statistics' Triton kernels on the matmul's raw tiles: the table `ops` (statistic class -> `TileOps`).
    The running state and the values are the statistic's (its `tile_finish`, `allocate`, `outputs`); a whole
    vocabulary is one tile."""

    name = "kernel"
    raw_tiles = True

    def __init__(self) -> None:
        self.ops: dict[type, TileOps] = {}

    def add(self, statistic: type, ops: TileOps) -> None:
        """`statistic` runs on this backend with the launches `ops` (called beside the statistic's class)."""
        self.ops[statistic] = ops

    def runs(self, statistic: object) -> bool:
        return _kind_of(statistic) in self.ops

    def forward(self, statistic: Any, zs: list, rows: slice, values: list[Tensor]) -> None:
        ops = self.ops[type(statistic)]
        if ops.forward is not None:
            ops.forward(statistic, zs, rows, values)
            return
        state = ops.tile_forward(statistic, zs, rows, slice(0, zs[0].r.shape[1]), None)
        statistic.tile_finish(state, rows, values)

    def tile_forward(self, statistic: Any, zs: list, rows: slice, cols: slice, state: Any) -> Any:
        return self.ops[type(statistic)].tile_forward(statistic, zs, rows, cols, state)

    def grad(self, statistic: Any, zs: list, rows: slice, values: list[Tensor], grads: Any, temperature: float):
        whole = slice(0, zs[0].r.shape[1])
        return self.ops[type(statistic)].tile_grad(statistic, zs, rows, whole, values, grads, temperature)

    def tile_grad(
        self, statistic: Any, zs: list, rows: slice, cols: slice, values: list[Tensor], grads: Any, temperature: float
    ) -> Tensor:
        return self.ops[type(statistic)].tile_grad(statistic, zs, rows, cols, values, grads, temperature)


class TritonHead(Backend):
    """Kernels that form the logits themselves (tl.dot) and never hold a tile of them: the table `ops` (statistic
    class -> the autograd function's `apply` over one LM head's hidden states [N, H], weight and bias). It runs
    outside the chunk loop: `run`."""

    name = "head-kernel"

    def __init__(self) -> None:
        self.ops: dict[type, Callable[..., Any]] = {}

    def add(self, statistic: type, run: Callable[..., Any]) -> None:
        self.ops[statistic] = run

    def runs(self, statistic: object) -> bool:
        return _kind_of(statistic) in self.ops

    def run(self, statistic: Any, *args: Any) -> Any:
        """`statistic`'s outputs on this backend: its entry called with (statistic, kind, temperature, columns,
        valid rows, hidden, weight, bias)."""
        return self.ops[type(statistic)](statistic, *args)


TORCH = Backend()
TRITON_TILES = TritonTiles()
TRITON_HEAD = TritonHead()
BACKENDS = {backend.name: backend for backend in (TORCH, TRITON_TILES, TRITON_HEAD)}


class Plan(NamedTuple):
    """A loop's plan, resolved once per call (`plan.plan`) and handed down: tokens per chunk, vocabulary columns
    per tile, and the backend that runs it (a bare (chunk_size, vocab_block) pair runs on `TORCH`)."""

    chunk_size: int
    vocab_block: int
    backend: Backend = TORCH


def triton_runs(device: torch.device) -> bool:
    """Whether the automatic choice takes Triton's kernels on `device`: a CUDA device, and a Triton at least
    `MIN_TRITON` installed."""
    return device.type == "cuda" and TRITON_VERSION is not None and TRITON_VERSION >= MIN_TRITON


def choose(statistic: object, kinds: tuple, weight: Tensor) -> Backend:
    """The backend of a loop of `statistic` (or its class) over sources of `kinds` (a `head.HeadKind` each, or
    "logits"), the trained model's source defined by `weight` (its LM head; its logits for a logits source): its
    device and dtype. Triton's backends need LM-head sources in float32 or half precision and a statistic in their
    table; the head-kernel backend (only when chosen by `use`) one LM-head source. The one place a route is chosen."""
    chosen = _chosen["route"]
    if chosen == "torch":
        return TORCH
    device, dtype = weight.device, weight.dtype
    heads = all(kind != "logits" for kind in kinds) and dtype in KERNEL_DTYPES
    if chosen == "head-kernel":
        if not (heads and len(kinds) == 1 and TRITON_HEAD.runs(statistic)):
            raise ValueError(
                f"the head-kernel route runs log π(y) and H of one LM-head source in float32, bfloat16 or "
                f"float16 (the statistics of backends.TRITON_HEAD); got {_name(statistic)} on {kinds} in {dtype}: "
                f'take the kernel route (use("kernel")) for it'
            )
        _runnable("head-kernel", device)
        return TRITON_HEAD
    possible = heads and TRITON_TILES.runs(statistic)
    if chosen == "auto":
        return TRITON_TILES if possible and triton_runs(device) else TORCH
    if not possible:
        raise ValueError(
            f"the kernel route runs LM-head sources in float32, bfloat16 or float16 with a statistic "
            f"of backends.TRITON_TILES; got {_name(statistic)} on {kinds} in {dtype}"
        )
    _runnable("kernel", device)
    return TRITON_TILES


def route(statistic: object, kinds: tuple, weight: Tensor) -> str:
    """The name of `choose`'s backend: "torch", "kernel" or "head-kernel"."""
    return choose(statistic, kinds, weight).name


def _name(statistic: object) -> str:
    return _kind_of(statistic).__name__


def _runnable(which: str, device: torch.device) -> None:
    """RuntimeError unless a Triton of at least `MIN_TRITON` is installed and `device` is CUDA, or Triton's
    interpreter runs the kernels."""
    if TRITON_VERSION is None:
        raise RuntimeError(f"the {which} route needs Triton (pip install triton)")
    if TRITON_VERSION < MIN_TRITON:
        raise RuntimeError(
            f"the {which} route needs Triton >= {_version(MIN_TRITON)}, found Triton {_version(TRITON_VERSION)}, "
            f"whose compiler refuses the kernels: pip install 'triton>={_version(MIN_TRITON)}' (or take the torch "
            'route: use("torch"), or "auto")'
        )
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"the {which} route on {device.type} tensors runs only in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is imported"
        )
