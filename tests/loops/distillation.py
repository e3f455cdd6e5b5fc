"""Distillation from a teacher's log-probs of the sampled tokens, written from the papers and trainers' definitions
in Python floats (float64), with their per-token gradients with respect to log π_θ (the stop-gradients make a
finite difference of the value the wrong check).

Nothing here imports pgloss. Inputs are nested lists; `mask[i][t]` is a bool; `lp` log π_θ, `old` log π_old,
`teacher` log π_T.
"""

from __future__ import annotations

import math

from .kl import kl


def _rows(fn, *tables):
    return [[fn(*values) for values in zip(*rows, strict=True)] for rows in zip(*tables, strict=True)]


def _clamp(x, lo, hi):
    return min(max(x, lo), hi)


def _estimate(p, q, estimator):
    """(k(p, q), ∂k/∂p) of the sampled-token estimator of KL(π_θ‖π_T), k3 as verl computes it: -d clamped to ±20
    before exp and k3 to ±10 after (zero gradient beyond either)."""
    d = p - q
    if estimator != "k3":
        return kl(p, q, estimator), {"k1": 1.0, "abs": math.copysign(1.0, d), "k2": d}[estimator]
    neg = _clamp(-d, -20.0, 20.0)
    value = math.exp(neg) - neg - 1.0
    grad = 1.0 - math.exp(neg) if abs(d) < 20 else 0.0
    return _clamp(value, -10.0, 10.0), (grad if abs(value) < 10 else 0.0)


def _divergence(p, q, estimator, clamp):
    """(D, ∂D/∂p): the estimate clamped to ±`clamp` (None: not clamped), zero gradient where clamped."""
    value, grad = _estimate(p, q, estimator)
    if clamp is not None and abs(value) > clamp:
        return _clamp(value, -clamp, clamp), 0.0
    return value, grad


def distill_divergence(lp, teacher, *, estimator="k3", clamp=10.0):
    """D = clamp(k(log π_θ, log π_T), ±M) per token."""
    return _rows(lambda p, q: _divergence(p, q, estimator, clamp)[0], lp, teacher)


def distill_pg(lp, old, teacher, *, estimator="k3", clamp=10.0, clip_low=0.2, clip_high=0.2, dual_clip=3.0):
    """Distillation through the policy loss (verl 0.9.1): A = -D, then PPO's clipped surrogate per token,
    max(-A·r, -A·clip(r, 1-ε_low, 1+ε_high)), for A < 0 at most -c·A. Returns (values, ∂/∂log π_θ), the gradient
    through r only (A is detached): -A·r on the active unclipped branch, 0 on a clip or the dual clip."""
    div = distill_divergence(lp, teacher, estimator=estimator, clamp=clamp)

    def one(p, o, d):
        a, r = -d, math.exp(p - o)
        unclipped, clipped = -a * r, -a * _clamp(r, 1 - clip_low, 1 + clip_high)
        value, grad = (unclipped, -a * r) if unclipped >= clipped else (clipped, 0.0)
        if dual_clip is not None and a < 0 and value > -a * dual_clip:
            value, grad = -a * dual_clip, 0.0
        return value, grad

    pairs = _rows(one, lp, old, div)
    return [[v for v, _ in row] for row in pairs], [[g for _, g in row] for row in pairs]


def distill_direct(lp, teacher, *, estimator="k3", clamp=10.0):
    """GKD's direct loss (verl `use_policy_gradient=False`): (D, ∂D/∂log π_θ) per token."""
    pairs = _rows(lambda p, q: _divergence(p, q, estimator, clamp), lp, teacher)
    return [[v for v, _ in row] for row in pairs], [[g for _, g in row] for row in pairs]


def jsd_advantage(teacher, old, mask, *, beta=0.5, coef=1.0):
    """Trinity-RFT's JSD advantage: A = -coef·[β(t - m) + (1-β)(s - m)], m = log(β e^t + (1-β) e^s) on the sampled
    token (t teacher, s student); at β = 0 and β = 1 Trinity's k1 samples s - t and t - s."""

    def one(t, s, valid):
        if not valid:
            return 0.0
        if beta == 0:
            jsd = s - t
        elif beta == 1:
            jsd = t - s
        else:
            m = math.log(beta * math.exp(t) + (1 - beta) * math.exp(s))
            jsd = beta * (t - m) + (1 - beta) * (s - m)
        return -coef * jsd

    return _rows(one, teacher, old, mask)


def rlsd(advantages, teacher, old, mask, *, lam=0.5, clip_range=0.2, negative_only=False):
    """RLSD (arXiv 2604.03128, eq. of the evidence weight): Â_t = A·[(1-λ) + λ·clip(exp(sign(A)·(t - s)), 1 ± ε)],
    A the sequence advantage; `negative_only`: rows with A ≥ 0 keep A."""
    out = []
    for a, t_row, s_row, m_row in zip(advantages, teacher, old, mask, strict=True):
        row = []
        for t, s, valid in zip(t_row, s_row, m_row, strict=True):
            sign = (a > 0) - (a < 0)
            weight = (1 - lam) + lam * _clamp(math.exp(sign * (t - s)), 1 - clip_range, 1 + clip_range)
            if negative_only and a >= 0:
                weight = 1.0
            row.append(a * weight if valid else 0.0)
        out.append(row)
    return out


def rlsd_lambda(step, lam, warmup, decay):
    """RLSD's schedule: linear from 0 to λ over `warmup` steps, then linear to 0 over `decay` steps (0: constant)."""
    if warmup and step < warmup:
        return lam * step / warmup
    if decay:
        return lam * max(0.0, 1 - (step - warmup) / decay)
    return lam


def sdpo(lp, old, teacher, *, cap=2.0):
    """SDPO's token-level self-distillation (arXiv 2601.20802): ℓ = sg[lp - t]·lp·min(sg[exp(lp - old)], κ);
    returns (values, ∂/∂log π_θ = (lp - t)·min(r, κ))."""

    def one(p, o, t):
        w = 1.0 if cap is None else min(math.exp(_clamp(p - o, -20, 20)), cap)
        return (p - t) * p * w, (p - t) * w

    pairs = _rows(one, lp, old, teacher)
    return [[v for v, _ in row] for row in pairs], [[g for _, g in row] for row in pairs]


def sdar(lp, teacher, *, gate_beta=5.0):
    """SDAR (arXiv 2605.15155): ℓ = sg[σ(β(t - lp))]·(t - lp); returns (values, ∂/∂log π_θ = -σ(β(t - lp)))."""

    def one(p, t):
        g = 1.0 / (1.0 + math.exp(-gate_beta * (t - p)))
        return g * (t - p), -g

    pairs = _rows(one, lp, teacher)
    return [[v for v, _ in row] for row in pairs], [[g for _, g in row] for row in pairs]
