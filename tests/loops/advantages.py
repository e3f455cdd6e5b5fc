"""Advantage estimators: GAE, GRPO's group advantages, RLOO, REINFORCE++, OPO, GPG, pass@k, GDPO, the optimal token baseline
(single- and multi-turn), MaxRL, AsymRE, OPMD, RAE's role baseline, the Clip_B / Clip_V token masks, and the
multi-step ones (step-wise GRPO, GiGPO) and FlashREINFORCE.

Nothing here imports pgloss: these are the independent references the tests compare against, written
in Python floats (float64). Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations

import math


def gae(rewards, values, mask, *, gamma, lam):
    """A_t = δ_t + γλ A_{t+1} over the valid positions only, δ_t = r_t + γ V_next - V_t."""
    advantages = []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
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


def _groups(ids, rows=None):
    """Each group's members; with `rows` (a bool per row) only the rows flagged True (a trace with sampled
    tokens, as prime-rl's `iter_trainable_traces`): the others belong to no group and keep 0."""
    out: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        if rows is None or rows[i]:
            out.setdefault(g, []).append(i)
    return out


def _std(xs, bessel=True):
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1 if bessel else len(xs)))


def grpo(scores, ids, *, eps, singleton, scale="group", rows=None):
    out = [0.0] * len(scores)
    batch = _std([s for i, s in enumerate(scores) if rows is None or rows[i]]) if scale == "batch" else None
    for members in _groups(ids, rows).values():
        xs = [scores[i] for i in members]
        for i in members:
            if len(members) == 1:
                out[i] = scores[i] / (1 + eps) if singleton == "raw" else 0.0
                continue
            centered = scores[i] - sum(xs) / len(xs)
            out[i] = centered if scale == "none" else centered / ((batch if batch is not None else _std(xs)) + eps)
    return out


def rloo(scores, ids, rows=None):
    out = [0.0] * len(scores)
    for members in _groups(ids, rows).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            out[i] = scores[i] - sum(others) / len(others) if others else 0.0
    return out


def returns(rewards, mask, gamma):
    out = []
    for row, m in zip(rewards, mask, strict=True):
        g, r = 0.0, [0.0] * len(row)
        for t in reversed(range(len(row))):
            if m[t]:
                g = row[t] + gamma * g
                r[t] = g
        out.append(r)
    return out


def whiten(values, mask, *, bessel=True, openrlhf=False):
    xs = [v for row, m in zip(values, mask, strict=True) for v, k in zip(row, m, strict=True) if k]
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - (0 if openrlhf else 1))
    scale = 1 / math.sqrt(max(var, 1e-8)) if openrlhf else 1 / math.sqrt(var + 1e-8)
    return [
        [(v - mean) * scale if k else 0.0 for v, k in zip(row, m, strict=True)]
        for row, m in zip(values, mask, strict=True)
    ]


def opo(scores, ids, lengths):
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        b = (
            0.0
            if len(members) == 1
            else (sum(lengths[i] * scores[i] for i in members) / sum(lengths[i] for i in members))
        )
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


def tir_optimal_token_baseline(rewards, mask, ids, old_lp, spp, *, zero_tail=True, eps=1e-8):
    """The k-th generated token of each response shares a baseline with the k-th of the others."""
    G = returns(rewards, mask, 1.0)
    B, T = len(mask), len(mask[0])
    cols = [[t for t in range(T) if mask[i][t]] for i in range(B)]
    W = []
    for i in range(B):
        acc, row = 0.0, []
        for t in cols[i]:
            acc += 1 - 2 * math.exp(old_lp[i][t]) + spp[i][t]
            row.append(acc)
        W.append(row)
    adv = [[0.0] * T for _ in range(B)]
    for members in _groups(ids).values():
        members = [i for i in members if cols[i]]
        lens = sorted(len(cols[i]) for i in members)
        for i in members:
            for k, t in enumerate(cols[i]):
                if len(members) == 1:
                    b = 0.0
                else:
                    num = sum(G[j][cols[j][k]] * W[j][k] for j in members if k < len(cols[j]))
                    b = num / (sum(W[j][k] for j in members if k < len(cols[j])) + eps)
                    unique_longest = sum(1 for j in members if len(cols[j]) == lens[-1]) == 1
                    if zero_tail and unique_longest and len(cols[i]) == lens[-1] and k >= lens[-2]:
                        b = 0.0
                adv[i][t] = G[i][t] - b
    return adv


