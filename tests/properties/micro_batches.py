"""One optimizer step cut into micro-batches, the way a trainer runs it: each micro-batch's loss is
back-propagated on its own and the gradients accumulate. Every test that holds "micro-batches counted for
the step add up to the whole call" runs its loop here (`micro_batches`, or `split_call` for the plain
call on a batch of row tensors), and asserts on what comes back.

Imported as `from properties.micro_batches import ...` (tests/ is on the path, see conftest.py)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor


def parts_of(sizes: Iterable[int]) -> list[slice]:
    """Consecutive row slices holding `sizes` rows each: [2, 4, 3] -> rows 0:2, 2:6, 6:9."""
    bounds = [0, *itertools.accumulate(sizes)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def cut(value: Tensor, parts: Iterable[Any]) -> list[Tensor]:
    """`value`'s rows of each part, the per-micro-batch lists a step's count takes
    (`Normalizer.count`, `algorithm.step_normalizer`)."""
    return [value[p] for p in parts]


def micro_batches(loss_of: Callable[[Any], Any], parts: Iterable[Any]) -> Tensor:
    """Σ over `parts` of `loss_of(part)` (a `LossOutput` or a loss tensor), each back-propagated on its
    own before the next micro-batch runs, so gradients accumulate in the leaves' `.grad` as in a trainer.
    Returns the summed loss, detached. A part is whatever `loss_of` takes (a slice of rows, or a pair of
    it and that micro-batch's own setting)."""
    total = None
    for part in parts:
        out = loss_of(part)
        loss = getattr(out, "loss", out)
        loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
    return torch.zeros(()) if total is None else total


def rows(inputs: dict[str, Any], part: Any) -> dict[str, Any]:
    """`inputs` cut to the rows of `part`; a value that is not a tensor (None) passes as it is."""
    return {k: v[part] if isinstance(v, Tensor) else v for k, v in inputs.items()}


def split_call(algorithm, log_prob: Tensor, parts: Iterable[Any], normalizer, **inputs: Any) -> tuple[Tensor, Tensor]:
    """The plain call in micro-batches: `algorithm(log_prob[p], **inputs[p], normalizer=normalizer)` for
    each part of rows, on a fresh leaf copy of `log_prob`. `inputs` are the call's other arguments by name
    (old_log_prob, advantages, mask, the optional ones), each cut by rows. Returns (the summed loss,
    detached; the gradient with respect to `log_prob`)."""
    leaf = log_prob.detach().clone().requires_grad_(True)
    total = micro_batches(lambda p: algorithm(leaf[p], **rows(inputs, p), normalizer=normalizer), parts)
    return total, leaf.grad
