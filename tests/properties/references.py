"""A step's loss from the loops of tests/loops, as a function of the log-probs, and its gradient by central
differences: the float64 reference the regression tests hold a path's value and gradient to.

Imported as `from properties.references import ...` (tests/ is on the path, see conftest.py)."""

from __future__ import annotations

import loops
import torch

DETACHED_WEIGHT = ("cispo", "vespo")
"""Families whose term is c·log π with a detached coefficient c (CISPO's -sg[clip(r)]·A, VESPO's -sg[φ(w)]·A)."""


def step_loss_loop(name, algorithm, lp0, old, adv, mask):
    """The loop's loss of `algorithm` (dapo, cispo, fipo or vespo) over a step, as a function of the log-probs
    (nested lists), with the family's detached weights held at `lp0`: its central differences at `lp0` are the
    gradient the loss defines. `adv` is per token; every argument is a nested list."""
    if name in DETACHED_WEIGHT:
        term = (
            loops.cispo_per_token(lp0, old, adv, clip_low=algorithm.clip_low, clip_high=algorithm.clip_high)
            if name == "cispo"
            else loops.vespo(
                lp0,
                old,
                adv,
                mask,
                k_pos=algorithm.vespo_k_pos,
                lambda_pos=algorithm.vespo_lambda_pos,
                k_neg=algorithm.vespo_k_neg,
                lambda_neg=algorithm.vespo_lambda_neg,
            )
        )
        coefficient = [
            [v / x for v, x in zip(rv, rx, strict=True)] for rv, rx in zip(term, lp0, strict=True)
        ]  # log-probs are < 0
    elif name == "fipo":
        frozen = loops.fipo_weights(
            lp0,
            old,
            adv,
            mask,
            decay_rate=algorithm.fipo_decay_rate,
            clip_range=algorithm.fipo_clip_range,
            clip_high_only=algorithm.fipo_clip_high_only,
            safety_threshold=algorithm.fipo_safety_threshold,
            delta=algorithm.delta,
        )
    elif name != "dapo":
        raise KeyError(name)

    def loss(lp):
        if name in DETACHED_WEIGHT:
            values = [[c * x for c, x in zip(rc, rx, strict=True)] for rc, rx in zip(coefficient, lp, strict=True)]
        else:
            values = loops.clipped_policy_per_token(
                lp,
                old,
                adv,
                mask,
                level="token",
                clip_low=algorithm.clip_low,
                clip_high=algorithm.clip_high,
                delta=algorithm.delta,
            )
        if name == "fipo":  # sg[f]·ℓ_clip
            values = [[w * v for w, v in zip(fr, vr, strict=True)] for fr, vr in zip(frozen, values, strict=True)]
        return loops.aggregate(values, mask, algorithm.loss_agg_mode)

    return loss


def central_differences(loss_of, values, eps=1e-6):
    """∂ loss_of(nested list)/∂ values by central differences, a float64 tensor shaped like `values`."""
    base = values.double().tolist()
    grad = torch.zeros(values.shape, dtype=torch.float64)
    for i, row in enumerate(base):
        for t, x in enumerate(row):
            up, down = [list(r) for r in base], [list(r) for r in base]
            up[i][t], down[i][t] = x + eps, x - eps
            grad[i, t] = (loss_of(up) - loss_of(down)) / (2 * eps)
    return grad
