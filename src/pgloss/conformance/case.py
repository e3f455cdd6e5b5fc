"""One conformance case: pgloss against a trainer's own loss function on one random batch, and the
batch the trainer modules share (`batch`) with the error they measure (`relative`, on `flat_grad`s)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGREE, DOCUMENTED, DIFFERS = "agree", "differs as documented", "DIFFERS"


@dataclass(frozen=True)
class Case:
    """`trainer`'s `function` against pgloss's `algorithm` on one batch (`setting` names the options).

    `loss_error` and `grad_error` are the relative differences of the loss and of the gradient with
    respect to the log-probs. `status` is AGREE when both are within `tolerance`; DOCUMENTED when
    they differ and `reason` says where docs/reference.md writes the difference down; DIFFERS otherwise.
    """

    trainer: str
    function: str
    algorithm: str
    setting: str
    loss_error: float
    grad_error: float
    tolerance: float
    reason: str | None = None

    @property
    def status(self) -> str:
        if max(self.loss_error, self.grad_error) <= self.tolerance:
            return AGREE
        return DOCUMENTED if self.reason else DIFFERS


ROWS, LENGTH = 6, 9
"""The shared batch: 6 rows of 3 to 9 valid tokens (padded to 9)."""


def batch(seed: int, *, empty_row: bool = False, rows: int = ROWS, length: int = LENGTH) -> dict[str, torch.Tensor]:
    """One random float64 batch: `mask` (float, rows of 3 to `length` tokens; row 2 empty with
    `empty_row`), `old`, `log_prob` (old + 0.3·N(0,1)), `ref` (0.2), `sampling` (0.4) log-probs, all
    ≤ 0 (pgloss refuses a positive log-prob), `advantages` [rows] ~ N(0,1) and `entropy` ~ U[0, 2)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, length + 1, (rows,), generator=g)
    if empty_row:
        lengths[2] = 0
    mask = (torch.arange(length)[None] < lengths[:, None]).double()
    old = -torch.rand(rows, length, generator=g, dtype=torch.float64) * 2 - 0.05
    near = lambda scale: -(old + scale * torch.randn(rows, length, generator=g, dtype=torch.float64)).abs()  # noqa: E731
    return dict(
        mask=mask,
        old=old,
        log_prob=near(0.3),
        ref=near(0.2),
        sampling=near(0.4),
        advantages=torch.randn(rows, generator=g, dtype=torch.float64),
        entropy=torch.rand(rows, length, generator=g, dtype=torch.float64) * 2,
    )


def flat_grad(leaf: torch.Tensor) -> torch.Tensor:
    """∂loss/∂`leaf` after `backward()`, flattened: zeros where the loss does not reach `leaf` (no `.grad`)."""
    return torch.zeros(leaf.numel(), dtype=leaf.dtype) if leaf.grad is None else leaf.grad.flatten()


def relative(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """‖mine − theirs‖ / ‖theirs‖ (a loss or a flattened gradient)."""
    return float((mine - theirs).norm() / theirs.norm().clamp(min=1e-30))