def maxrl_adv(scores, ids, *, eps=0.0, skyrl=False, rows=None):
    """(s - μ)/μ, 0 when μ ≤ 0 (paper); SkyRL: (s - μ)/(μ + ε) and a group of one keeps s."""
    out = [0.0] * len(scores)
    for members in _groups(ids, rows).values():
        mean = sum(scores[i] for i in members) / len(members)
        for i in members:
            if len(members) == 1:
                out[i] = scores[i] if skyrl else 0.0
            elif skyrl:
                out[i] = (scores[i] - mean) / (mean + eps)
            else:
                out[i] = (scores[i] - mean) / (mean + eps) if mean > 0 else 0.0
    return out


def shifted_baseline(scores, ids, baseline, *, raw_singleton=False, rows=None):
    """s - b(group's scores); a group of one: 0, or s (b = 0)."""
    out = [0.0] * len(scores)
    for members in _groups(ids, rows).values():
        xs = [scores[i] for i in members]
        for i in members:
            out[i] = (scores[i] if raw_singleton else 0.0) if len(xs) == 1 else scores[i] - baseline(xs)
    return out


def asymre_adv(scores, ids, delta, **kw):
    return shifted_baseline(scores, ids, lambda xs: sum(xs) / len(xs) + delta, **kw)


def opmd_adv(scores, ids, *, tau=None, **kw):
    if tau is None:
        return shifted_baseline(scores, ids, lambda xs: sum(xs) / len(xs), **kw)
    return shifted_baseline(scores, ids, lambda xs: tau * math.log(sum(math.exp(x / tau) for x in xs) / len(xs)), **kw)


def rae_sequential(steps, decay, num_keys, rows=None):
    """SPIRAL / prime-rl: each row scored against its key's baseline, which then moves toward its reward.
    `rows`: per step, a bool per row; a row flagged False (no sampled token) is skipped and keeps 0."""
    b = [0.0] * num_keys
    out = []
    for step, (rewards, keys) in enumerate(steps):
        adv = []
        for i, (r, k) in enumerate(zip(rewards, keys, strict=True)):
            if rows is not None and not rows[step][i]:
                adv.append(0.0)
                continue
            adv.append(r - b[k])
            b[k] = decay * b[k] + (1 - decay) * r
        out.append(adv)
    return out, b


def rae_per_step(steps, decay, num_keys, *, per_trace=True, rows=None):
    """Scored against the baseline before the step; then b ← α^n b + (1-α^n) mean (or α, once per step),
    over the rows flagged True in `rows` (per step; the others keep 0)."""
    b = [0.0] * num_keys
    out = []
    for step, (rewards, keys) in enumerate(steps):
        counted = [True] * len(rewards) if rows is None else rows[step]
        out.append([r - b[k] if ok else 0.0 for r, k, ok in zip(rewards, keys, counted, strict=True)])
        for k in range(num_keys):
            mine = [r for r, kk, ok in zip(rewards, keys, counted, strict=True) if kk == k and ok]
            if mine:
                keep = decay ** len(mine) if per_trace else decay
                b[k] = keep * b[k] + (1 - keep) * sum(mine) / len(mine)
    return out, b


def _valid_moments(values, mask):
    xs = [v for row, m in zip(values, mask, strict=True) for v, k in zip(row, m, strict=True) if k]
    mean = sum(xs) / len(xs)
    return mean, math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs))


def clipb_mask(log_prob, entropy, adv, mask, mu):
    """Keep unless Â < 0 and S - mean(S) < -μ σ(S), S = p (H + log p) over the valid tokens."""
    S = [
        [math.exp(lp) * (h + lp) for lp, h in zip(lr, hr, strict=True)]
        for lr, hr in zip(log_prob, entropy, strict=True)
    ]
    mean, std = _valid_moments(S, mask)
    return [
        [
            bool(mask[i][t]) and (std < 1e-12 or adv[i][t] >= 0 or S[i][t] - mean >= -mu * std)
            for t in range(len(mask[0]))
        ]
        for i in range(len(mask))
    ]


