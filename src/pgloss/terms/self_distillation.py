"""SDPO's token-level self-distillation (arXiv 2601.20802): + w · SeqMeanTokenMean(ℓ^SD), the policy distilling
itself given privileged context (a successful attempt, the environment's feedback) as the teacher.

    ℓ^SD_t = sg[log π_θ(y_t) - log π_T(y_t)] · log π_θ(y_t) · min(sg[π_θ(y_t)/π_old(y_t)], κ)

the sampled-token reverse KL(π_θ‖π_T) as a score-function loss: its gradient is (log π_θ - log π_T)·∇log π_θ,
weighed by the clipped importance ratio κ = 2 (`self_distill_is_cap`; None: no weight, as TRL without old
log-probs; log r clamped to ±max_log_ratio first). Aggregated seq-mean-token-mean over every row, whatever the
objective's `loss_agg_mode` (TRL's mean of per-row token means). A row without a teacher (TRL's
`self_distillation_mask` 0) adds 0 and still counts in the mean: pass the student's own log-probs there as
`teacher_log_prob` (then sg[log π_θ - log π_T] = 0).

SDPO's loss is (1 - w)·GRPO + w·SD: pgloss `policy_coef` = 1 - w, `self_distill_coef` = w (`sdpo`: w = 1).
The teacher is the trainer's: TRL scores the completion with an EMA copy of the policy (`teacher_model_kind`
"ema", `teacher_update_rate` 0.05 every `teacher_sync_steps` = 1) given the reprompt; pgloss takes its
log-probs as `teacher_log_prob`.

Source: TRL 1.16.0 `trl/experimental/sdpo/sdpo_trainer.py` `SDPOTrainer._compute_self_distillation_loss`
(`distillation_mode="sampled_token"`: `loss_utils.py` `compute_sampled_token_self_distillation_loss`, then
`apply_importance_sampling_clipping` with `distillation_is_clip` = 2); `compute_loss` for the blend. TRL's top-k and
full-vocabulary modes (and SDFT's top-k JSD) are divergences over the vocabulary, not this term.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.batch import TokenBatch
from ..core.metrics import token_mean
from ..core.output import check
from ..core.ratios import log_ratio
from ..core.row_set import Part
from ..correction.rollout import Corrected
from .term import TermValue


@dataclass(frozen=True, kw_only=True)
class Options:
    """SDPO's self-distillation fields, shared by every algorithm."""

    coef_field: ClassVar[str] = "self_distill_coef"
    """The field of the term's coefficient (0: the term is off)."""

    self_distill_coef: float = 0.0
    """w: + w·SeqMeanTokenMean(sg[log π_θ - log π_T]·log π_θ·min(sg[r], κ)), SDPO's token-level self-distillation
    (TRL `distillation_weight`, with `policy_coef` = 1 - w); 0 disables it. Needs `teacher_log_prob`."""
    self_distill_is_cap: float | None = 2.0
    """κ: the term is weighed by min(sg[π_θ/π_old], κ) (TRL `distillation_is_clip`); None: not weighed."""

    def self_distillation(self, max_log_ratio: float) -> SelfDistillation:
        """The term these fields configure (its checks run here)."""
        check(self.self_distill_coef >= 0, f"self_distill_coef must be >= 0, got {self.self_distill_coef}")
        check(
            self.self_distill_is_cap is None or self.self_distill_is_cap > 0,
            f"self_distill_is_cap must be > 0 or None, got {self.self_distill_is_cap}",
        )
        return SelfDistillation(self.self_distill_coef, self.self_distill_is_cap, max_log_ratio)


@dataclass(frozen=True)
class SelfDistillation:
    coef: float
    is_cap: float | None
    max_log_ratio: float
    loss_metric: str = "self_distill_loss"

    def needs(self) -> dict[str, str]:
        if self.coef == 0:
            return {}
        return {
            "teacher_log_prob": f"[B, T], the log-probs of the policy given the privileged context (SDPO's "
            f"teacher): self_distill_coef={self.coef} distils them"
        }

    def parts(self) -> tuple[Part, ...] | None:
        return (Part("seq-mean-token-mean", field="self_distill_coef"),) if self.coef != 0 else ()

    def evaluate(self, batch: TokenBatch, corrected: Corrected | None) -> TermValue:
        if self.coef == 0 or batch.teacher_log_prob is None:
            return TermValue()
        gap = (batch.log_prob - batch.teacher_log_prob).detach()
        per_token = gap * batch.log_prob
        if self.is_cap is not None:
            log_r = log_ratio(batch.log_prob, batch.old_log_prob).detach()
            per_token = per_token * log_r.clamp(-self.max_log_ratio, self.max_log_ratio).exp().clamp(max=self.is_cap)
        metrics = {"self_distill_gap": token_mean(torch.where(batch.mask, gap, 0.0), batch.mask)}
        return TermValue(metrics, torch.where(batch.mask, per_token, 0.0))
