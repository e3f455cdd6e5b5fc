"""CHORD: on-policy RL and SFT on expert data in one loss, with a global weight μ and a per-token weight φ
(arXiv 2508.11408, "On-Policy RL Meets Off-Policy Experts: Harmonizing Supervised Fine-Tuning and
Reinforcement Learning via Dynamic Weighting").

With `expert` the `[B]` flags of the demonstration rows (E) and the others on-policy (U):

    L = (1 − μ) · Agg_U( ℓ^PPO_{i,t} ) + μ · Agg_E( ℓ^SFT_{i,t} )

    ℓ^SFT = −sg[φ(p)] · log p,  φ(p) = p(1 − p),  p = π_θ(y_t)       sft_weight="phi" (CHORD-φ)
    ℓ^SFT = −log p                                                  sft_weight="none" (CHORD-μ, plain SFT)
    ℓ^SFT = −sg[p] · log p                                          sft_weight="is" (Trinity's sft_is)

Each part is aggregated over its own rows with the step's counts of those rows (`policy_parts`: the row sets
`ON_POLICY` and `EXPERT`, which the step's count counts apart): Agg_U with `loss_agg_mode`, Agg_E with
`sft_loss_agg_mode` (default: the same).
φ vanishes at p → 0 and p → 1: it keeps the expert tokens the policy is unsure of and damps both the
ones it already knows and the ones far from it. With `sft_cutoff_prob` c < 1 (φ only, as Trinity)
log p is clamped at log c: a token with p > c gets no gradient. ℓ^PPO is `ClippedPolicy`'s (Trinity's
`PPOPolicyLossFn`: clip 0.2, dual clip 3). μ is a field: set it per step from the schedule
`pgloss.controllers.MuSchedule` (warm-up, cosine decay, floor), as Trinity's `mu_schedule_function`.

Reference: Trinity-RFT 0.6.0 `MIXCHORDPolicyLossFn`, `SFTPhiLossFn`, `SFTISLossFn`
(trinity/algorithm/policy_loss_fn/chord_policy_loss.py) and `SFTLossFn` (sft_loss.py). Trinity takes
each micro-batch's own token means of its U and E rows, weighted by the micro-batch's share of the
mini-batch's U (E) rows; pgloss divides by the step's counts of U (E), which is the same for one
micro-batch per step (docs/reference.md has the measured difference otherwise). Trinity's `mix`
entropy bonus covers the U rows only; pgloss's KL and entropy terms cover every row.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.metrics import token_mean
from ..core.output import PolicyTerms, check
from ..core.row_set import Part, RowSet
from .closed_form import GradientFactor
from .ppo import ClippedPolicy

SFT_WEIGHTS = ("phi", "none", "is")

EXPERT = RowSet("expert", "expert", "expert rows", lambda flags: flags != 0)
"""The demonstration rows (E): those flagged in `expert`; none when the call has no flags."""
ON_POLICY = RowSet("on_policy", "expert", "on-policy rows", lambda flags: flags == 0, absent=True)
"""The on-policy rows (U): those not flagged in `expert`; every row when the call has no flags."""


def sft_per_token(log_prob: Tensor, *, weight: str = "phi", cutoff_prob: float = 1.0) -> Tensor:
    """ℓ^SFT per token (see the module docstring), `[B, T]`: the weights φ(p) and p are detached."""
    if weight == "none":
        return -log_prob
    p = log_prob.detach().exp()
    if weight == "is":
        return -log_prob * p
    target = log_prob if cutoff_prob >= 1.0 else log_prob.clamp(max=math.log(cutoff_prob))
    return -target * (p * (1.0 - p))


@dataclass(frozen=True, kw_only=True)
class CHORD(ClippedPolicy):
    """(1 − μ)·Agg_U(ℓ^PPO) + μ·Agg_E(ℓ^SFT) over the on-policy (U) and expert (E) rows (`expert`)."""

    chord_mu: float = 0.1
    """μ ∈ [0, 1], the SFT part's weight this step (Trinity `mu_peak` = `mu_valley` = 0.1: constant);
    `pgloss.controllers.MuSchedule` sets it per step."""
    sft_weight: str = "phi"
    """The expert tokens' weight: "phi" (p(1−p), CHORD-φ), "none" (plain SFT), "is" (p)."""
    sft_cutoff_prob: float = 1.0
    """c ∈ (0, 1]: with "phi", log p is clamped at log c (no gradient where p > c); 1 disables it."""
    sft_loss_agg_mode: str | None = None
    """The SFT part's aggregation over the expert rows (None: `loss_agg_mode`, as Trinity)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0.0 <= self.chord_mu <= 1.0, f"chord_mu must lie in [0, 1], got {self.chord_mu}")
        check(self.sft_weight in SFT_WEIGHTS, f"sft_weight must be one of {SFT_WEIGHTS}, got {self.sft_weight!r}")
        check(0.0 < self.sft_cutoff_prob <= 1.0, f"sft_cutoff_prob must lie in (0, 1], got {self.sft_cutoff_prob}")
        check(
            self.sft_cutoff_prob == 1.0 or self.sft_weight == "phi",
            f"sft_cutoff_prob applies to sft_weight='phi' only (Trinity's SFTPhiLossFn), got "
            f"sft_weight={self.sft_weight!r}",
        )

    def policy_parts(self) -> tuple[Part, ...]:
        """Agg_U over the on-policy rows with `loss_agg_mode`, Agg_E over the expert rows with
        `sft_loss_agg_mode` (None: the same), each over its own rows' counts."""
        sft = self.loss_agg_mode if self.sft_loss_agg_mode is None else self.sft_loss_agg_mode
        return (Part(self.loss_agg_mode, ON_POLICY), Part(sft, EXPERT, "sft_loss_agg_mode"))

    def _expert_rows(self, batch: TokenBatch) -> Tensor:
        if batch.expert is None:
            return torch.zeros(batch.mask.shape[0], dtype=torch.bool, device=batch.mask.device)
        return batch.expert

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        expert = self._expert_rows(batch)[:, None]
        on_policy = super().policy_terms(batch.restricted(batch.mask & ~expert))
        sft = sft_per_token(batch.log_prob, weight=self.sft_weight, cutoff_prob=self.sft_cutoff_prob)
        metrics = dict(on_policy.metrics)
        if batch.expert is not None:  # the expert tokens' mean ℓ^SFT (NaN over none, as every token mean)
            metrics["sft_loss"] = token_mean(sft.detach(), batch.mask & expert)
        mu = self.chord_mu
        return PolicyTerms(torch.where(expert, mu * sft, (1.0 - mu) * on_policy.per_token), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """(1 − μ) times the clipped family's f on the on-policy rows; none when the call holds expert tokens
        (their gradient, −μ·sg[φ]·w, has no advantage to factor)."""
        if batch.expert is not None and bool((batch.mask & batch.expert[:, None]).any()):
            return GradientFactor(None, "CHORD's expert rows carry an SFT term (−sg[φ(p)]·log p): no −Â·f·w form")
        clipped = super().gradient_factor(batch)
        if clipped.factor is None:
            return clipped
        return dataclasses.replace(
            clipped, factor=(1.0 - self.chord_mu) * clipped.factor, reason=clipped.reason + ", times 1 − μ"
        )
