"""Beside a loss: rollout importance weights and rejections, the off-policy mask, the entropy quantile, M2PO's mask.

Nothing here imports pgloss: these are the independent references the tests compare against, written
in Python floats (float64). Inputs are nested lists; `mask[i][t]` is a bool.
"""

from __future__ import annotations

import math


def _valid(row, mask_row):
    return [v for v, m in zip(row, mask_row, strict=True) if m]


def segments(mask_row):
    """The maximal runs of consecutive valid positions of a row, as lists of positions (ROLL's segments)."""
    runs, run = [], []
    for t, m in enumerate(mask_row):
        if m:
            run.append(t)
        elif run:
            runs.append(run)
            run = []
    if run:
        runs.append(run)
    return runs


# -- rollout correction ------------------------------------------------------------------------


def rollout_weights(train, rollout, mask, *, level, mode, lower, upper, max_log_ratio=20.0, batch_normalize=False):
    """Per-token weights and out-of-band flags; verl's rollout_is / ms-swift's sequence modes."""
    B, T = len(mask), len(mask[0])
    raw = [[0.0] * T for _ in range(B)]
    for i in range(B):
        diffs = [train[i][t] - rollout[i][t] for t in range(T) if mask[i][t]]
        if level == "sequence_product":
            s = max(-max_log_ratio, min(max_log_ratio, sum(diffs)))
        elif level == "sequence_geometric":
            s = max(-max_log_ratio, min(max_log_ratio, sum(diffs) / max(len(diffs), 1)))
        per_segment = {}
        for run in segments(mask[i]):
            mean = sum(train[i][t] - rollout[i][t] for t in run) / len(run)
            per_segment.update({t: mean for t in run})
        for t in range(T):
            if level == "token":
                s = max(-max_log_ratio, min(max_log_ratio, train[i][t] - rollout[i][t]))
            elif level == "segment_geometric" and mask[i][t]:
                s = max(-max_log_ratio, min(max_log_ratio, per_segment[t]))
            raw[i][t] = math.exp(s) if mask[i][t] else 0.0
    weight = [[0.0] * T for _ in range(B)]
    out = [[False] * T for _ in range(B)]
    for i in range(B):
        for t in range(T):
            if not mask[i][t]:
                continue
            w = raw[i][t]
            o = (lower is not None and w < lower) or (upper is not None and w > upper)
            out[i][t] = o
            if mode == "mask":
                weight[i][t] = 0.0 if o else w
            else:
                if lower is not None:
                    w = max(w, lower)
                if upper is not None:
                    w = min(w, upper)
                weight[i][t] = w
    if batch_normalize:
        if level in ("token", "segment_geometric"):
            vals = [weight[i][t] for i in range(B) for t in range(T) if mask[i][t]]
        else:
            vals = [next(weight[i][t] for t in range(T) if mask[i][t]) for i in range(B) if any(mask[i])]
        mean = sum(vals) / max(len(vals), 1)
        weight = [[w / mean for w in row] for row in weight]
    return weight, out


def kl_rejection_keep(train, rollout, mask, option, upper, lower=None):
    """verl's compute_rollout_rejection_mask for one option: keep flags per token."""
    level, k = option.rsplit("_", 1)
    B, T = len(mask), len(mask[0])
    keep = [[True] * T for _ in range(B)]
    for i in range(B):
        stats = []
        for t in range(T):
            x = max(-20.0, min(20.0, train[i][t] - rollout[i][t]))
            stats.append({"k1": -x, "k2": 0.5 * x * x, "k3": math.exp(x) - 1 - x}[k])
        valid = _valid(stats, mask[i])

        def passes(s):
            if k == "k1":
                lo = lower if lower is not None else (1 / upper if upper is not None else None)
                return (upper is None or s <= math.log(upper)) and (lo is None or s >= math.log(lo))
            return s <= upper

        if level == "token":
            keep[i] = [passes(s) for s in stats]
        elif level == "segment_mean":
            keep[i] = [True] * T
            for run in segments(mask[i]):
                seg = sum(stats[t] for t in run) / len(run)
                for t in run:
                    keep[i][t] = passes(seg)
        else:
            if not valid:
                seq = 0.0
            elif level == "seq_sum":
                seq = sum(valid)
            elif level == "seq_mean":
                seq = sum(valid) / len(valid)
            elif level == "seq_min":
                seq = min(valid)
            else:
                seq = max(valid)
            keep[i] = [passes(seq)] * T
    return keep


