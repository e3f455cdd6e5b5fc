"""Terms added beside the policy loss, written from their papers in Python floats (float64).

Nothing here imports pgloss. Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations


def positive_nll(log_prob, mask, scores) -> float:
    """VAPO's positive-example language-model loss (Yue et al. 2025, arXiv 2504.05118, eq. 10):
    L_NLL = -(1 / Σ_{o_i∈T} |o_i|) Σ_{o_i∈T} Σ_t log π(a_t|s_t), T the correct answers (reward > 0, as
    NeMo-RL's `ClippedPGLossFn`); 0 when T holds no token."""
    total, count = 0.0, 0
    for row, row_mask, score in zip(log_prob, mask, scores, strict=True):
        if score > 0:
            for value, valid in zip(row, row_mask, strict=True):
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


def chord_mu(step, *, warmup_steps, decay_steps, peak, valley) -> float:
    """CHORD's μ schedule (arXiv 2508.11408): linear warm-up from 0 to the peak, cosine decay to the valley."""
    import math

    if step < warmup_steps:
        return step / warmup_steps * peak
    if step >= warmup_steps + decay_steps:
        return valley
    return valley + (peak - valley) * 0.5 * (1 + math.cos(math.pi * (step - warmup_steps) / decay_steps))


def chord_loss(
    log_prob,
    old_log_prob,
    advantages,
    mask,
    expert,
    *,
    mu,
    mode="token-mean",
    sft_mode=None,
    weight="phi",
    cutoff=1.0,
    clip=0.2,
    dual_clip=3.0,
) -> float:
    """CHORD (arXiv 2508.11408): (1 − μ)·Agg_U(PPO) + μ·Agg_E(SFT) over the on-policy rows U and the expert
    rows E, each aggregated over its own rows. PPO: max(−A·r, −A·clip(r, 1±ε)), bounded by −c·A for A < 0.
    SFT per token: −φ(p)·log p with φ = p(1 − p) ("phi", log p capped at log cutoff), −log p ("none"),
    −p·log p ("is"); the weights carry no gradient (this loop computes values only)."""
    import math

    from .aggregate import aggregate

    def ppo(lp, old, a):
        r = math.exp(lp - old)
        value = max(-a * r, -a * min(max(r, 1 - clip), 1 + clip))
        return min(value, -a * dual_clip) if a < 0 else value

    def sft(lp):
        p = math.exp(lp)
        if weight == "none":
            return -lp
        if weight == "is":
            return -p * lp
        return -p * (1 - p) * min(lp, math.log(cutoff))

    rows = range(len(mask))
    on = [[v and not expert[i] for v in mask[i]] for i in rows]
    off = [[v and expert[i] for v in mask[i]] for i in rows]
    pg = [[ppo(lp, old, advantages[i]) for lp, old in zip(log_prob[i], old_log_prob[i], strict=True)] for i in rows]
    demo = [[sft(lp) for lp in log_prob[i]] for i in rows]
    return (1 - mu) * aggregate(pg, on, mode) + mu * aggregate(demo, off, sft_mode or mode)
