"""Advantage estimators: GAE, GRPO's group advantages, RLOO, REINFORCE++, OPO, GPG, pass@k, GDPO, the optimal token baseline.

Nothing here imports pgloss: these are the independent references the tests compare against, written
in Python floats (float64). Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations

import math


def gae(rewards, values, mask, *, gamma, lam):
    """A_t = δ_t + γλ A_{t+1} over the valid positions only, δ_t = r_t + γ V_next - V_t."""
    advantages = []
    for r_row, v_row, m_row in zip(rewards, values, mask):
        valid = [t for t, m in enumerate(m_row) if m]
        adv = [0.0] * len(r_row)
        last, next_v = 0.0, 0.0
        for t in reversed(valid):
            delta = r_row[t] + gamma * next_v - v_row[t]
            last = delta + gamma * lam * last
            adv[t] = last
            next_v = v_row[t]
        advantages.append(adv)
    return advantages


def group_advantages(scores, group_ids, *, scale: bool, eps: float):
    out = []
    for i, s in enumerate(scores):
        members = [scores[j] for j in range(len(scores)) if group_ids[j] == group_ids[i]]
        n = len(members)
        mean = sum(members) / n
        if n == 1:
            out.append(0.0)
            continue
        std = math.sqrt(sum((x - mean) ** 2 for x in members) / (n - 1))
        out.append((s - mean) / (std + eps) if scale else s - mean)
    return out


def _groups(ids):
    out: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        out.setdefault(g, []).append(i)
    return out


def _std(xs, bessel=True):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1 if bessel else len(xs)))


def grpo(scores, ids, *, eps, singleton, scale="group"):
    out = [0.0] * len(scores)
    batch = _std(scores) if scale == "batch" else None
    for members in _groups(ids).values():
        xs = [scores[i] for i in members]
        for i in members:
            if len(members) == 1:
                out[i] = scores[i] / (1 + eps) if singleton == "raw" else 0.0
                continue
            centered = scores[i] - sum(xs) / len(xs)
            out[i] = centered if scale == "none" else centered / ((batch if batch is not None else _std(xs)) + eps)
    return out


def rloo(scores, ids):
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            out[i] = scores[i] - sum(others) / len(others) if others else 0.0
    return out


def returns(rewards, mask, gamma):
    out = []
    for row, m in zip(rewards, mask):
        g, r = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            if m[t]:
                g = row[t] + gamma * g
                r[t] = g
        out.append(r)
    return out


def whiten(values, mask, *, bessel=True, openrlhf=False):
    xs = [v for row, m in zip(values, mask) for v, k in zip(row, m) if k]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - (0 if openrlhf else 1))
    scale = 1 / math.sqrt(max(var, 1e-8)) if openrlhf else 1 / math.sqrt(var + 1e-8)
    return [[(v - mean) * scale if k else 0.0 for v, k in zip(row, m)] for row, m in zip(values, mask)]


def opo(scores, ids, lengths):
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        b = 0.0 if len(members) == 1 else (sum(lengths[i] * scores[i] for i in members) /
                                           sum(lengths[i] for i in members))
        for i in members:
            out[i] = scores[i] - b
    return out


def gpg_advantages(scores, ids, f_norm=1.0):
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        mean = 0.0 if len(members) == 1 else sum(scores[i] for i in members) / len(members)
        for i in members:
            out[i] = alpha * (scores[i] - mean) / f_norm
    return out


def passk(scores, ids, *, scale, eps=1e-6):
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        xs = [scores[i] for i in members]
        best = members[xs.index(max(xs))]
        second = max(scores[i] for i in members if i != best)
        adv = scores[best] - second
        out[best] = adv / (_std(xs) + eps) if scale else adv
    return out


def gdpo_trl(scores, ids, weights):
    k = len(scores[0])
    cols = [grpo([row[j] for row in scores], ids, eps=1e-4, singleton="zero") for j in range(k)]
    total = [sum(weights[j] * cols[j][i] for j in range(k)) for i in range(len(scores))]
    mean = sum(total) / len(total)
    return [(x - mean) / (_std(total) + 1e-4) for x in total]


# -- token masks -------------------------------------------------------------------------------


def optimal_token_baseline(rewards, mask, ids, old_lp, spp, *, zero_tail=True, eps=1e-8):
    G = returns(rewards, mask, 1.0)
    B, T = len(mask), len(mask[0])
    W = []
    for i in range(B):
        acc, row = 0.0, []
        for t in range(T):
            if mask[i][t]:
                acc += 1 - 2 * math.exp(old_lp[i][t]) + spp[i][t]
            row.append(acc)
        W.append(row)
    base = [[0.0] * T for _ in range(B)]
    for members in _groups(ids).values():
        if len(members) == 1:
            continue
        for t in range(T):
            num = sum(G[i][t] * W[i][t] for i in members if mask[i][t])
            den = sum(W[i][t] for i in members if mask[i][t]) + eps
            for i in members:
                base[i][t] = num / den
        lens = sorted(sum(mask[i]) for i in members)
        longest = [i for i in members if sum(mask[i]) == lens[-1]]
        if zero_tail and len(longest) == 1 and lens[-1] > lens[-2]:
            for t in range(lens[-2], T):
                base[longest[0]][t] = 0.0
    return [[G[i][t] - base[i][t] if mask[i][t] else 0.0 for t in range(T)] for i in range(B)], G
