"""The skewed KL divergences of DistiLLM and the adaptive KL (AKL) of distillation over the vocabulary, at one
position, in Python floats from the papers; nothing here imports pgloss.

DistiLLM (Ko et al., arXiv 2402.03898, Eq. 3 and 4), p the teacher, q the student, skew α:
    SKL(α)  = KL(p‖αp + (1 − α)q),     SRKL(α) = KL(q‖(1 − α)p + αq).
AKL (Wu et al., arXiv 2404.02657, Section 4): the teacher's tokens sorted by probability, descending; the head M is
the shortest prefix whose mass reaches μ, the tail the rest; g_head = Σ_{M} |p − q|, g_tail = Σ_{not M} |p − q|;
    AKL = g_head / (g_head + g_tail) · KL(p‖q) + g_tail / (g_head + g_tail) · KL(q‖p),
the two weights constants of the gradient.
"""

from __future__ import annotations

import math

from .divergence import _kl, _softmax


def skewed_kl(student_row, teacher_row, skew, reverse=False, temperature=1.0):
    """SKL(λ) = KL(p_T‖λ p_T + (1 − λ) p_S), or SRKL(λ) = KL(p_S‖λ p_S + (1 − λ) p_T) with `reverse`."""
    q, p = _softmax(student_row, temperature), _softmax(teacher_row, temperature)
    first, second = (q, p) if reverse else (p, q)
    return _kl(first, [skew * a + (1 - skew) * b for a, b in zip(first, second, strict=True)])


def skewed_kl_grad(student_row, teacher_row, skew, reverse=False, temperature=1.0):
    """∂/∂(student logits), by the chain rule: ∂D/∂q_v = g_v, ∂D/∂z_v = (1/τ) q_v (g_v − Σ_u q_u g_u), with
    g = −(1 − λ) p/m (forward) or log(q/m) + 1 − λ q/m (reverse)."""
    q, p = _softmax(student_row, temperature), _softmax(teacher_row, temperature)
    if reverse:
        m = [skew * b + (1 - skew) * a for a, b in zip(p, q, strict=True)]
        g = [math.log(b / c) + 1 - skew * b / c for b, c in zip(q, m, strict=True)]
    else:
        m = [skew * a + (1 - skew) * b for a, b in zip(p, q, strict=True)]
        g = [-(1 - skew) * a / c for a, c in zip(p, m, strict=True)]
    mean = sum(b * x for b, x in zip(q, g, strict=True))
    return [b * (x - mean) / temperature for b, x in zip(q, g, strict=True)]


def akl_weights(student_row, teacher_row, mu, temperature=1.0):
    """(w_head, w_tail) of AKL: the head the teacher's top tokens up to the first whose cumulative mass reaches μ."""
    q, p = _softmax(student_row, temperature), _softmax(teacher_row, temperature)
    order = sorted(range(len(p)), key=lambda v: -p[v])
    head, mass = set(), 0.0
    for v in order:
        if mass >= mu:
            break
        head.add(v)
        mass += p[v]
    g_head = sum(abs(p[v] - q[v]) for v in head)
    g_tail = sum(abs(p[v] - q[v]) for v in range(len(p)) if v not in head)
    if g_head + g_tail == 0:
        return 0.0, 0.0
    return g_head / (g_head + g_tail), g_tail / (g_head + g_tail)


def akl(student_row, teacher_row, mu, temperature=1.0, weights=None):
    """AKL at one position; `weights` (w_head, w_tail) held fixed when given (the gradient's constants)."""
    q, p = _softmax(student_row, temperature), _softmax(teacher_row, temperature)
    w_head, w_tail = akl_weights(student_row, teacher_row, mu, temperature) if weights is None else weights
    return w_head * _kl(p, q) + w_tail * _kl(q, p)


def akl_grad(student_row, teacher_row, mu, temperature=1.0):
    """∂AKL/∂(student logits) with the weights constant: w_head (q − p)/τ + w_tail q (log(q/p) − KL(q‖p))/τ."""
    q, p = _softmax(student_row, temperature), _softmax(teacher_row, temperature)
    w_head, w_tail = akl_weights(student_row, teacher_row, mu, temperature)
    reverse = _kl(q, p)
    return [
        (w_head * (b - a) + w_tail * b * (math.log(b / a) - reverse)) / temperature for a, b in zip(p, q, strict=True)
    ]
