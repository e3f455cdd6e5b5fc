"""What a loss call hands back (`LossOutput`), what a family's policy term hands to the call
(`PolicyTerms`), and the one-line argument check every config uses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from torch import Tensor

from .metrics import Stat


@dataclass(frozen=True)
class LossOutput:
    """`loss`: scalar with grad. `metrics`: detached 0-d tensors. `per_token`: the `[B, T]` policy term ℓ.
    `stats`: each metric as a `Stat` (its value, what it averages over and how a step combines it), which
    `pgloss.StepMetrics` reads; a metric a user's family returned as a bare tensor has none."""

    loss: Tensor
    metrics: dict[str, Tensor]
    per_token: Tensor
    stats: dict[str, Stat] = field(default_factory=dict)

    @classmethod
    def of(cls, loss: Tensor, metrics: Mapping[str, Stat | Tensor], per_token: Tensor) -> LossOutput:
        """The output of a call whose metrics are `Stat`s (a bare tensor is kept as a value without one)."""
        stats = {key: value for key, value in metrics.items() if isinstance(value, Stat)}
        values = {key: value.value if isinstance(value, Stat) else value for key, value in metrics.items()}
        return cls(loss=loss, metrics=values, per_token=per_token, stats=stats)


@dataclass(frozen=True)
class PolicyTerms:
    """What a family's policy term hands back to `Algorithm.__call__`: the per-token term and its metrics,
    each a `Stat` (`core/metrics.py`: `token_mean`, `ratio_metrics`, ...), so that it says how a step combines it."""

    per_token: Tensor
    metrics: dict[str, Stat] = field(default_factory=dict)


def check(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition: the one-line argument check of every config."""
    if not condition:
        raise ValueError(message)
