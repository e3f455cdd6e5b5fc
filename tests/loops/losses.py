"""The per-token terms of every family, from the papers' and the frameworks' formulas.

Nothing here imports pgloss: these are the independent references the tests compare against, written
in Python floats (float64). Inputs are nested lists; `mask[i][t]` is a bool.
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


def seq_log_ratio(lp_row, old_row, mask_row, *, normalized: bool) -> float:
    total = sum(a - b for a, b, m in zip(lp_row, old_row, mask_row, strict=True) if m)
    n = sum(1 for m in mask_row if m)
    return total / max(n, 1) if normalized else total


def clipped_policy_per_token(
    lp, old, adv, mask, *, level: str, clip_low, clip_high, dual_clip=None, delta=None, max_log_ratio=20.0
):
    """ℓ_{i,t} for the clipped family; adv[i][t]. Sequence levels copy ℓ_i onto every token."""
    out = []
    for i in range(len(lp)):
        row = []
        if level == "token":
            for t in range(len(lp[i])):
                r = math.exp(clip(lp[i][t] - old[i][t], -max_log_ratio, max_log_ratio))
                row.append(
                    ppo_token(r, adv[i][t], clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta)
                )
        else:
            s = math.exp(
                clip(
                    seq_log_ratio(lp[i], old[i], mask[i], normalized=level != "sequence_product"),
                    -max_log_ratio,
                    max_log_ratio,
                )
            )
            row = [
                ppo_token(s, adv[i][t], clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, delta=delta)
                for t in range(len(lp[i]))
            ]
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


def sign(x):
    return (x > 0) - (x < 0)


def gmpo(lp, old, adv, mask, *, clip_low, clip_high, max_log_ratio=20.0):
    """L_i = -Â_i · exp(mean_t δ*_t) on every token of row i; δ* the one-sided log-space clip."""
    out = []
    for i in range(len(lp)):
        valid = [t for t in range(len(lp[i])) if mask[i][t]]
        n = max(len(valid), 1)
        total = 0.0
        for t in valid:
            d = lp[i][t] - old[i][t]
            s = sign(adv[i][t])
            if s > 0:
                d_star = min(d, clip_high)
            elif s < 0:
                d_star = max(d, -clip_low)
            else:
                d_star = 0.0
            total += d_star
        rho = math.exp(clip(total / n, -max_log_ratio, max_log_ratio))
        a_hat = sum(adv[i][t] for t in valid) / n
        out.append([-a_hat * rho if mask[i][t] else 0.0 for t in range(len(lp[i]))])
    return out


def covariance(lp, adv, mask):
    cells = [(i, t) for i in range(len(lp)) for t in range(len(lp[i])) if mask[i][t]]
    n = max(len(cells), 1)
    mean_a = sum(adv[i][t] for i, t in cells) / n
    mean_lp = sum(lp[i][t] for i, t in cells) / n
    return {(i, t): (adv[i][t] - mean_a) * (lp[i][t] - mean_lp) for i, t in cells}


def clip_cov(lp, old, adv, mask, *, clip_low, clip_high, ratio, lb, ub, draw):
    """verl's Clip-Cov; `draw(cells)` returns the candidate cells in a random order (the random step, injected)."""
    cov = covariance(lp, adv, mask)
    n_valid = len(cov)
    candidates = []
    base = {}
    for i in range(len(lp)):
        for t in range(len(lp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(lp[i][t] - old[i][t])
            l1 = -adv[i][t] * r
            l2 = -adv[i][t] * clip(r, 1 - clip_low, 1 + clip_high)
            base[i, t] = max(l1, l2)
            if not l2 > l1 and lb < cov[i, t] < ub:
                candidates.append((i, t))  # row-major order
    k = max(int(ratio * n_valid), 1)
    picked = set(draw(candidates)[:k])
    return [
        [0.0 if (i, t) in picked or not mask[i][t] else base[i, t] for t in range(len(lp[i]))] for i in range(len(lp))
    ], picked


def kl_cov(lp, old, adv, mask, *, ratio, kl_coef):
    cov = covariance(lp, adv, mask)
    k = max(int(ratio * len(cov)), 1)
    top = set(sorted(cov, key=lambda c: -cov[c])[:k])
    out = []
    for i in range(len(lp)):
        row = []
        for t in range(len(lp[i])):
            d = lp[i][t] - old[i][t]
            value = -adv[i][t] * math.exp(d) + (kl_coef * abs(d) if (i, t) in top else 0.0)
            row.append(value if mask[i][t] else 0.0)
        out.append(row)
    return out, top


def per_token(fn, lp, old, adv, mask):
    return [
        [fn(lp[i][t], old[i][t], adv[i][t], i) if mask[i][t] else 0.0 for t in range(len(lp[i]))]
        for i in range(len(lp))
    ]


def gpg(lp, old, adv, mask):
    return per_token(lambda p, o, a, i: -a * p, lp, old, adv, mask)


def tis_pg(lp, old, adv, mask, *, low, high):
    return per_token(lambda p, o, a, i: -clip(math.exp(p - o), low, high) * a * p, lp, old, adv, mask)


def topr(lp, old, adv, mask, scores, *, low, high):
    def f(p, o, a, i):
        w = 1.0 if scores[i] > 0 else clip(math.exp(p - o), low, high)
        return -w * a * p

    return per_token(f, lp, old, adv, mask)


def dppo(lp, old, adv, mask, *, divergence, clip_low, clip_high, truncation):
    def f(p_log, o_log, a, i):
        p, q = math.exp(p_log), math.exp(o_log)
        if divergence == "tv":
            valid = p - q <= clip_high if a > 0 else p - q >= -clip_low
        else:
            d = q * (o_log - p_log) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
            valid = (d <= clip_high or p <= q) if a > 0 else (d <= clip_low or p >= q)
        w = min(math.exp(clip(p_log - o_log, -20, 20)), truncation)
        return -a * w * p_log if valid else 0.0

    return per_token(f, lp, old, adv, mask)


def dro(lp, old, adv, mask, *, beta):
    return per_token(lambda p, o, a, i: -a * p + 0.5 * beta * (p - o) ** 2, lp, old, adv, mask)


def vespo(lp, old, adv, mask, *, k_pos, lambda_pos, k_neg, lambda_neg):
    out = []
    for i in range(len(lp)):
        s = sum(clip(lp[i][t] - old[i][t], -20, 20) for t in range(len(lp[i])) if mask[i][t])
        log_w = clip(s, math.log(1e-8), 20.0)
        row = []
        for t in range(len(lp[i])):
            if not mask[i][t]:
                row.append(0.0)
                continue
            k, lam = (k_pos, lambda_pos) if adv[i][t] >= 0 else (k_neg, lambda_neg)
            phi = math.exp(lam) * math.exp(log_w) ** k * math.exp(-lam * math.exp(log_w))
            row.append(-phi * adv[i][t] * lp[i][t])
        out.append(row)
    return out


def luspo_loss(lp, old, adv, mask, *, clip_low, clip_high):
    """mean over non-empty rows of Σ_t ℓ_it, ℓ = -min(s·A, clip(s)·A), s the GSPO sequence ratio."""
    rows = []
    for i in range(len(lp)):
        valid = [t for t in range(len(lp[i])) if mask[i][t]]
        if not valid:
            continue
        s = math.exp(sum(lp[i][t] - old[i][t] for t in valid) / len(valid))
        rows.append(sum(-min(s * adv[i][t], clip(s, 1 - clip_low, 1 + clip_high) * adv[i][t]) for t in valid))
    return sum(rows) / max(len(rows), 1)


def ce_gppo(lp, old, adv, mask, *, clip_low, clip_high, beta_low, beta_high, dual_clip):
    """Values and the per-token gradient d L / d log π (the r/sg[r] factor has value 1, gradient 1)."""
    values, grads = [], []
    for i in range(len(lp)):
        vr, gr = [], []
        for t in range(len(lp[i])):
            a, r = adv[i][t], math.exp(lp[i][t] - old[i][t])
            if not mask[i][t]:
                vr.append(0.0)
                gr.append(0.0)
                continue
            if a < 0 and r < 1 - clip_low:
                v, g = -beta_low * (1 - clip_low) * a, -beta_low * (1 - clip_low) * a
            elif a > 0 and r > 1 + clip_high:
                v, g = -beta_high * (1 + clip_high) * a, -beta_high * (1 + clip_high) * a
            else:
                v, g = -r * a, -r * a
            if a < 0 and v > -dual_clip * a:
                v, g = -dual_clip * a, 0.0
            vr.append(v)
            gr.append(g)
        values.append(vr)
        grads.append(gr)
    return values, grads


def real_loss(lp, old, adv, mask, group_ids, *, tau):
    """Σ_g L_g / (number of groups with a valid row)."""
    groups = {}
    for i in range(len(lp)):
        valid = [t for t in range(len(lp[i])) if mask[i][t]]
        if not valid:
            continue
        s = sum(lp[i][t] - old[i][t] for t in valid) / len(valid)
        a = sum(adv[i][t] for t in valid) / len(valid)
        groups.setdefault(group_ids[i], []).append((s, a))
    total = 0.0
    for members in groups.values():
        neg = [s for s, a in members if a <= 0]
        pos = [s for s, a in members if a > 0]
        if neg and pos:
            total += math.log(1 + sum(math.exp(s / tau) for s in neg)) + math.log(
                1 + sum(math.exp(-s / tau) for s in pos)
            )
    return total / max(len(groups), 1)


def lists(data):
    """(log_prob, old_log_prob, per-token advantages, mask) of a conftest batch as nested lists."""
    adv = data["advantages"]
    if adv.ndim == 1:
        adv = adv[:, None].expand_as(data["log_prob"])
    return data["log_prob"].tolist(), data["old_log_prob"].tolist(), adv.tolist(), data["mask"].tolist()


# REC, OPMD, sPPO (Trinity-RFT 0.6.0 and their papers) and GVPO (arXiv 2504.19599, verl-recipe).
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
            w = {
                "none": 1.0,
                "importance_sampling": r,
                "sequence_importance_sampling": s,
                "advantage": math.exp(a / temp),
            }[weight]
            row.append(-w * a * lp[i][t] if keep else 0.0)
        out.append(row)
    return out


def opmd(lp, adv, *, tau=1.0):
    """-A·log π/(1 + τ) per token (Trinity opmd_policy_loss.py)."""
    return [
        [-a * x / (1 + tau) for x, a in zip(lp_row, adv_row, strict=True)]
        for lp_row, adv_row in zip(lp, adv, strict=True)
    ]


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


# On-policy distillation (GKD arXiv 2306.13649; Thinking Machines' "On-Policy Distillation") and IW-OPD
# (arXiv 2606.22600, TRL trl/experimental/iw_opd).
def opd_advantages(old, teacher, adv, mask, *, coef=1.0, gamma=0.0, eps=1e-8, discount=0.0):
    """A = Â + λ·w·a per token, a = log π_T - log π_old, w = 1 + γ(1 - Σ_{s<t}|a_s| / max(Σ_s|a_s|, ε));
    with `discount` γ_KL the teacher's term summed over the valid tokens s ≥ t, γ_KL^(number of valid steps).
    (Pass the current log-probs as `old` for prime-rl's a = log π_T - log π_θ.)"""
    out = []
    for i in range(len(old)):
        a = [teacher[i][t] - old[i][t] if mask[i][t] else 0.0 for t in range(len(old[i]))]
        total = max(sum(abs(x) for x in a), eps)
        own, before = [], 0.0
        for t in range(len(a)):
            own.append(coef * (1.0 + gamma * (1.0 - before / total)) * a[t])
            before += abs(a[t])
        row = []
        for t in range(len(a)):
            later = [s for s in range(t, len(a)) if mask[i][s]] if mask[i][t] else []
            future = sum(discount**k * own[s] for k, s in enumerate(later)) if discount > 0 else own[t]
            row.append(adv[i][t] + future)
        out.append(row)
    return out


def opd(
    lp,
    old,
    teacher,
    adv,
    mask,
    *,
    coef=1.0,
    gamma=0.0,
    eps=1e-8,
    surrogate="ratio",
    current=False,
    trust_region=None,
    discount=0.0,
):
    """-r·A ("ratio") or -log π·A ("log_prob") per token, A from `opd_advantages` (compared with the current
    log-probs when `current`), 0 where π_θ - π_old < -`trust_region`."""
    advantages = opd_advantages(
        lp if current else old, teacher, adv, mask, coef=coef, gamma=gamma, eps=eps, discount=discount
    )
    out = []
    for i in range(len(lp)):
        row = []
        for t in range(len(lp[i])):
            dropped = trust_region is not None and math.exp(lp[i][t]) - math.exp(old[i][t]) < -trust_region
            surrogate_t = math.exp(lp[i][t] - old[i][t]) if surrogate == "ratio" else lp[i][t]
            row.append(0.0 if dropped else -surrogate_t * advantages[i][t])
        out.append(row)
    return out


# Importance sampling (Tinker, SkyRL), prime-rl's IPO, SkyRL's rollout_is (the GLM-5 report, arXiv 2602.15763) and
# A*-PO (arXiv 2505.20686, TRL trl/experimental/a2po).
def importance_sampling(lp, old, adv, mask, *, threshold=None, kl_tau=0.0):
    """-keep·A·r + τ·(log r)² per token, keep = |π_θ - π_old| ≤ δ (prime-rl ipo_loss_fn; δ None: keep all)."""

    def f(p, o, a, i):
        keep = threshold is None or abs(math.exp(p) - math.exp(o)) <= threshold
        return (-a * math.exp(p - o) if keep else 0.0) + kl_tau * (p - o) ** 2

    return per_token(f, lp, old, adv, mask)


def rollout_is(lp, rollout, adv, mask, *, eps_low=0.2, eps_high=0.2):
    """-sg[r·1(1 - ε_l ≤ r ≤ 1 + ε_h)]·A·log π_θ per token, r = π_θ/π_rollout (SkyRL rollout_is_policy_loss)."""

    def f(p, q, a, i):
        r = math.exp(p - q)
        return -(r if 1 - eps_low <= r <= 1 + eps_high else 0.0) * a * p

    return per_token(f, lp, rollout, adv, mask)


def a2po_value(rewards, *, beta1=0.5):
    """V* = β₁·log((1/N) Σ_j exp(r_j/β₁)) for one prompt's N reference rewards."""
    return beta1 * math.log(sum(math.exp(r / beta1) for r in rewards) / len(rewards))


def a2po(lp, ref, adv, mask, *, beta2=1e-3):
    """mean over rows with a valid token of (β₂·Σ_t (log π - log π_ref) - Â_i)², Â_i the row's mean advantage."""
    rows = []
    for i in range(len(lp)):
        valid = [t for t in range(len(lp[i])) if mask[i][t]]
        if valid:
            a = sum(adv[i][t] for t in valid) / len(valid)
            rows.append((beta2 * sum(lp[i][t] - ref[i][t] for t in valid) - a) ** 2)
    return sum(rows) / max(len(rows), 1)
