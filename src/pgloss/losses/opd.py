"""On-policy distillation: the teacher's per-token reverse KL as the advantage of a policy gradient.

The student samples y; the teacher scores the same tokens (`teacher_log_prob`, log π_T(y_t)). With
the sampling policy's log-probs log π_old and the per-token sample of -KL(π_old‖π_T),

    a_t = log π_T(y_t) - log π_old(y_t)
    w_t = 1 + γ·(1 - Σ_{s<t} |a_s| / max(Σ_s |a_s|, ε))          (IW-OPD; γ = 0: w = 1)
    A_t = Â_t + λ·w_t·a_t                                        (Â: the given advantages, 0 for pure distillation)
    A_t = Â_t + Σ_{s≥t} γ_KL^(s-t)·λ·w_s·a_s                     (with `opd_discount` γ_KL > 0, tinker-cookbook's)

and the loss per token is the importance-sampled policy gradient -r·A, r = π_θ/π_old
(`opd_surrogate="ratio"`), or REINFORCE's -log π_θ·A (`"log_prob"`); both have the gradient -A·∇log π_θ
at r = 1. A is detached: the student moves toward the teacher's likely tokens through the policy
gradient, and minimising E[-A] over its own samples minimises the reverse KL(π_θ‖π_T), mode-seeking,
on the states the student visits (Agarwal et al., GKD, arXiv 2306.13649; Lu & Thinking Machines,
"On-Policy Distillation", 2025).

IW-OPD (Xie et al., "On the Position Bias of On-Policy Distillation", arXiv 2606.22600) weighs a token
by how little teacher-student discrepancy its prefix has accumulated: w runs from 1 + γ at the first
token down to 1 at the last, so early tokens (whose errors compound) count more.

References: tinker-cookbook `distillation/train_on_policy.py` (advantages = -λ·(log π_sample - log π_T)
added to the environment's, the `importance_sampling` loss -r·A; λ `kl_penalty_coef` = 1); TRL 1.16
`IWOPDTrainer._compute_iw_opd_loss` (trl/experimental/iw_opd: -log π_θ·w·a, γ = `iw_opd_gamma` = 0.5,
ε = 1e-8, token mean). Deliberate difference: the sampling policy here is `old_log_prob` (pass the
inference engine's log-probs there to use them); TRL takes its rollout log-probs when it has them, else
the student's current log-probs detached, which equal `old_log_prob` on the first epoch.
prime-rl (trainer/rl/loss.py `ref_kl_loss_fn`) compares the teacher with the current log π_θ
(`opd_advantage_policy="current"`) and drops the policy term where π_θ - π_old < -0.2
(`opd_trust_region=0.2`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..advantages.returns import discounted_returns
from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from ..core.sequence_parallel import along_sequence
from .closed_form import GradientFactor

OPD_SURROGATES = ("ratio", "log_prob")
OPD_ADVANTAGE_POLICIES = ("old", "current")


def distillation_advantage(teacher_log_prob: Tensor, old_log_prob: Tensor, mask: Tensor) -> Tensor:
    """a_t = log π_T(y_t) - log π_old(y_t), detached, 0 where masked, `[B, T]`."""
    return torch.where(mask, teacher_log_prob - old_log_prob, 0.0).detach()


def position_weights(advantage: Tensor, *, gamma: float, eps: float = 1e-8) -> Tensor:
    """IW-OPD's w_t = 1 + γ·(1 - Σ_{s<t}|a_s| / max(Σ_s|a_s|, ε)), `[B, T]` (a is 0 where masked)."""
    size = advantage.abs()
    before = size.cumsum(dim=-1) - size
    total = size.sum(dim=-1, keepdim=True).clamp(min=eps)
    return 1.0 + gamma * (1.0 - before / total)


