"""Distillation through the policy loss (verl 0.9.1's default): + c · Agg(ℓ^D), a second clipped surrogate whose
advantage is the teacher's per-token divergence, beside the family's policy term on the task's advantages.

    D_t = clamp(k(log π_θ(y_t), log π_T(y_t)), -M, M)      k in k1, k2, k3, abs (`pgloss.kl.kl_estimate`), M = 10
    A_t = -sg[D_t]
    ℓ^D_t = max(-A_t·r, -A_t·clip(r, 1-ε_low, 1+ε_high)), for A_t < 0 at most -c_dual·A_t   (`core/clip.py`)

read on the current policy π_θ, r = π_θ/π_old; weighed by the rollout correction's weight (and a given
`rollout_is_weight`) as the policy term is; aggregated like the policy term (every row, `loss_agg_mode`). With
`distill_policy_gradient=False` the term is the divergence itself, ℓ^D_t = D_t with its gradient (GKD,
arXiv 2306.13649; k1 refused: its gradient does not depend on the teacher).

Source: verl 0.9.1 `verl/trainer/distillation/losses.py` `distillation_ppo_loss` (total = task PPO loss +
`distillation_loss_coef` × distillation loss; `use_task_rewards=False`: the distillation loss alone, pgloss
`policy_coef=0`), `distillation_loss` (clamp to ±`loss_max_clamp`, then the policy loss `vanilla`, verl's
dual-clip PPO with `clip_ratio_c` 3, on A = -D, or `agg_loss` of D), `compute_distillation_loss_reverse_kl_estimator`
(`kl_penalty(log π_θ, log π_T, loss_mode)`: k3 clamps -d to ±20 and k3 to ±10 itself); defaults
`verl/workers/config/distillation.py` `DistillationLossConfig` (loss_mode "k3", use_policy_gradient True,
loss_max_clamp 10, clip_ratio 0.2/0.2, coefficient 1; the generated YAML has use_policy_gradient false and
loss_max_clamp null). Needs `teacher_log_prob`; `distill_loss` reports Agg(ℓ^D), `distill_divergence` the token
mean of D.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.batch import TokenBatch
from ..core.clip import clipped_surrogate
from ..core.metrics import token_mean
from ..core.output import check
from ..core.ratios import importance_ratio
from ..core.row_set import Part
from ..core.trainer_names import value_hint
from ..correction.rollout import Corrected
from ..correction.weighting import weighted
from ..kl.estimators import KL_ESTIMATORS, kl_estimate
from .term import TermValue


@dataclass(frozen=True, kw_only=True)
class Options:
    """The policy-gradient distillation term's fields, shared by every algorithm."""

    coef_field: ClassVar[str] = "distill_coef"
    """The field of the term's coefficient (0: the term is off)."""

    distill_coef: float = 0.0
    """c: + c·Agg(ℓ^D), the teacher's divergence as the advantage of a second clipped surrogate (verl
    `distillation_loss_coef`, 1 in its trainer); 0 disables it. Needs `teacher_log_prob`."""
    distill_estimator: str = "k3"
    """k of D_t = k(log π_θ, log π_T): "k1", "k2" (verl "mse"), "k3" (verl "low_var_kl"), "abs" (verl `loss_mode`)."""
    distill_clamp: float | None = 10.0
    """M: D_t is clamped to [-M, M] (verl `loss_max_clamp`); None: not clamped."""
    distill_policy_gradient: bool = True
    """True: D enters as the advantage -sg[D] of the clipped surrogate (verl `use_policy_gradient`); False: the
    term is D_t itself, with its gradient (k1 refused)."""
    distill_clip_low: float = 0.2
    """ε_low of the distillation's clipped surrogate (verl `distillation_loss.clip_ratio_low`)."""
    distill_clip_high: float = 0.2
    """ε_high of the distillation's clipped surrogate (verl `distillation_loss.clip_ratio_high`)."""
    distill_dual_clip: float | None = 3.0
    """c_dual > 1 of its dual clip (verl's `vanilla` reads `clip_ratio_c`, 3, which the distillation config does
    not set); None: no dual clip."""

    def distillation(self, max_log_ratio: float) -> Distillation:
        """The term these fields configure (its checks run here)."""
        check(self.distill_coef >= 0, f"distill_coef must be >= 0, got {self.distill_coef}")
        check(
            self.distill_estimator in KL_ESTIMATORS,
            f"distill_estimator must be one of {KL_ESTIMATORS}, got {self.distill_estimator!r}"
            + value_hint("kl_estimator", self.distill_estimator),  # verl's loss_mode takes kl_penalty's names
        )
        check(
            self.distill_clamp is None or self.distill_clamp > 0,
            f"distill_clamp must be > 0 or None, got {self.distill_clamp}",
        )
        check(
            self.distill_policy_gradient or self.distill_estimator != "k1",
            "distill_estimator='k1' needs distill_policy_gradient=True: the gradient of k1 itself does not depend "
            "on the teacher (verl refuses it too)",
        )
        check(self.distill_clip_low >= 0, f"distill_clip_low must be >= 0, got {self.distill_clip_low}")
        check(self.distill_clip_high >= 0, f"distill_clip_high must be >= 0, got {self.distill_clip_high}")
        check(
            self.distill_dual_clip is None or self.distill_dual_clip > 1,
            f"distill_dual_clip must be > 1 or None, got {self.distill_dual_clip}",
        )
        return Distillation(
            self.distill_coef,
            self.distill_estimator,
            self.distill_clamp,
            self.distill_policy_gradient,
            self.distill_clip_low,
            self.distill_clip_high,
            self.distill_dual_clip,
            max_log_ratio,
        )


@dataclass(frozen=True)
class Distillation:
    coef: float
    estimator: str
    clamp: float | None
    policy_gradient: bool
    clip_low: float
    clip_high: float
    dual_clip: float | None
    max_log_ratio: float
    loss_metric: str = "distill_loss"

    def needs(self) -> dict[str, str]:
        if self.coef == 0:
            return {}
        return {
            "teacher_log_prob": f"[B, T], the teacher's log-probs of the sampled tokens: distill_coef={self.coef} "
            f"takes its advantage from the divergence {self.estimator}(log π_θ, log π_T)"
        }

    def parts(self) -> tuple[Part, ...] | None:
        return None

    def divergence(self, batch: TokenBatch) -> torch.Tensor:
        """D_t = clamp(k(log π_θ, log π_T), ±M), with its gradient through log π_θ, 0 where masked."""
        assert batch.teacher_log_prob is not None
        d = kl_estimate(batch.log_prob, batch.teacher_log_prob, self.estimator)
        if self.clamp is not None:
            d = d.clamp(-self.clamp, self.clamp)
        return torch.where(batch.mask, d, 0.0)

    def evaluate(self, batch: TokenBatch, corrected: Corrected | None) -> TermValue:
        if self.coef == 0 or batch.teacher_log_prob is None:
            return TermValue()
        d = self.divergence(batch)
        metrics = {"distill_divergence": token_mean(d.detach(), batch.mask)}
        if not self.policy_gradient:
            return TermValue(metrics, d)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        surrogate = clipped_surrogate(
            ratio, -d.detach(), clip_low=self.clip_low, clip_high=self.clip_high, dual_clip=self.dual_clip
        )
        per_token = weighted(surrogate.loss, corrected, batch.rollout_is_weight)  # verl weighs both losses alike
        return TermValue(metrics, torch.where(batch.mask, per_token, 0.0))