def clipv_mask(log_prob, entropy, necs, adv, mask, mu, max_frac, *, trinity=False):
    """Clip Â < 0 (Trinity: Â ≤ 0) where D = N - S > μσ(D); past ⌊max_frac·n⌋ clipped tokens, only the
    K negative ones with the largest D."""
    B, T = len(mask), len(mask[0])
    D = [[necs[i][t] - math.exp(log_prob[i][t]) * (entropy[i][t] + log_prob[i][t]) for t in range(T)] for i in range(B)]
    _, std = _valid_moments(D, mask)
    n = sum(sum(1 for m in row if m) for row in mask)
    if std < 1e-12:
        return [[bool(m) for m in row] for row in mask]
    out = lambda i, t: mask[i][t] and D[i][t] > mu * std  # noqa: E731
    test = {(i, t) for i in range(B) for t in range(T) if out(i, t) and (adv[i][t] <= 0 if trinity else adv[i][t] < 0)}
    negative = {(i, t) for (i, t) in test if adv[i][t] < 0}
    k = max(int(max_frac * n), 1)
    clipped = set(test)
    if len(test) / n > max_frac and len(negative) > k:
        worst = sorted(negative, key=lambda it: -D[it[0]][it[1]])[:k]
        clipped = (test - negative) | set(worst)
    return [[bool(mask[i][t]) and (i, t) not in clipped for t in range(T)] for i in range(B)]


# -- multi-step episodes: one row per step; an episode's rows in order are its steps ------------------------


def _episode_rows(episodes):
    out: dict[int, list[int]] = {}
    for i, e in enumerate(episodes):
        out.setdefault(e, []).append(i)
    return out


def _relative(xs, x, *, std, eps):
    """(x - mean) / (F + eps) within xs, F the Bessel std or 1."""
    mean = sum(xs) / len(xs)
    return (x - mean) / ((_std(xs) if std else 1.0) + eps)


def step_wise_grpo(scores, groups, episodes, *, eps=1e-6, scale="group", step_norm=False, singleton="zero"):
    """Each episode's last score R_e, normalised among its group's episodes, on each of its steps."""
    rows = _episode_rows(episodes)
    final = {e: scores[r[-1]] for e, r in rows.items()}
    group_of = {e: groups[r[0]] for e, r in rows.items()}
    everything = list(final.values())
    batch = _std(everything) if len(everything) > 1 else 1.0
    out = [0.0] * len(scores)
    for e, r in rows.items():
        mine = [final[f] for f in rows if group_of[f] == group_of[e]]
        if len(mine) == 1:
            adv = final[e] / ((1.0 if scale == "group" else batch) + eps) if singleton == "raw" else 0.0
        else:
            sigma = _std(mine) if scale == "group" else batch
            adv = (final[e] - sum(mine) / len(mine)) / (sigma + eps)
        for i in r:
            out[i] = adv / len(r) if step_norm else adv
    return out


def gigpo(
    rewards, groups, episodes, states, *, omega=1.0, gamma=1.0, fnorm="none", eps=1e-6, singleton="zero", anchored=None
):
    """A = A_E + ω A_S: A_E the episode return Σ_t r_t normalised among its group's episodes; A_S the step's
    discounted return Σ_{k≥t} γ^(k-t) r_k normalised among the anchored steps of the same state."""
    rows = _episode_rows(episodes)
    ret = {e: sum(rewards[i] for i in r) for e, r in rows.items()}
    group_of = {e: groups[r[0]] for e, r in rows.items()}
    step_return = [0.0] * len(rewards)
    for r in rows.values():
        for k, i in enumerate(r):
            step_return[i] = sum(gamma ** (j - k) * rewards[r[j]] for j in range(k, len(r)))
    out = [0.0] * len(rewards)
    for e, r in rows.items():
        mine = [ret[f] for f in rows if group_of[f] == group_of[e]]
        if len(mine) == 1:
            a_e = ret[e] / (1.0 + eps) if singleton == "raw" else 0.0
        else:
            a_e = _relative(mine, ret[e], std=fnorm == "std", eps=eps)
        for i in r:
            same = [j for j in range(len(rewards)) if states[j] == states[i] and (anchored is None or anchored[j])]
            a_s = 0.0
            if (anchored is None or anchored[i]) and len(same) > 1:
                a_s = _relative([step_return[j] for j in same], step_return[i], std=fnorm == "std", eps=eps)
            out[i] = a_e + omega * a_s
    return out


def flash_reinforce(scores, mask, *, token_rewards=None, count_empty=False):
    """s_i minus the batch's mean score on the last valid token, plus the token rewards, summed to go (γ = 1)."""
    counted = [i for i in range(len(scores)) if count_empty or any(mask[i])]
    mean = sum(scores[i] for i in counted) / len(counted)
    out = []
    for i, row in enumerate(mask):
        valid = [t for t, m in enumerate(row) if m]
        adv = [0.0] * len(row)
        for t in valid:
            later = [u for u in valid if u >= t]
            adv[t] = (scores[i] - mean) + (sum(token_rewards[i][u] for u in later) if token_rewards else 0.0)
        out.append(adv)
    return out
