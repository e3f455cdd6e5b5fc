"""The terms an objective adds to its family's policy term, one file each (`term.py` says what a term declares).

`Options` gathers their fields, which every algorithm carries; `TermOptions.terms` builds the configured terms in
the order the loss adds them. A new term is its file, a line in each of the two below, and its docs row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

from . import distillation, entropy_bonus, kl_penalty, positive_nll, sdar, self_distillation
from .term import Term, TermValue

T = TypeVar("T", bound="TermOptions")

OPTIONS = (
    kl_penalty.Options,
    entropy_bonus.Options,
    positive_nll.Options,
    distillation.Options,
    self_distillation.Options,
    sdar.Options,
)
"""Each term's fields, in the order the loss adds the terms."""


@dataclass(frozen=True, kw_only=True)
class TermOptions(
    sdar.Options,
    self_distillation.Options,
    distillation.Options,
    positive_nll.Options,
    entropy_bonus.Options,
    kl_penalty.Options,
):
    """The fields of every declared term."""

    def terms(self, max_log_ratio: float) -> tuple[Term, ...]:
        """The configured terms (their checks run as they are built), in the order of `OPTIONS`."""
        return (
            self.kl_penalty(max_log_ratio),
            self.entropy_bonus(),
            self.positive_nll(),
            self.distillation(max_log_ratio),
            self.self_distillation(max_log_ratio),
            self.sdar(),
        )

    def policy_only(self: T) -> T:
        """This configuration with every declared term off (their coefficients 0): its policy term alone."""
        on: dict[str, Any] = {options.coef_field: 0.0 for options in OPTIONS if getattr(self, options.coef_field) != 0}
        return dataclasses.replace(self, **on) if on else self


__all__ = ["Term", "TermOptions", "TermValue"]