def gate_keep(train, rollout, mask, statistic, level, *, lower=None, upper=None):
    """A probability gate's keep flags per token: OpenRLHF's binary_kl / tv (probabilities clamped to
    [1e-6, 1 - 1e-6]) and ROLL's difference p_train - p_rollout, at token, sequence mean, sequence sum or
    segment mean level, kept when lower <= statistic <= upper."""
    B, T = len(mask), len(mask[0])
    keep = [[True] * T for _ in range(B)]

    def token_stat(a, b):
        pt, pr = math.exp(a), math.exp(b)
        if statistic == "diff":
            return pt - pr
        q, p = min(max(pt, 1e-6), 1 - 1e-6), min(max(pr, 1e-6), 1 - 1e-6)
        if statistic == "tv":
            return abs(p - q)
        return p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))

    def passes(s):
        return (lower is None or s >= lower) and (upper is None or s <= upper)

    for i in range(B):
        stats = [token_stat(train[i][t], rollout[i][t]) for t in range(T)]
        valid = _valid(stats, mask[i])
        if level == "token":
            keep[i] = [passes(s) for s in stats]
        elif level == "segment_mean":
            for run in segments(mask[i]):
                seg = sum(stats[t] for t in run) / len(run)
                for t in run:
                    keep[i][t] = passes(seg)
        else:
            seq = sum(valid) if level == "seq_sum" else sum(valid) / max(len(valid), 1)
            keep[i] = [passes(seq)] * T
    return keep


def opsm_keep(log_prob, behave, seq_adv, mask, delta):
    """DeepSeek-V3.2 off-policy sequence mask: drop A<0 rows with mean(behave - logp) > δ."""
    out = []
    for i in range(len(mask)):
        gaps = [b - lp for b, lp, m in zip(behave[i], log_prob[i], mask[i], strict=True) if m]
        gap = sum(gaps) / max(len(gaps), 1)
        out.append(not (seq_adv[i] < 0 and gap > delta))
    return out


def mismatch(train, rollout, mask):
    toks = [(a - b) for i in range(len(mask)) for a, b, m in zip(train[i], rollout[i], mask[i], strict=True) if m]
    rows = [[a - b for a, b, m in zip(train[i], rollout[i], mask[i], strict=True) if m] for i in range(len(mask))]
    rows = [r for r in rows if r]
    return {
        "rollout_kl": sum(-x for x in toks) / len(toks),
        "rollout_k3_kl": sum(math.exp(x) - 1 - x for x in toks) / len(toks),
        "rollout_chi2_token": sum(math.exp(2 * x) for x in toks) / len(toks) - 1,
        "rollout_chi2_seq": sum(math.exp(2 * sum(r)) for r in rows) / len(rows) - 1,
        "rollout_ppl_ratio": sum(math.exp(-sum(r) / len(r)) for r in rows) / len(rows),
    }


# -- advantage estimators ----------------------------------------------------------------------


def quantile(values, q):
    """Linear interpolation between order statistics (torch.quantile / numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def m2po_keep(behave, prox, mask, threshold):
    """AReaL's _get_m2po_loss_mask on the valid tokens: mask the largest m2 until the mean of the rest is
    below the threshold (keep at least one); returns keep flags per token."""
    items = [
        ((b - p) ** 2, i, t)
        for i in range(len(mask))
        for t, (b, p, m) in enumerate(zip(behave[i], prox[i], mask[i], strict=True))
        if m
    ]
    items.sort(key=lambda x: -x[0])
    n = len(items)
    k = n - 1
    for j in range(n):
        rest = [x[0] for x in items[j:]]
        if sum(rest) / len(rest) < threshold:
            k = j
            break
    keep = [[False] * len(mask[0]) for _ in mask]
    for _, i, t in items[k:]:
        keep[i][t] = True
    return keep
