"""The weights that enter a surrogate before the aggregation: the rollout correction's weight and the trainer's given
`rollout_is_weight`, applied in one place for the policy term and verl's distillation term (which verl weighs as its
policy loss)."""

from __future__ import annotations

from torch import Tensor

from .rollout import Corrected


def weighted(per_token: Tensor, corrected: Corrected | None, rollout_is_weight: Tensor | None) -> Tensor:
    """`per_token` times the correction's weight and `rollout_is_weight`, each where present."""
    for weight in (None if corrected is None else corrected.weight, rollout_is_weight):
        if weight is not None:
            per_token = per_token * weight
    return per_token
