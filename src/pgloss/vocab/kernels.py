"""The launches of the vocabulary loop's Triton kernels (`triton_kernels.py`), on raw tiles of head outputs.

The backend that calls them (`backends.TRITON_TILES`) and the choice of a backend for a loop (`backends.choose`)
live in `backends.py`; `use` and `route`, documented here first, are the same functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from .backends import route, use
from .head import HeadKind

__all__ = ["use", "route", "RawTile"]


@dataclass
class RawTile:
    """A tile of one head's raw outputs on the kernel route: `r` = x W[cols]ᵀ [rows, width] in the head's
    dtype, its `bias` (the tile's columns, or None), its `kind` (`head.HeadKind`) and the temperature."""

    r: Tensor
    bias: Tensor | None
    kind: HeadKind
    temperature: float

    def args(self) -> tuple:
        """The kernels' per-head arguments: the tile, its row stride, its bias and the bias's stride (a view of
        any stride, 0 for an expanded one: read where it lies, never copied), scale and soft-cap."""
        kind, bias = self.kind, self.bias
        return (
            self.r,
            self.r.stride(0),
            self.r if bias is None else bias,
            0 if bias is None else bias.stride(0),
            kind.scale,
            1.0 if kind.softcap is None else kind.softcap,
        )

    def flags(self) -> tuple[bool, bool]:
        """HAS_BIAS, SOFTCAP of the kernels for this head."""
        return self.bias is not None, self.kind.softcap is not None


def _kernels():
    from . import triton_kernels

    return triton_kernels


# A kernel's launch. One program per row of a tile, on the grid's x axis: CUDA launches up to 2³¹ − 1 programs
# there (65,535 on y and z, the limit an unchunked loss of 65,536 tokens met in Liger-Kernel #1294). Every
# offset of a row (in the tile, the targets, the running state) is 64-bit, so a tile past 2³¹ elements does
# not wrap (Cut Cross-Entropy #39); a column within a row is 32-bit, hence at most `MAX_WIDTH` columns a tile.
GRID_X = 2**31 - 1
WIDEST_BLOCK = 2048
MAX_WIDTH = 2**31 - WIDEST_BLOCK  # the last block's columns, start + [0, BLOCK), stay below 2³¹


def grid(rows: int) -> tuple[int]:
    """The launch grid of a tile of `rows` rows: one program per row on the x axis."""
    if rows > GRID_X:
        raise ValueError(
            f"chunk_size gives a chunk of {rows} rows, one program each on the grid's x axis, at most "
            f"{GRID_X} (CUDA's limit): pass a smaller chunk_size"
        )
    return (rows,)


def launch_shape(width: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of a kernel over rows of `width` columns: the columns each program takes at a time (the
    width's power of two, 16 to 2048) and its warps."""
    if width > MAX_WIDTH:
        raise ValueError(
            f"vocab_block gives a tile of {width} columns, whose 32-bit column offsets allow at most "
            f"{MAX_WIDTH} columns: pass a smaller vocab_block"
        )
    block = min(WIDEST_BLOCK, max(16, 1 << (width - 1).bit_length()))
    return block, 8 if block >= 1024 else 4


def _launch(kernel, tile: RawTile, *args, **constants) -> None:
    rows, width = tile.r.shape
    if rows == 0 or width == 0:
        return
    block, warps = launch_shape(width)
    kernel[grid(rows)](*args, BLOCK=block, num_warps=warps, **constants)


def start_state(tile: RawTile, maxima: int, sums: int) -> list[Tensor]:
    """A running state of the forward kernels for the tile's rows: `maxima` at −inf, then `sums` zeros,
    float32 [rows] each (filled on the device: no value crosses from the host)."""
    rows, device = tile.r.shape[0], tile.r.device
    return [torch.full((rows,), -torch.inf, dtype=torch.float32, device=device) for _ in range(maxima)] + [
        torch.zeros(rows, dtype=torch.float32, device=device) for _ in range(sums)
    ]


def log_prob_entropy_forward(tile: RawTile, targets: Tensor, col0: int, state: list[Tensor]) -> None:
    """State (m, s, a, z_y) [rows] updated in place by one tile (`entropy.LogProbEntropy`)."""
    has_bias, softcap = tile.flags()
    _launch(
        _kernels().log_prob_entropy_forward,
        tile,
        *tile.args(),
        targets,
        targets.stride(0),
        *state,
        tile.r.shape[1],
        col0,
        1.0 / tile.temperature,
        HAS_BIAS=has_bias,
        SOFTCAP=softcap,
    )


def log_prob_entropy_backward(
    tile: RawTile,
    targets: Tensor,
    col0: int,
    shift: Tensor,
    log_s: Tensor,
    entropy: Tensor,
    grad_log_prob: Tensor | None,
    grad_entropy: Tensor | None,
) -> Tensor:
    """∂L/∂r over the tile (returned), from the rows' shift c and log s (log π = (z − c) − log s), H and the
    loss's ∂L/∂log π(y), ∂L/∂H."""
    has_bias, softcap = tile.flags()
    _launch(
        _kernels().log_prob_entropy_backward,
        tile,
        *tile.args(),
        targets,
        targets.stride(0),
        shift,
        log_s,
        entropy,
        shift if grad_log_prob is None else grad_log_prob.contiguous(),
        shift if grad_entropy is None else grad_entropy.contiguous(),
        tile.r.shape[1],
        col0,
        1.0 / tile.temperature,
        HAS_BIAS=has_bias,
        SOFTCAP=softcap,
        HAS_GLP=grad_log_prob is not None,
        HAS_GENT=grad_entropy is not None,
    )
    return tile.r


def _pair(tile: RawTile, other: RawTile) -> tuple[tuple, dict]:
    (has_bias, softcap), (has_bias2, softcap2) = tile.flags(), other.flags()
    return (*tile.args(), *other.args()), dict(
        HAS_BIAS=has_bias, SOFTCAP=softcap, HAS_BIAS2=has_bias2, SOFTCAP2=softcap2
    )


def pair_forward(tile: RawTile, other: RawTile, state: list[Tensor]) -> None:
    """State (m, m₂, s, s₂, D) [rows] updated in place by one tile of each head (`full_kl.FullKL`)."""
    args, flags = _pair(tile, other)
    _launch(_kernels().pair_forward, tile, *args, *state, tile.r.shape[1], 1.0 / tile.temperature, **flags)


# The gradients of `triton_kernels.pair_backward`, by statistic.
REVERSE_KL, FORWARD_KL, JSD = 0, 1, 2


def pair_backward(
    tile: RawTile,
    other: RawTile,
    lse: Tensor,
    lse_other: Tensor,
    shift: Tensor,
    grad: Tensor,
    *,
    mode: int,
    beta: float = 1.0,
) -> Tensor:
    """∂L/∂r of the first head over its tile (returned): KL(π‖ρ)'s (`REVERSE_KL`, `shift` = KL), KL(ρ‖π)'s
    (`FORWARD_KL`) or JSD(β)'s (`JSD`, `shift` = KL(π‖m))."""
    args, flags = _pair(tile, other)
    mixture = (math.log1p(-beta), math.log(beta), 1.0 - beta) if mode == JSD else (0.0, 0.0, 1.0)
    _launch(
        _kernels().pair_backward,
        tile,
        *args,
        lse,
        lse_other,
        shift,
        grad.contiguous(),
        tile.r.shape[1],
        1.0 / tile.temperature,
        *mixture,
        MODE=mode,
        **flags,
    )
    return tile.r


def jsd_forward(tile: RawTile, other: RawTile, lse: Tensor, lse_other: Tensor, sums: list[Tensor], beta: float) -> None:
    """The JSD(β) sums (KL(p_T‖m), KL(p_S‖m)) [rows] increased in place by one tile of each head."""
    args, flags = _pair(tile, other)
    _launch(
        _kernels().jsd_forward,
        tile,
        *args,
        lse,
        lse_other,
        *sums,
        tile.r.shape[1],
        1.0 / tile.temperature,
        math.log1p(-beta),
        math.log(beta),
        **flags,
    )
