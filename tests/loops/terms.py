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


def adaptive_entropy(step_entropies, *, coef, target, delta, coef_min, coef_max):
    """Skywork-OR1's adaptive entropy control (He et al. 2025, arXiv 2505.22312, sec. 3.2.2) as TRL 1.16's
    `use_adaptive_entropy`: per optimizer step, the coefficient applied (c while the previous step's entropy
    was ≤ target, 0 before the first step and above it), then c ± δ clipped to [c_min, c_max].
    `step_entropies[k]` is the list of (Σ H·m, Σ m) of step k's micro-batches over every rank.
    Returns [(applied, coefficient after the step, step entropy)]."""
    out, last = [], float("inf")
    for windows in step_entropies:
        applied = coef if last <= target else 0.0
        total = sum(s for s, _ in windows)
        count = sum(n for _, n in windows)
        entropy = total / max(count, 1.0)
        coef = min(coef + delta, coef_max) if entropy <= target else max(coef - delta, coef_min)
        last = entropy
        out.append((applied, coef, entropy))
    return out
