"""What GRPO computes, read top to bottom: `pgloss.get("grpo")` as plain float64 loops over one step's rows and
tokens, importing nothing of pgloss (tests/test_grpo_reading.py holds it equal to the library, value and gradient).

GRPO (Shao et al. 2024, arXiv 2402.03300, eq. 3) with pgloss's defaults: the clipped surrogate on the token
ratio, averaged over each sequence's tokens, then over the step's sequences (loss_agg_mode
"seq-mean-token-mean"), plus β times the k3 estimate of KL(π_θ‖π_ref) aggregated the same way.
"""

import math

CLIP = 0.2  # ε: the ratio is clipped to [1 - ε, 1 + ε] (clip_low = clip_high)
BETA = 0.04  # β: kl_coef
MAX_LOG_RATIO = 20.0  # log-ratios are clamped before exp
MAX_KL = 10.0  # the k3 estimate is clamped (verl)


def grpo_loss(log_prob, old_log_prob, ref_log_prob, advantages, mask):
    """The loss of one step: nested lists `[B][T]` (advantages `[B]`), mask of 0/1."""

    def clamp(x, bound):
        return max(-bound, min(bound, x))

    rows = []  # (Σ_t ℓ_{i,t}, Σ_t KL_{i,t}, |y_i|) of each non-empty sequence
    for lp, old, ref, adv, m in zip(log_prob, old_log_prob, ref_log_prob, advantages, mask, strict=True):
        policy = kl = 0.0
        length = 0
        for t in range(len(m)):
            if not m[t]:
                continue  # a masked token reaches nothing
            ratio = math.exp(clamp(lp[t] - old[t], MAX_LOG_RATIO))  # r = π_θ / π_old
            clipped = max(1 - CLIP, min(1 + CLIP, ratio))
            policy += max(-adv * ratio, -adv * clipped)  # -min(r·A, clip(r)·A)
            d = clamp(ref[t] - lp[t], MAX_LOG_RATIO)  # log π_ref/π_θ
            kl += clamp(math.exp(d) - d - 1, MAX_KL)  # k3: unbiased, ≥ 0
            length += 1
        if length:
            rows.append((policy, kl, length))
    sequences = max(len(rows), 1)
    policy_loss = sum(p / n for p, _, n in rows) / sequences  # seq-mean-token-mean
    kl_loss = sum(k / n for _, k, n in rows) / sequences
    return policy_loss + BETA * kl_loss
