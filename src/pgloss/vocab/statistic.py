"""The one interface of a vocabulary statistic: what a loop (`chunks.ChunkLoop`, the one pass of the loss) computes
over tiles of logits, whichever backend (`backends.py`) runs it.

A loop hands a statistic, for a chunk of tokens `rows`, one tile of logits per source (`zs`, the trained model's
first) over the vocabulary columns `cols`:

- `tile_forward(zs, rows, cols, state)` -> the running state after the tile (None before the first tile);
- `tile_finish(state, rows, values)` writes the per-token values of `rows` (the buffers of `allocate`);
- `tile_grad(zs, rows, cols, values, grads, temperature)` -> ∂L/∂z of the first source over the tile, from the
  values and the loss's gradients with respect to the outputs;
- `outputs(values)`: what the loop returns.

The whole vocabulary is one tile: `forward` and `grad` are `tile_forward` + `tile_finish` and `tile_grad` over
every column. A torch statistic overrides them where its whole-vocabulary formula is another (`LogProbEntropy`
reads lse at the target: the formula the lab's runs, and so the README's tables, were measured with).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["Statistic"]


class Statistic:
    """Base of the vocabulary statistics (module docstring): the tile interface, and the whole vocabulary as one
    tile."""

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        raise NotImplementedError

    def tile_forward(self, zs: list, rows: slice, cols: slice, state: Any) -> Any:
        raise NotImplementedError

    def tile_finish(self, state: Any, rows: slice, values: list[Tensor]) -> None:
        raise NotImplementedError

    def tile_grad(
        self, zs: list, rows: slice, cols: slice, values: list[Tensor], grads: Any, temperature: float
    ) -> Tensor:
        raise NotImplementedError

    def outputs(self, values: list[Tensor]) -> Any:
        raise NotImplementedError

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        self.tile_finish(self.tile_forward(zs, rows, slice(0, zs[0].shape[-1]), None), rows, values)

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads: Any, temperature: float) -> Tensor:
        return self.tile_grad(zs, rows, slice(0, zs[0].shape[-1]), values, grads, temperature)
