"""REC: group-relative REINFORCE with a clip-indicator keep rule (Yao et al. 2025, "Group-Relative
REINFORCE Is Secretly an Off-Policy Algorithm", https://arxiv.org/abs/2509.24203).

Per token (minimisation form), with r = π_θ/π_old and sg the stop-gradient:

    L = -sg[w] · A · log π_θ(y_t) · M_t

REINFORCE whose off-policy tokens are dropped, not clipped: M_t ∈ {0, 1} keeps a token, w weighs it.

Keep rules M (`rec_clip_mode`), with ε = (clip_low, clip_high) and ε' = (ring_low, ring_high):
- "one-side" (REC-OneSide): A ≥ 0 keeps r ≤ 1 + ε_high, A ≤ 0 keeps r ≥ 1 - ε_low: the tokens whose
  PPO-clipped gradient would vanish are dropped;
- "two-side" (REC-TwoSide): 1 - ε_low ≤ r ≤ 1 + ε_high;
- "ring" (REC-Ring): 1 - ε_low ≤ r ≤ 1 + ε_high, or A ≥ 0 and r ≤ 1 - ε'_low, or A ≤ 0 and r ≥ 1 + ε'_high:
  besides the trust region, the far tokens whose update moves r back towards 1 are kept;
- "none": every token (REINFORCE with the group-mean baseline).

Weights w (`rec_weight`), all detached: "none" 1; "importance_sampling" r; "sequence_importance_sampling"
s_i = exp(mean_t log r), the length-normalised sequence ratio; "advantage" e^{A/τ} (RED-Weight, the
unnormalised advantage weighting), τ = `rec_temp`. The keep rule reads the unweighted A.

Reference: Trinity-RFT 0.6.0 `RECPolicyLossFn` (trinity/algorithm/policy_loss_fn/rec_policy_loss.py),
its variants in examples/rec_gsm8k: REC-OneSide-NoIS (ε = 0.2/0.2) and REC-Ring-NoIS (ε = 0.2/0.2,
ε' = 0.6/2.0), token-mean, advantages r - mean(r) without the std division (`RECGroupedAdvantage`,
std_normalize=False). Deliberate differences: Trinity computes s_i only in its experimental
"gspo-one-side" mode (its "gspo_importance_sampling" weight fails in any other mode), here it is a
weight of every mode; Trinity's "gspo-one-side" keep rule and its "k2" / "forward-kl" regularisers
are not carried (pgloss's KL term is to π_ref). The ratio is clamped at ±max_log_ratio in log space.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import clip_metrics, ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from .closed_form import GradientFactor

REC_CLIP_MODES = ("one-side", "two-side", "ring", "none")
REC_WEIGHTS = ("none", "importance_sampling", "sequence_importance_sampling", "advantage")


def rec_keep(
    ratio: Tensor,
    advantages: Tensor,
    *,
    mode: str,
    clip_low: float,
    clip_high: float,
    ring_low: float,
    ring_high: float,
) -> Tensor:
    """M_t, bool `[B, T]`: the tokens REC keeps (module docstring). `ratio` is r (read detached)."""
    r = ratio.detach()
    inside = (r >= 1.0 - clip_low) & (r <= 1.0 + clip_high)
    up, down = advantages >= 0, advantages <= 0
    if mode == "two-side":
        return inside
    if mode == "one-side":
        return (up & (r <= 1.0 + clip_high)) | (down & (r >= 1.0 - clip_low))
    if mode == "ring":
        return inside | (up & (r <= 1.0 - ring_low)) | (down & (r >= 1.0 + ring_high))
    if mode == "none":
        return torch.ones_like(r, dtype=torch.bool)
    raise ValueError(f"rec_clip_mode must be one of {REC_CLIP_MODES}, got {mode!r}")


def rec_weight(ratio: Tensor, sequence_ratio: Tensor | None, advantages: Tensor, *, weight: str, temp: float) -> Tensor:
    """w, detached, `[B, T]`: 1, r, s_i (`sequence_ratio`, `[B, 1]`, read by that weight alone) or e^{A/τ}."""
    if weight == "none":
        return torch.ones_like(ratio)
    if weight == "importance_sampling":
        return ratio.detach()
    if weight == "sequence_importance_sampling":
        if sequence_ratio is None:
            raise ValueError(
                "rec_weight='sequence_importance_sampling' weighs by the sequence ratio: pass sequence_ratio"
            )
        return sequence_ratio.detach().expand_as(ratio)
    if weight == "advantage":
        return torch.exp(advantages / temp).detach()
    raise ValueError(f"rec_weight must be one of {REC_WEIGHTS}, got {weight!r}")


def rec_loss(log_prob: Tensor, weight: Tensor, advantages: Tensor, keep: Tensor) -> Tensor:
    """-sg[w]·A·log π_θ·M per token, `[B, T]`."""
    return torch.where(keep, -weight.detach() * advantages * log_prob, 0.0)


@dataclass(frozen=True, kw_only=True)
class REC(Algorithm):
    """ℓ_{i,t} = -sg[w]·Â·log π_θ·M_{i,t} (`rec_loss`, `rec_keep`, `rec_weight`)."""

    clip_low: float = 0.2
    """ε_low: the lower edge 1 - ε_low of the kept ratios (Trinity `epsilon_low`)."""
    clip_high: float = 0.2
    """ε_high: the upper edge 1 + ε_high (Trinity `epsilon_high`)."""
    ring_low: float = 0.6
    """ε'_low of "ring": A ≥ 0 tokens with r ≤ 1 - ε'_low are kept (Trinity `epsilon_low_prime`)."""
    ring_high: float = 2.0
    """ε'_high of "ring": A ≤ 0 tokens with r ≥ 1 + ε'_high are kept (Trinity `epsilon_high_prime`)."""
    rec_clip_mode: str = "one-side"
    """The keep rule: "one-side", "two-side", "ring" or "none" (Trinity `clip_mode`)."""
    rec_weight: str = "none"
    """The detached weight: "none", "importance_sampling", "sequence_importance_sampling" or "advantage"."""
    rec_temp: float = 1.0
    """τ of the "advantage" weight e^{A/τ} (Trinity `temp`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(0 < self.clip_low <= 1, f"clip_low must be in (0, 1], got {self.clip_low}")
        check(self.clip_high > 0, f"clip_high must be > 0, got {self.clip_high}")
        check(0 < self.ring_low <= 1, f"ring_low must be in (0, 1], got {self.ring_low}")
        check(self.ring_high > 0, f"ring_high must be > 0, got {self.ring_high}")
        check(
            self.rec_clip_mode in REC_CLIP_MODES,
            f"rec_clip_mode must be one of {REC_CLIP_MODES}, got {self.rec_clip_mode!r}",
        )
        check(self.rec_weight in REC_WEIGHTS, f"rec_weight must be one of {REC_WEIGHTS}, got {self.rec_weight!r}")
        check(self.rec_temp > 0, f"rec_temp must be > 0, got {self.rec_temp}")

    def _parts(self, batch: TokenBatch) -> tuple[Tensor, Tensor, Tensor]:
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        sequence = None  # the sequence ratio is read by its weight alone (under a sequence group: a collective)
        if self.rec_weight == "sequence_importance_sampling":
            sequence = importance_ratio(
                batch.log_prob,
                batch.old_log_prob,
                batch.mask,
                level="sequence",
                max_log_ratio=self.max_log_ratio,
                sequence_parallel=batch.sequence_parallel,
            )
        keep = rec_keep(
            ratio,
            batch.advantages,
            mode=self.rec_clip_mode,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            ring_low=self.ring_low,
            ring_high=self.ring_high,
        )
        weight = rec_weight(ratio, sequence, batch.advantages, weight=self.rec_weight, temp=self.rec_temp)
        return ratio, keep, weight

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio, keep, weight = self._parts(batch)
        r = ratio.detach()
        metrics = clip_metrics(~keep & (r > 1.0), ~keep & (r <= 1.0), batch.mask)
        metrics |= ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        metrics["rec_weight_mean"] = token_mean(weight, batch.mask)
        advantages = batch.advantages.expand_as(batch.log_prob)
        return PolicyTerms(rec_loss(batch.log_prob, weight, advantages, keep), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = sg[w]·M: the detached weight on the kept tokens."""
        _, keep, weight = self._parts(batch)
        return GradientFactor(torch.where(keep, weight, 0.0), "REC: f = sg[w]·M, a detached weight on kept tokens")
