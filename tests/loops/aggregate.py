"""The aggregation modes over a step's tokens and sequences.

Nothing here imports pgloss: these are the independent references the tests compare against, written
in Python floats (float64). Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations


def lengths(mask) -> list[int]:
    return [sum(1 for m in row if m) for row in mask]


def aggregate(values, mask, mode: str, *, norm_constant=None, group_ids=None, delta_l_alpha=1.0) -> float:
    """The loss_agg_modes written as the sums of their definitions."""
    lens = lengths(mask)
    rows = [i for i, n in enumerate(lens) if n > 0]
    row_sum = [sum(v for v, m in zip(values[i], mask[i], strict=True) if m) for i in range(len(mask))]
    if mode == "token-sum":
        return sum(row_sum)
    if mode == "token-mean":
        return sum(row_sum) / max(sum(lens), 1)
    if mode == "seq-mean-token-mean":
        return sum(row_sum[i] / lens[i] for i in rows) / max(len(rows), 1)
    if mode == "seq-mean-token-sum":
        return sum(row_sum[i] for i in rows) / max(len(rows), 1)
    if mode == "seq-mean-token-sum-norm":
        return sum(row_sum[i] for i in rows) / (max(len(rows), 1) * norm_constant)
    if mode == "group-mean-token-mean":
        groups: dict[int, list[int]] = {}
        for i in rows:
            groups.setdefault(group_ids[i], []).append(i)
        per_group = [sum(row_sum[i] for i in members) / sum(lens[i] for i in members) for members in groups.values()]
        return sum(per_group) / max(len(per_group), 1)
    if mode == "delta-l-norm":
        return delta_l_norm(row_sum, lens, norm_constant, delta_l_alpha)
    raise ValueError(mode)


def delta_l_norm(row_sum, lens, budget, alpha) -> float:
    """ΔL Norm (He et al. 2025, arXiv 2509.07558, sec. 4): g = Σ_i x_i g_i over the non-empty responses,
    x_i = (1/M) · L_i^-α / Σ_j L_j^-α, g_i the token sum of response i."""
    rows = [i for i, n in enumerate(lens) if n > 0]
    total = sum(lens[j] ** -alpha for j in rows)
    return sum(row_sum[i] * (lens[i] ** -alpha) / (budget * total) for i in rows)
