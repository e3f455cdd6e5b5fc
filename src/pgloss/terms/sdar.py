"""SDAR's confidence-gated distillation (arXiv 2605.15155): + c · TokenMean(g_t · (log π_T(y_t) - log π_θ(y_t))),

    g_t = sg[σ(β·(log π_T(y_t) - log π_θ(y_t)))]

the teacher's (the policy given a privileged skill or context) log-prob gap on the sampled tokens, gated by how
much more confident the teacher is: minimising it raises log π_θ where the teacher is confident (g → 1) and
leaves it where the student already is (g → 0). The gradient flows through log π_θ only. β = 5
(`sdar_gate_beta`); c = 0 by default (off), 0.1 in the reference setting (0.01 for ALFWorld). Aggregated as a
token mean over the step's valid tokens, whatever the objective's `loss_agg_mode` (ms-swift's default mode).

Source: ms-swift 4.6.0 `swift/rl_core/advantage.py` `compute_sdar_loss` (a port of the reference's
`sdar_utils.py`), added to the reduced GRPO loss in `swift/rlhf_trainers/grpo_trainer.py` as
`loss + sdar_loss_coef * L_SDAR` (`sdar_loss_coef`, `sdar_gate_beta`). Deliberate difference: ms-swift's token
mean is over each micro-batch's tokens; pgloss's over the step's (split-invariant); one micro-batch agrees.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.batch import TokenBatch
from ..core.metrics import token_mean
from ..core.output import check
from ..core.row_set import Part
from ..correction.rollout import Corrected
from .term import TermValue


@dataclass(frozen=True, kw_only=True)
class Options:
    """SDAR's fields, shared by every algorithm."""

    coef_field: ClassVar[str] = "sdar_coef"
    """The field of the term's coefficient (0: the term is off)."""

    sdar_coef: float = 0.0
    """c: + c·TokenMean(sg[σ(β(log π_T - log π_θ))]·(log π_T - log π_θ)), SDAR's gated distillation (ms-swift
    `sdar_loss_coef`; 0.1 in the paper's setting); 0 disables it. Needs `teacher_log_prob`."""
    sdar_gate_beta: float = 5.0
    """β > 0, the sharpness of SDAR's gate σ(β·(log π_T - log π_θ)) (ms-swift `sdar_gate_beta`)."""

    def sdar(self) -> SDAR:
        """The term these fields configure (its checks run here)."""
        check(self.sdar_coef >= 0, f"sdar_coef must be >= 0, got {self.sdar_coef}")
        check(self.sdar_gate_beta > 0, f"sdar_gate_beta must be > 0, got {self.sdar_gate_beta}")
        return SDAR(self.sdar_coef, self.sdar_gate_beta)


@dataclass(frozen=True)
class SDAR:
    coef: float
    gate_beta: float
    loss_metric: str = "sdar_loss"

    def needs(self) -> dict[str, str]:
        if self.coef == 0:
            return {}
        return {
            "teacher_log_prob": f"[B, T], the teacher's log-probs of the sampled tokens: sdar_coef={self.coef} "
            "distils them where the teacher is the more confident"
        }

    def parts(self) -> tuple[Part, ...] | None:
        return (Part("token-mean", field="sdar_coef"),) if self.coef != 0 else ()

    def evaluate(self, batch: TokenBatch, corrected: Corrected | None) -> TermValue:
        if self.coef == 0 or batch.teacher_log_prob is None:
            return TermValue()
        gap = batch.teacher_log_prob - batch.log_prob
        gate = torch.sigmoid(self.gate_beta * gap.detach())
        metrics = {
            "sdar_gate": token_mean(torch.where(batch.mask, gate, 0.0), batch.mask),
            "sdar_gap": token_mean(torch.where(batch.mask, gap.detach(), 0.0), batch.mask),
        }
        return TermValue(metrics, torch.where(batch.mask, gate * gap, 0.0))
