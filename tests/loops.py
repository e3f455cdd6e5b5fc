"""Plain loop implementations written from the papers' formulas, in Python floats (float64).

Nothing here imports pgloss: these are the independent references the tests compare against.
Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations

import math


def clip(x: float, low: float | None, high: float | None) -> float:
    if low is not None:
        x = max(x, low)
    if high is not None:
        x = min(x, high)
    return x


def ppo_token(r: float, a: float, *, clip_low: float, clip_high: float, dual_clip=None, delta=None) -> float:
    """max(-A r, -A clip(r)); dual clip min(., -cA) for A < 0; δ caps r in the first branch."""
    r1 = r if delta is None else min(r, delta)
    loss = max(-a * r1, -a * clip(r, 1 - clip_low, 1 + clip_high))
    if dual_clip is not None and a < 0:
        loss = min(loss, -a * dual_clip)
    return loss


def lengths(mask) -> list[int]:
    return [sum(1 for m in row if m) for row in mask]


def aggregate(values, mask, mode: str, *, norm_constant=None, group_ids=None) -> float:
    """The five loss_agg_modes written as the sums of their definitions."""
    lens = lengths(mask)
    rows = [i for i, n in enumerate(lens) if n > 0]
    row_sum = [sum(v for v, m in zip(values[i], mask[i]) if m) for i in range(len(mask))]
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
    raise ValueError(mode)


def seq_log_ratio(lp_row, old_row, mask_row, *, normalized: bool) -> float:
    total = sum(a - b for a, b, m in zip(lp_row, old_row, mask_row) if m)
    n = sum(1 for m in mask_row if m)
    return total / max(n, 1) if normalized else total


def clipped_policy_per_token(lp, old, adv, mask, *, level: str, clip_low, clip_high, dual_clip=None, delta=None,
                             max_log_ratio=20.0):
    """ℓ_{i,t} for the clipped family; adv[i][t]. Sequence levels copy ℓ_i onto every token."""
    out = []
    for i in range(len(lp)):
        row = []
        if level == "token":
            for t in range(len(lp[i])):
                r = math.exp(clip(lp[i][t] - old[i][t], -max_log_ratio, max_log_ratio))
                row.append(ppo_token(r, adv[i][t], clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta))
        else:
            s = math.exp(clip(seq_log_ratio(lp[i], old[i], mask[i], normalized=level != "sequence_product"),
                              -max_log_ratio, max_log_ratio))
            row = [ppo_token(s, adv[i][t], clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta)
                   for t in range(len(lp[i]))]
        out.append(row)
    return out


def cispo_per_token(lp, old, adv, *, clip_low, clip_high):
    out = []
    for i in range(len(lp)):
        row = []
        for t in range(len(lp[i])):
            r = math.exp(lp[i][t] - old[i][t])
            w = clip(r, None if clip_low is None else 1 - clip_low, 1 + clip_high)
            row.append(-w * adv[i][t] * lp[i][t])
        out.append(row)
    return out


def sapo_per_token(lp, old, adv, *, tau_pos, tau_neg):
    out = []
    for i in range(len(lp)):
        row = []
        for t in range(len(lp[i])):
            r = math.exp(lp[i][t] - old[i][t])
            tau = tau_pos if adv[i][t] > 0 else tau_neg
            gate = 4.0 / tau / (1.0 + math.exp(-tau * (r - 1.0)))
            row.append(-gate * adv[i][t])
        out.append(row)
    return out


def fipo_weights(lp, old, adv, mask, *, decay_rate, clip_range, clip_high_only, safety_threshold, delta):
    """f_{i,t} = clip(exp(Σ_{k≥t} γ^{k-t} m_k Δ_k)), with the δ filter and the safety rule."""
    gamma = 2.0 ** (-1.0 / decay_rate)
    out = []
    for i in range(len(lp)):
        T = len(lp[i])
        shift = []
        for k in range(T):
            d = lp[i][k] - old[i][k]
            keep = mask[i][k] and not (delta is not None and math.exp(d) > delta)
            shift.append(d if keep else 0.0)
        row = []
        for t in range(T):
            if not mask[i][t]:
                row.append(1.0)
                continue
            future = sum(gamma ** (k - t) * shift[k] for k in range(t, T))
            f = math.exp(future)
            if clip_range is not None:  # None: no clipping
                f = clip(f, 1.0 if clip_high_only else 1.0 - clip_range, 1.0 + clip_range)
            r = math.exp(lp[i][t] - old[i][t])
            if safety_threshold is not None and adv[i][t] < 0 and r > safety_threshold:
                f = clip(f, 1.0 - (0.2 if clip_range is None else clip_range), 1.0)  # ms-swift's [0.8, 1]
            row.append(f)
        out.append(row)
    return out


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
