"""REC, OPMD, sPPO (Trinity-RFT 0.6.0 and their papers) and GVPO (arXiv 2504.19599, verl-recipe), from the formulas.

Nothing here imports pgloss. Inputs are nested lists (float64 Python floats), `mask[i][t]` a bool,
`adv[i][t]` per token. Per-token functions return [B][T] lists; the group losses return the step's loss.
"""

from __future__ import annotations

import math


def rec(lp, old, adv, mask, *, mode, weight, eps_low=0.2, eps_high=0.2, ring_low=0.6, ring_high=2.0, temp=1.0):
    """-w·A·log π·M per token (arXiv 2509.24203; Trinity rec_policy_loss.py)."""
    out = []
    for i in range(len(lp)):
        valid = [t for t in range(len(lp[i])) if mask[i][t]]
        s = math.exp(sum(lp[i][t] - old[i][t] for t in valid) / len(valid)) if valid else 1.0
        row = []
        for t in range(len(lp[i])):
            r, a = math.exp(lp[i][t] - old[i][t]), adv[i][t]
            inside = 1 - eps_low <= r <= 1 + eps_high
            if mode == "one-side":
                keep = (a >= 0 and r <= 1 + eps_high) or (a <= 0 and r >= 1 - eps_low)
            elif mode == "two-side":
                keep = inside
            elif mode == "ring":
                keep = inside or (a >= 0 and r <= 1 - ring_low) or (a <= 0 and r >= 1 + ring_high)
            else:
                keep = True
            w = {"none": 1.0, "importance_sampling": r, "sequence_importance_sampling": s,
                 "advantage": math.exp(a / temp)}[weight]
            row.append(-w * a * lp[i][t] if keep else 0.0)
        out.append(row)
    return out


def opmd(lp, adv, *, tau=1.0):
    """-A·log π/(1 + τ) per token (Trinity opmd_policy_loss.py)."""
    return [[-a * x / (1 + tau) for x, a in zip(lp_row, adv_row)] for lp_row, adv_row in zip(lp, adv)]


def sppo(lp, old, adv, *, epsilon=0.3):
    """-A·(log π - log π_old)·1[1/(1+ε) ≤ r ≤ 1+ε] per token (Trinity sppo_loss_fn.py)."""
    out = []
    for i in range(len(lp)):
        row = []
        for t in range(len(lp[i])):
            d = lp[i][t] - old[i][t]
            row.append(-adv[i][t] * d if 1 / (1 + epsilon) <= math.exp(d) <= 1 + epsilon else 0.0)
        out.append(row)
    return out


def gvpo(lp, old, adv, mask, group_ids, *, beta=0.1, center=True):
    """mean over groups of L_g = Σ_{i∈g} ½((R_θ,i - R̄_θ) - (Â_i - Ā))² / (k - 1), R_θ,i = β Σ_t (log π - log π_old)."""
    groups = {}
    for i in range(len(lp)):
        valid = [t for t in range(len(lp[i])) if mask[i][t]]
        if not valid:
            continue
        r_theta = beta * sum(lp[i][t] - old[i][t] for t in valid)
        a = sum(adv[i][t] for t in valid) / len(valid)
        groups.setdefault(group_ids[i], []).append((r_theta, a))
    total = 0.0
    for members in groups.values():
        k = len(members)
        if k < 2:
            continue
        mean_r = sum(r for r, _ in members) / k
        mean_a = sum(a for _, a in members) / k if center else 0.0
        total += sum(0.5 * ((r - mean_r) - (a - mean_a)) ** 2 for r, a in members) / (k - 1)
    return total / max(len(groups), 1)
