"""The closed form of a family's gradient per token, which `pgloss.diagnostics.inspect` reads.

A family with a closed form gives its policy term's gradient with respect to log π_θ(y_{i,t}) as

    g_{i,t} = -Â_{i,t} · f_{i,t} · w_{i,t}

(w the aggregation weight, `aggregate.token_weights`) by a method `gradient_factor(batch)` beside
its per-token function, returning a `GradientFactor` with f. A family without one has no such
method (or returns `factor=None` with the reason, e.g. for advantages it cannot express), and
`inspect` gives autograd's gradient alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class GradientFactor:
    """f of g = -Â·f·w for a batch, or None with the reason there is none."""

    factor: Tensor | None
    """f_{i,t}, `[B, T]`, computed on the call's (corrected) batch; None: no closed form for it."""
    reason: str
    """Which closed form applies (its formula), or why there is none."""
    per_sequence: bool = False
    """True when one ratio is shared by the whole sequence (GSPO, the sample-level loss): a rollout
    correction's token weights then enter f as their mean over the sequence, since the sequence's
    loss ℓ_i is weighted token by token and summed."""
