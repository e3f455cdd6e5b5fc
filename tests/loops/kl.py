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
    return sum(math.exp(a) * (a - b) for a, b in zip(lp, lr))


def divergence(student_row, teacher_row, beta, temperature=1.0):
    """A student's divergence from a teacher at one position (GKD, arXiv 2306.13649, eq. 1, as TRL):
    β = 0 KL(p_T‖p_S), β = 1 KL(p_S‖p_T), else β·KL(p_T‖m) + (1 − β)·KL(p_S‖m), m = (1 − β)p_S + βp_T."""
    def softmax(row):
        z = [x / temperature for x in row]
        m = max(z)
        e = [math.exp(x - m) for x in z]
        return [x / sum(e) for x in e]

    def kl_of(p, q):
        return sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)

    p, q = softmax(student_row), softmax(teacher_row)
    if beta == 0:
        return kl_of(q, p)
    if beta == 1:
        return kl_of(p, q)
    mix = [(1 - beta) * a + beta * b for a, b in zip(p, q)]
    return beta * kl_of(q, mix) + (1 - beta) * kl_of(p, mix)
