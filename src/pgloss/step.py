"""One optimizer step of an algorithm, for any trainer: counted once, its micro-batches' losses, their metrics.

    step = pgloss.Step(algorithm, micro_batches)    # the step's counts: `Algorithm.count_step`, once
    for micro in micro_batches:                      # each a dict of the call's keyword arguments
        out = step(log_prob=policy(micro), **micro)  # the call, with the step's Normalizer
        out.loss.backward()                          # its exact share of the step's loss
    logged = step.metrics.as_floats()                # the step's metrics (`StepMetrics`), one host sync

A trainer that counts the step itself (verl's `global_batch_info`) gives the counts instead of the
micro-batches: `Step(algorithm, normalizer=...)`. The adapters (`pgloss.integrations`) only map a trainer's
names and options onto this object; the counting, the call and the metrics are here, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor

from .base import Algorithm
from .core.inputs import OPTIONAL_INPUTS, check_names
from .core.normalizer import Normalizer
from .core.output import LossOutput
from .core.sequence_parallel import SequenceParallel
from .core.step_metrics import StepMetrics

__all__ = ["Step"]

CALL = ("log_prob", "old_log_prob", "advantages", "mask")
"""The call's own arguments (`Algorithm.__call__`); the rest of a micro-batch are its optional inputs."""

COUNTED = ("old_log_prob", *OPTIONAL_INPUTS)
"""The inputs of a micro-batch the step's count is given (it reads those its configuration counts)."""


class Step:
    """One optimizer step of `algorithm`: its counts, taken once, and its micro-batches' losses and metrics.

    `micro_batches`: the step's micro-batches on this rank, each a mapping of the call's keyword arguments
    (`mask` required; `old_log_prob`, `group_ids`, `rollout_log_prob`, ... where given; `log_prob` and the
    rest may be there too and are not read by the count). Construction counts the step with
    `algorithm.count_step` over all of them (a collective under torch.distributed: every rank of
    `process_group` builds its Step at every step). An input is counted when every micro-batch gives it.
    `count_rejected`, `process_group`, `reduce`, `sequence_parallel`: as `Algorithm.count_step`'s.

    `normalizer`: the step's counts, made by the trainer (instead of `micro_batches`).
    `metrics`: the `StepMetrics` the calls' metrics are added to (default: a new one over `process_group`
    and `reduce`); pass one to keep adding across steps, or to reduce the metrics otherwise than the counts.

    Calling the step (`step(log_prob=, old_log_prob=, advantages=, mask=, **inputs)`, or
    `step.from_hidden(hidden, weight, targets, ...)`) computes one micro-batch's `LossOutput` with the step's
    `Normalizer` and adds its metrics to `metrics`; the micro-batches' losses sum to the step's loss.
    """

    def __init__(
        self,
        algorithm: Algorithm,
        micro_batches: Sequence[Mapping[str, Any]] = (),
        *,
        normalizer: Normalizer | None = None,
        count_rejected: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
        metrics: StepMetrics | None = None,
    ) -> None:
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"algorithm must be a pgloss.Algorithm, got {type(algorithm).__name__}")
        if isinstance(micro_batches, Mapping) or not isinstance(micro_batches, Sequence):
            raise TypeError(
                f"micro_batches must be a sequence of mappings (one per micro-batch), got {type(micro_batches).__name__}"
            )
        batches = tuple(dict(batch) for batch in micro_batches)
        if (normalizer is None) == (not batches):
            raise ValueError("give the step's micro_batches (to count it) or its normalizer (counted), not both")
        if normalizer is not None and not isinstance(normalizer, Normalizer):
            raise TypeError(f"normalizer must be a pgloss.Normalizer, got {type(normalizer).__name__}")
        if metrics is not None and not isinstance(metrics, StepMetrics):
            raise TypeError(f"metrics must be a pgloss.StepMetrics, got {type(metrics).__name__}")
        self.algorithm = algorithm
        self.micro_batches = batches
        if normalizer is None:
            masks, inputs = _counted(batches)
            normalizer = algorithm.count_step(
                masks,
                count_rejected=count_rejected,
                process_group=process_group,
                reduce=reduce,
                sequence_parallel=sequence_parallel,
                **inputs,
            )
        self.normalizer = normalizer
        self.metrics = StepMetrics(process_group=process_group, reduce=reduce) if metrics is None else metrics

    def __call__(self, **call: Any) -> LossOutput:
        """One micro-batch's loss: `algorithm(**call, normalizer=<the step's>)`; its metrics are added."""
        return self._add(self.algorithm(**_without_normalizer(call), normalizer=self.normalizer))

    def from_hidden(self, hidden: Tensor, weight: Tensor, targets: Tensor, **kwargs: Any) -> LossOutput:
        """One micro-batch's loss from hidden states (`Algorithm.from_hidden`), with the step's Normalizer;
        its metrics are added."""
        out = self.algorithm.from_hidden(
            hidden, weight, targets, **_without_normalizer(kwargs), normalizer=self.normalizer
        )
        return self._add(out)

    def _add(self, out: LossOutput) -> LossOutput:
        self.metrics.add(out)
        return out


def _without_normalizer(call: dict[str, Any]) -> dict[str, Any]:
    if "normalizer" in call:
        raise TypeError("a Step's calls take the step's normalizer; pass no normalizer= to them")
    return call


def _counted(batches: tuple[dict[str, Any], ...]) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
    """The micro-batches' masks and the counted inputs that each of them gives, by the call's names (one that
    only some give is refused: the step would be counted on a part of it)."""
    for batch in batches:
        if batch.get("mask") is None:
            raise ValueError("every micro-batch of a Step needs its mask")
        check_names({name: value for name, value in batch.items() if name not in CALL})
    inputs: dict[str, list[Tensor]] = {}
    for name in COUNTED:
        given = [batch.get(name) is not None for batch in batches]
        if all(given):
            inputs[name] = [batch[name] for batch in batches]
        elif any(given):
            raise ValueError(f"{name} is given in some micro-batches of the step and not in others")
    return [batch["mask"] for batch in batches], inputs
