"""The loss call's optional inputs: one table of their names, shapes and checks, read by every path.

`Algorithm.needs` says which of them a configured loss cannot do without; the call refuses a
missing one (base.py), `TokenBatch.prepare` checks and masks those given (core/batch.py),
`from_hidden` passes them through (`pgloss.from_hidden`), and an adapter refuses a loss that needs one
its trainer never passes (integrations/verl.py). A new input is one row here and one field of
`TokenBatch`.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Collection, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OptionalInput:
    """One optional input of the loss call.

    `per`: "token" for `[B, T]` (log_prob's shape, zeroed at masked positions), "row" for `[B]`.
    `log_prob`: a log-probability (log_prob's dtype, at most 0). `grad`: keeps its gradient (the
    others are detached). `kind`: "real" (cast to the compute dtype), "integer" (ids) or "bool"
    (flags); integers and flags are passed as given."""

    name: str
    per: str
    doc: str
    log_prob: bool = False
    grad: bool = False
    kind: str = "real"


OPTIONAL_INPUTS: dict[str, OptionalInput] = {
    spec.name: spec
    for spec in (
        OptionalInput(
            "ref_log_prob", "token", "log π_ref(y_t), the frozen reference model's, for the KL term", log_prob=True
        ),
        OptionalInput("entropy", "token", "H(π_θ(·|s_t)) with its gradient, for the entropy bonus", grad=True),
        OptionalInput(
            "rollout_log_prob", "token", "the inference engine's log-probs, for a rollout correction", log_prob=True
        ),
        OptionalInput(
            "group_ids", "row", "the prompt of each row (integers), for the group modes and contrasts", kind="integer"
        ),
        OptionalInput("scores", "row", "[B], the raw sequence rewards its loss weighs by"),
        OptionalInput(
            "full_kl", "token", "the exact per-token KL(π‖π_ref) with its gradient, for kl_estimator='full'", grad=True
        ),
        OptionalInput(
            "teacher_log_prob",
            "token",
            "log π_T(y_t), the teacher's log-probs of the sampled tokens, for on-policy distillation",
            log_prob=True,
        ),
        OptionalInput(
            "expert", "row", "the flags (bool) of expert (demonstration) rows, for CHORD's SFT term", kind="bool"
        ),
        OptionalInput(
            "rollout_is_weight",
            "token",
            "an importance weight the trainer computed (verl's rollout_is_weights): it multiplies the policy term "
            "before the aggregation, detached",
        ),
    )
}
"""Every optional input of `Algorithm.__call__`, in the order of its signature."""

STEP_INPUTS = ("log_prob", "old_log_prob", "advantages", *OPTIONAL_INPUTS)
"""The call's arguments a step's count takes by name (`Algorithm.count_step`), besides `mask`."""


def check_names(inputs: Mapping[str, object], allowed: Collection[str] = tuple(OPTIONAL_INPUTS)) -> None:
    """TypeError naming an argument that is not an optional input (or one of `allowed`), with the closest name."""
    for name in inputs:
        if name not in allowed:
            close = difflib.get_close_matches(name, allowed, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else f"; the optional inputs are {', '.join(allowed)}"
            raise TypeError(f"unexpected argument {name!r}{hint}")


def keyword_parameters(allowed: dict[str, OptionalInput] = OPTIONAL_INPUTS) -> list[inspect.Parameter]:
    """The inputs as keyword parameters defaulting to None, for a signature that spells them out."""
    return [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Tensor | None")
        for name in allowed
    ]
