"""pgloss's SDAR term against ms-swift's (`pgloss conformance --trainer ms_swift_sdar`): ms-swift 4.6.0's own
`swift/rl_core/advantage.py` `compute_sdar_loss` (with `_sdar_agg_loss`), read from its file as
`pgloss.conformance.ms_swift` reads the trainer's (`$PGLOSS_MS_SWIFT_SRC` or the installed distribution), against
`pgloss.get("grpo", policy_coef=0, kl_coef=0, sdar_coef=1, sdar_gate_beta=β)`: the term alone, on one micro-batch
(ms-swift takes its token mean per micro-batch, pgloss over the step: one micro-batch is both), value and
gradient with respect to the log-probs, float64.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import torch

from .case import Case, batch, flat_grad, relative
from .sources import load, locate

__all__ = ["TRAINER", "available", "cases"]

TRAINER = "ms-swift"
VARIABLE, PIN = "PGLOSS_MS_SWIFT_SRC", "ms-swift==4.6.0"
ADVANTAGE_FILE = "swift/rl_core/advantage.py"
TOLERANCE = 1e-12
GATE_BETAS = (5.0, 1.0, 20.0)


@functools.cache
def _compute_sdar_loss() -> Any:
    found = locate("ms-swift", ADVANTAGE_FILE, VARIABLE, f"pip install --no-deps {PIN}: pgloss reads its files")
    if isinstance(found, str):
        raise LookupError(found)
    namespace = {"torch": torch, "Tuple": tuple, "Dict": dict}
    return load(found, ("_sdar_agg_loss", "compute_sdar_loss"), namespace)["compute_sdar_loss"]


def available() -> str | None:
    """None when ms-swift's `compute_sdar_loss` can be read and run, else why not."""
    try:
        _compute_sdar_loss()
    except Exception as error:
        return f"ms-swift's SDAR loss cannot be loaded ({type(error).__name__}: {error})"
    return None


def _case(gate_beta: float, seed: int, *, empty_row: bool) -> Case:
    from ..algorithms import get

    data = batch(seed, empty_row=empty_row)
    mask, teacher = data["mask"], data["sampling"]
    theirs_leaf = data["log_prob"].clone().requires_grad_()
    theirs, _ = _compute_sdar_loss()(theirs_leaf, teacher, mask, gate_beta=gate_beta)
    theirs.backward()
    algorithm = get("grpo", policy_coef=0.0, kl_coef=0.0, sdar_coef=1.0, sdar_gate_beta=gate_beta)
    ours_leaf = data["log_prob"].clone().requires_grad_()
    ours = algorithm(ours_leaf, data["old"], data["advantages"], mask.bool(), teacher_log_prob=teacher).loss
    ours.backward()
    setting = f"sdar_gate_beta={gate_beta}" + (", an empty row" if empty_row else "")
    return Case(
        TRAINER,
        "compute_sdar_loss",
        "sdar_coef=1 (the term alone)",
        setting,
        relative(ours.detach(), theirs.detach()),
        relative(flat_grad(ours_leaf), flat_grad(theirs_leaf)),
        TOLERANCE,
    )


def cases() -> Iterator[Case]:
    """SDAR's term at three gate sharpnesses, and with an empty row (ms-swift's token mean skips it, as pgloss's)."""
    for index, gate_beta in enumerate(GATE_BETAS):
        yield _case(gate_beta, seed=400 + index, empty_row=False)
    yield _case(GATE_BETAS[0], seed=410, empty_row=True)