@dataclass(frozen=True, kw_only=True)
class OPD(Algorithm):
    """ℓ_{i,t} = -r·A or -log π_θ·A with A = Â + λ·w·(log π_T - log π_old) (`distillation_advantage`,
    `position_weights`). Needs `teacher_log_prob`."""

    opd_coef: float = 1.0
    """λ, the weight of the teacher's advantage beside the given one (tinker-cookbook `kl_penalty_coef`)."""
    opd_position_gamma: float = 0.0
    """γ of IW-OPD's position weights; 0 is plain on-policy distillation (TRL `iw_opd_gamma` = 0.5)."""
    opd_position_eps: float = 1e-8
    """ε, the floor of a row's Σ|a| in the position weights (TRL `iw_opd_epsilon`)."""
    opd_surrogate: str = "ratio"
    """"ratio": -r·A, the importance-sampled gradient (tinker-cookbook); "log_prob": -log π_θ·A (TRL IW-OPD)."""
    opd_advantage_policy: str = "old"
    """Whose log-probs the teacher's are compared with: "old", a = log π_T - log π_old, the sampling policy's
    (GKD, tinker-cookbook, TRL); "current", a = log π_T - log π_θ, detached (prime-rl `ref_kl_loss_fn`)."""
    opd_discount: float = 0.0
    """γ_KL: the teacher's term becomes its discounted sum over the row's valid tokens from t on,
    Σ_{s≥t} γ^(s-t)·λ·w_s·a_s (tinker-cookbook `kl_discount_factor`, 0 by default: each token its own)."""
    opd_trust_region: float | None = None
    """δ: a token's policy term is dropped where π_θ - π_old < -δ, its probability fell by more than δ
    (kept in the token count); None keeps every token (prime-rl: 0.2)."""

    required_inputs = ("teacher_log_prob",)

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.opd_coef > 0, f"opd_coef must be > 0, got {self.opd_coef}")
        check(self.opd_position_gamma >= 0, f"opd_position_gamma must be >= 0, got {self.opd_position_gamma}")
        check(self.opd_position_eps > 0, f"opd_position_eps must be > 0, got {self.opd_position_eps}")
        check(
            self.opd_surrogate in OPD_SURROGATES,
            f"opd_surrogate must be one of {OPD_SURROGATES}, got {self.opd_surrogate!r}",
        )
        check(
            self.opd_advantage_policy in OPD_ADVANTAGE_POLICIES,
            f"opd_advantage_policy must be one of {OPD_ADVANTAGE_POLICIES}, got {self.opd_advantage_policy!r}",
        )
        check(0 <= self.opd_discount <= 1, f"opd_discount must lie in [0, 1], got {self.opd_discount}")
        check(
            self.opd_trust_region is None or self.opd_trust_region > 0,
            f"opd_trust_region must be > 0 or None, got {self.opd_trust_region}",
        )

    def advantages(self, batch: TokenBatch) -> tuple[Tensor, Tensor, Tensor]:
        """(A, a, w), each `[B, T]` and detached."""
        if batch.teacher_log_prob is None:
            raise ValueError(f"{self.name} distils a teacher and needs teacher_log_prob=[B, T] in the call")
        student = batch.old_log_prob if self.opd_advantage_policy == "old" else batch.log_prob
        a = distillation_advantage(batch.teacher_log_prob, student, batch.mask)
        # w and the discount read a whole row in order (under a sequence group: gathered, `along_sequence`)
        split = batch.sequence_parallel if self.opd_position_gamma != 0 else None  # γ = 0: w = 1, no collective
        w = along_sequence(
            lambda rows: position_weights(rows, gamma=self.opd_position_gamma, eps=self.opd_position_eps), a, split
        )
        teacher = self.opd_coef * w * a
        if self.opd_discount > 0:
            teacher = along_sequence(
                lambda rows: discounted_returns(rows[0], rows[1] != 0, gamma=self.opd_discount),
                torch.stack([teacher, batch.mask.to(teacher.dtype)]),
                batch.sequence_parallel,
            )
        return batch.advantages + teacher, a, w

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        advantages, a, w = self.advantages(batch)
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        surrogate = ratio if self.opd_surrogate == "ratio" else batch.log_prob
        per_token = -surrogate * advantages
        metrics = ratio_metrics(ratio, delta, batch.mask)
        if self.opd_trust_region is not None:
            dropped = batch.log_prob.detach().exp() - batch.old_log_prob.exp() < -self.opd_trust_region
            per_token = torch.where(dropped, 0.0, per_token)
            metrics["opd_trust_region_frac"] = token_mean(dropped.to(delta.dtype), batch.mask)
        metrics["teacher_reverse_kl"] = token_mean(-a, batch.mask)  # the k1 sample of KL(π_old‖π_T) (or π_θ's)
        metrics["opd_position_weight"] = token_mean(w, batch.mask)
        return PolicyTerms(per_token, metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        return GradientFactor(None, "OPD: the advantage is the teacher's A = Â + λ·w·a, not the given Â")
