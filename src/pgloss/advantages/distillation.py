"""Advantages from a teacher's log-probs of the sampled tokens, computed once per step before the loss:

    jsd_advantages     Trinity-RFT's JSD advantage (on-policy distillation by the sampled-token JS mixture)
    rlsd_advantages    RLSD's token reweighting of the sequence advantage by the teacher's evidence
    rlsd_lambda        RLSD's λ schedule (linear warm-up, then linear decay)

Each takes the sampling policy's log-probs log π_old(y_t) (`old_log_prob`) and the teacher's log π_T(y_t)
(`teacher_log_prob`), both `[B, T]`, and returns a detached `[B, T]` advantage, 0 at masked positions, in the
inputs' dtype (arithmetic in float64).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.batch import check_mask, check_tensor
from ..core.checks import check_number


def _token_inputs(teacher_log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(teacher, old) in float64, detached, and the bool mask; each argument checked by name."""
    old_log_prob = check_tensor("old_log_prob", old_log_prob, ndim=(2,))
    teacher_log_prob = check_tensor("teacher_log_prob", teacher_log_prob, ndim=(2,))
    if teacher_log_prob.shape != old_log_prob.shape:
        raise ValueError(
            f"teacher_log_prob must have the shape of old_log_prob {tuple(old_log_prob.shape)}, "
            f"got {tuple(teacher_log_prob.shape)}"
        )
    mask = check_mask(mask, old_log_prob.shape, old_log_prob.device, reference="old_log_prob")
    return teacher_log_prob.detach().double(), old_log_prob.detach().double(), mask


def sampled_token_mixture(teacher: Tensor, student: Tensor, beta: float) -> Tensor:
    """log m = log(β·e^t + (1-β)·e^s) of two sampled-token log-probs (0 < β < 1), in log space."""
    return torch.logaddexp(teacher + math.log(beta), student + math.log1p(-beta))


def jsd_advantages(
    teacher_log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    *,
    beta: float = 0.5,
    coef: float = 1.0,
) -> Tensor:
    """Trinity-RFT 0.6.0's JSD advantage (`trinity/algorithm/advantage_fn/jsd_advantage.py`, `JSDAdvantage`), `[B, T]`:

        A_t = -coef·[β·(t - m) + (1-β)·(s - m)],   m = log(β·e^t + (1-β)·e^s)

    with t = log π_T(y_t), s = log π_old(y_t) (the sampling policy's, Trinity's `old_log_probs`), β its
    `lambda_coef` (0.5), coef its `kl_coef` (1). As Trinity, the two ends are the k1 samples, not the limits of
    the mixture (which are 0): β = 0 gives A = -coef·(s - t) (pgloss `opd`'s advantage), β = 1 gives
    A = -coef·(t - s). Trinity's `jsd` algorithm feeds A to its `ppo` loss (pgloss `dual_clip_ppo` with
    loss_agg_mode="token-mean"). Its `temperature` divides both log-probs before this (pass them divided).
    """
    beta = check_number("beta", beta)
    coef = check_number("coef", coef)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must lie in [0, 1], got {beta}")
    t, s, mask = _token_inputs(teacher_log_prob, old_log_prob, mask)
    if beta == 0.0:
        jsd = s - t
    elif beta == 1.0:
        jsd = t - s
    else:
        m = sampled_token_mixture(t, s, beta)
        jsd = beta * (t - m) + (1.0 - beta) * (s - m)
    return torch.where(mask, -coef * jsd, 0.0).to(old_log_prob.dtype)


def rlsd_advantages(
    advantages: Tensor,
    teacher_log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    *,
    lam: float = 0.5,
    clip_range: float = 0.2,
    negative_only: bool = False,
) -> Tensor:
    """RLSD, self-distilled RLVR (arXiv 2604.03128; ms-swift 4.6.0 `swift/rl_core/advantage.py`
    `apply_rlsd_reweight`), `[B, T]`:

        Â_t = A·[(1-λ) + λ·clip(exp(sign(A)·(log π_T(y_t) - log π_old(y_t))), 1-ε_w, 1+ε_w)]

    the sequence advantage A (`advantages`, `[B]` or `[B, T]`) redistributed over its tokens by the teacher's
    evidence (the policy given the reference answer): never flipping its sign, since the weight is > 0. λ
    (`rlsd_lambda`, 0.5; `rlsd_lambda` below schedules it) mixes GRPO (λ = 0) and the full reweight; ε_w
    (`rlsd_reweight_clip_range`, 0.2). `negative_only` (`rlsd_negative_only`): rows with A ≥ 0 keep A.
    ms-swift multiplies a `[B]` advantage; a `[B, T]` one is reweighted per token with the sign of each A_t.
    """
    lam = check_number("lam", lam)
    clip_range = check_number("clip_range", clip_range)
    if not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must lie in [0, 1], got {lam}")
    if clip_range < 0:
        raise ValueError(f"clip_range must be >= 0, got {clip_range}")
    t, s, mask = _token_inputs(teacher_log_prob, old_log_prob, mask)
    advantages = check_tensor("advantages", advantages, ndim=(1, 2))
    if advantages.shape[0] != mask.shape[0] or (advantages.ndim == 2 and advantages.shape != mask.shape):
        raise ValueError(
            f"advantages must have shape ({mask.shape[0]},) or {tuple(mask.shape)}, got {tuple(advantages.shape)}"
        )
    a = advantages.detach().double()
    a = (a[:, None] if a.ndim == 1 else a).expand_as(t)
    evidence = torch.exp(torch.sign(a) * torch.where(mask, t - s, 0.0))
    weight = (1.0 - lam) + lam * evidence.clamp(1.0 - clip_range, 1.0 + clip_range)
    if negative_only:
        weight = torch.where(a < 0, weight, 1.0)
    return torch.where(mask, a * weight, 0.0).to(old_log_prob.dtype)


def rlsd_lambda(step: int, lam: float = 0.5, *, warmup_steps: int = 0, decay_steps: int = 0) -> float:
    """RLSD's λ at optimizer step `step` (ms-swift 4.6.0 `GRPOTrainer._rlsd_effective_lambda`, after the
    reference's `opsd_trainer.py`): λ·step/warmup while step < warmup (`rlsd_lambda_warmup_steps`), then, with
    `decay_steps` (`rlsd_lambda_decay_steps`), λ·max(1 - (step - warmup)/decay, 0); otherwise λ."""
    if warmup_steps < 0 or decay_steps < 0:
        raise ValueError(f"warmup_steps and decay_steps must be >= 0, got {warmup_steps}, {decay_steps}")
    if warmup_steps > 0 and step < warmup_steps:
        return lam * (step / warmup_steps)
    if decay_steps > 0 and step >= warmup_steps:
        return lam * max(1.0 - (step - warmup_steps) / decay_steps, 0.0)
    return lam
