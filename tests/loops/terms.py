"""Terms added beside the policy loss, written from their papers in Python floats (float64).

Nothing here imports pgloss. Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations


def positive_nll(log_prob, mask, scores) -> float:
    """VAPO's positive-example language-model loss (Yue et al. 2025, arXiv 2504.05118, eq. 10):
    L_NLL = -(1 / Σ_{o_i∈T} |o_i|) Σ_{o_i∈T} Σ_t log π(a_t|s_t), T the correct answers (reward > 0, as
    NeMo-RL's `ClippedPGLossFn`); 0 when T holds no token."""
    total, count = 0.0, 0
    for row, row_mask, score in zip(log_prob, mask, scores):
        if score > 0:
            for value, valid in zip(row, row_mask):
                if valid:
                    total -= value
                    count += 1
    return total / count if count else 0.0
