"""What a loss call hands back (`LossOutput`), what a family's policy term hands to the call
(`PolicyTerms`), and the one-line argument check every config uses."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor


@dataclass(frozen=True)
class LossOutput:
    """`loss`: scalar with grad. `metrics`: detached 0-d tensors. `per_token`: the `[B, T]` policy term ℓ."""

    loss: Tensor
    metrics: dict[str, Tensor]
    per_token: Tensor


@dataclass(frozen=True)
class PolicyTerms:
    """What a family's policy term hands back to `Algorithm.__call__`."""

    per_token: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def check(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition: the one-line argument check of every config."""
    if not condition:
        raise ValueError(message)
