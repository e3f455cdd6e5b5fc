"""One conformance case: pgloss against a trainer's own loss function on one random batch."""

from __future__ import annotations

from dataclasses import dataclass

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
