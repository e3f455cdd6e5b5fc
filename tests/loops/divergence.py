"""The student-teacher divergences of distillation over the vocabulary, at one position.

GKD (Agarwal et al., arXiv 2306.13649, Eq. 1): D_JSD(β)(P‖Q) = β KL(P‖M) + (1 − β) KL(Q‖M) with
M = βP + (1 − β)Q, P the teacher, Q the student. β = 0 is the forward KL(P‖Q) and β = 1 the reverse
KL(Q‖P) (the limits of JSD(β)/β and JSD(β)/(1 − β)). Nothing here imports pgloss: Python floats, rows
of logits as lists.
"""

from __future__ import annotations

import math


def _softmax(row, temperature):
    z = [x / temperature for x in row]
    top = max(z)
    total = sum(math.exp(x - top) for x in z)
    return [math.exp(x - top) / total for x in z]


def _kl(p, q):
    """Σ_v p_v log(p_v / q_v), with 0 log 0 = 0."""
    return sum(a * math.log(a / b) for a, b in zip(p, q, strict=True) if a > 0)


def divergence(student_row, teacher_row, beta, temperature=1.0):
    """D_β(p_T, p_S) for one position: KL(p_T‖p_S) at β = 0, KL(p_S‖p_T) at β = 1, JSD(β) between."""
    q, p = _softmax(student_row, temperature), _softmax(teacher_row, temperature)
    if beta == 0:
        return _kl(p, q)
    if beta == 1:
        return _kl(q, p)
    m = [beta * a + (1 - beta) * b for a, b in zip(p, q, strict=True)]
    return beta * _kl(p, m) + (1 - beta) * _kl(q, m)


def divergence_grad(student_row, teacher_row, beta, temperature=1.0):
    """∂D_β/∂(student logits) at one position, by the chain rule through the student's softmax:
    ∂D/∂q_v = g_v, then ∂D/∂z_v = (1/τ) q_v (g_v − Σ_u q_u g_u), with
    g = −p/q (β = 0), log(q/p) + 1 (β = 1), (1 − β) log(q/m) (0 < β < 1: the terms of m cancel)."""
    q, p = _softmax(student_row, temperature), _softmax(teacher_row, temperature)
    if beta == 0:
        g = [-a / b for a, b in zip(p, q, strict=True)]
    elif beta == 1:
        g = [math.log(b / a) + 1 for a, b in zip(p, q, strict=True)]
    else:
        g = [(1 - beta) * math.log(b / (beta * a + (1 - beta) * b)) for a, b in zip(p, q, strict=True)]
    mean = sum(b * x for b, x in zip(q, g, strict=True))
    return [b * (x - mean) / temperature for b, x in zip(q, g, strict=True)]


def head_logits(hidden_row, weight_rows, bias=None, scale=1.0, softcap=None):
    """An LM head's logits at one position before the temperature: c·tanh(s·(Wx + b)/c), s·(Wx + b)
    without a soft-cap c (TRL 1.16's order: bias, scale, soft-cap)."""
    raw = [
        sum(w * x for w, x in zip(row, hidden_row, strict=True)) + (0.0 if bias is None else bias[v])
        for v, row in enumerate(weight_rows)
    ]
    if softcap is None:
        return [scale * r for r in raw]
    return [softcap * math.tanh(scale * r / softcap) for r in raw]


def head_slope(hidden_row, weight_rows, bias=None, scale=1.0, softcap=None):
    """∂logits_v/∂(Wx + b)_v of `head_logits`: s·(1 − tanh²(s·(Wx + b)_v/c)), s without a soft-cap."""
    if softcap is None:
        return [scale] * len(weight_rows)
    capped = head_logits(hidden_row, weight_rows, bias, scale, softcap)
    return [scale * (1 - (z / softcap) ** 2) for z in capped]
