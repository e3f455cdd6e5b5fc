"""The KL estimators on a sampled token and the exact KL over the vocabulary.

Nothing here imports pgloss: these are the independent references the tests compare against, written
in Python floats (float64). Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations

import math


def kl(lp: float, ref: float, estimator: str) -> float:
    d = lp - ref
    if estimator == "k1":
        return d
    if estimator == "abs":
        return abs(d)
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return math.exp(-d) + d - 1.0
    raise ValueError(estimator)


def full_kl(logits_row, ref_row, temperature=1.0):
    """Σ_v π_v (log π_v - log ρ_v) for one position."""

    def log_softmax(row):
        z = [x / temperature for x in row]
        m = max(z)
        lse = m + math.log(sum(math.exp(x - m) for x in z))
        return [x - lse for x in z]

    lp, lr = log_softmax(logits_row), log_softmax(ref_row)
    return sum(math.exp(a) * (a - b) for a, b in zip(lp, lr, strict=True))
