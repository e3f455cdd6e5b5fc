"""An algorithm's loss from hidden states (`loss_from_hidden`, which `Algorithm.from_hidden` calls): the driver of
the vocabulary loop of `pgloss.vocab`, one floor up, beside the `Algorithm` it drives. A call resolves its plan
once (`LossPlan`: the loop's backend and tiles, one pass or recompute) and hands it down; `one_pass.py` forms the
loss's gradients while its logits are at hand."""

from .loss import PASSED_INPUTS, LossPlan, loss_from_hidden, plan_call
from .one_pass import AttachGradients, FusedAlgorithm, OnePass, loss_one_pass

__all__ = [
    "loss_from_hidden",
    "LossPlan",
    "plan_call",
    "PASSED_INPUTS",
    "FusedAlgorithm",
    "AttachGradients",
    "OnePass",
    "loss_one_pass",
]
