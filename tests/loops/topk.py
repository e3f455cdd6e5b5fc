"""Top-k distillation at one position, written from the trainers' formulas (ANCHORS section 11, item 1) with
Python floats: the student's log-probs at the teacher's (or its own) top-k ids, the tail (kept, renormalised over
the k, or TRL's tail bucket), clamps, and the divergence over the k. Nothing here imports pgloss.

verl 0.9.1 `compute_forward_kl_topk`: D = Σ_{j ∈ top-k} p_T,j (log p_T,j − log p_S,j), log-probs clamped at >= −10,
D clamped to [0, 10]. NeMo-RL `DistillationLossFn`: forward, reverse or w·forward + (1 − w)·reverse over the
renormalised top-k; `zero_outside_topk`: the full-vocabulary log-probs and, on the reverse side,
Σ_{v ∉ top-k} p_S,v (log p_S,v + 100). ms-swift `gkd_loss` (top-k): JSD(β) of both sides log-softmaxed over the k.
TRL `_jsd_loss_chunk` / `compute_topk_self_distillation_loss`: renormalised or with a tail bucket log(1 − Σ p),
then JSD(β). GKD JSD(β) (arXiv 2306.13649, Eq. 1): β KL(p_T‖m) + (1 − β) KL(p_S‖m), m = β p_T + (1 − β) p_S.
"""

from __future__ import annotations

import math

__all__ = ["topk_divergence", "student_topk"]


def log_softmax(row, temperature=1.0):
    z = [x / temperature for x in row]
    top = max(z)
    lse = top + math.log(sum(math.exp(x - top) for x in z))
    return [x - lse for x in z]


def _renormalise(xs):
    top = max(xs)
    lse = top + math.log(sum(math.exp(x - top) for x in xs))
    return [x - lse for x in xs]


def _tail(xs):
    mass = sum(math.exp(x) for x in xs)
    log_mass = min(math.log(mass), -1e-7)  # TRL's clamp: the tail stays > 0
    return xs + [math.log(1.0 - math.exp(log_mass))]


def _kl(a, b):
    """Σ e^{a_j} (a_j − b_j) over the slots (log-probs)."""
    return sum(math.exp(x) * (x - y) for x, y in zip(a, b, strict=True))


def topk_divergence(
    student_row,
    ids,
    teacher_log_probs,
    *,
    beta,
    blend="mixture",
    tail="drop",
    log_prob_min=None,
    outside_log_prob=None,
    value_range=None,
    temperature=1.0,
):
    """D at one position: `student_row` the student's V logits, `ids` the k ids (−1: a missing slot, left out),
    `teacher_log_probs` the teacher's k values as given."""
    full = log_softmax(student_row, temperature)
    slots = [j for j, i in enumerate(ids) if i >= 0]
    if not slots:
        return 0.0
    s = [full[ids[j]] for j in slots]
    t = [teacher_log_probs[j] for j in slots]
    if tail == "renormalise":
        s, t = _renormalise(s), _renormalise(t)
    elif tail == "bucket":
        s, t = _tail(s), _tail(t)
    if log_prob_min is not None:
        s, t = [max(x, log_prob_min) for x in s], [max(x, log_prob_min) for x in t]
    forward, reverse = _kl(t, s), _kl(s, t)
    if blend == "sum" or beta in (0.0, 1.0):
        value = (1.0 - beta) * forward + beta * reverse
    else:
        m = [math.log(beta * math.exp(y) + (1.0 - beta) * math.exp(x)) for x, y in zip(s, t, strict=True)]
        value = beta * _kl(t, m) + (1.0 - beta) * _kl(s, m)
    if outside_log_prob is not None:
        chosen = {ids[j] for j in slots}
        rest = [v for v in range(len(student_row)) if v not in chosen]
        value += beta * sum(math.exp(full[v]) * (full[v] - outside_log_prob) for v in rest)
    if value_range is not None:
        value = min(max(value, value_range[0]), value_range[1])
    return value


def student_topk(student_row, teacher_row, k, temperature=1.0):
    """The student's k largest logits' ids and the teacher's full-vocabulary log-probs there (TRL SDPO's support)."""
    ids = sorted(range(len(student_row)), key=lambda v: -student_row[v])[:k]
    teacher = log_softmax(teacher_row, temperature)
    return ids, [teacher[i] for i in ids]
