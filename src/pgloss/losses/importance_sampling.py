"""The importance-sampled policy gradient on the ratio itself, and prime-rl's IPO trust region around it.

Per token (minimisation form), with r = π_θ/π_old (π_old: the policy that sampled, the inference engine's
log-probs where the trainer has no recomputed ones) and keep_t = [|π_θ(y_t) - π_old(y_t)| ≤ δ]:

    importance_sampling   ℓ = -Â·r
    ipo                   ℓ = -keep_t·Â·r + τ·(log r)²

The gradient of -Â·r is -Â·r·∇log π_θ: REINFORCE at r = 1, importance-weighted off-policy, without a clip.

- `importance_sampling`: Tinker's loss of that name (tinker-cookbook `rl/train.py` `loss_fn="importance_sampling"`,
  the Tinker docs' "policy gradient: importance_sampling": -Σ_t r_t·A_t, a sum over the tokens); SkyRL 0.4
  `importance_sampling_loss` (skyrl/backends/skyrl_train/utils/ppo_utils.py: -(exp(log π_θ - log π_old)·A), summed
  over the mask after the trainer scales the advantages for `loss_reduction`) and Trinity-RFT's.
- `ipo`: prime-rl `ipo_loss_fn` (src/prime_rl/trainer/rl/loss.py; `IPOLossConfig`: `ipo_threshold` δ = 0.1,
  `kl_tau` τ = 1e-3, `adv_tau` = 1): a token whose probability moved by more than δ either way leaves the policy
  term, whatever the sign of its advantage, and keeps its (log r)² term; `compute_loss` divides the step's sum by
  its token count (token-mean). prime-rl's `adv_tau` multiplies the advantages, which the caller gives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from .closed_form import GradientFactor


def probability_trust_region(log_prob: Tensor, old_log_prob: Tensor, *, threshold: float) -> Tensor:
    """keep_t = |π_θ(y_t) - π_old(y_t)| ≤ δ, bool `[B, T]` (prime-rl IPO's symmetric trust region)."""
    return (log_prob.detach().exp() - old_log_prob.exp()).abs() <= threshold


def importance_sampling_loss(
    ratio: Tensor, log_ratio_: Tensor, advantages: Tensor, keep: Tensor | None, *, kl_tau: float
) -> Tensor:
    """-keep·Â·r + τ·(log r)² per token, `[B, T]` (keep None: every token)."""
    policy = -advantages * ratio
    if keep is not None:
        policy = torch.where(keep, policy, 0.0)
    return policy + kl_tau * log_ratio_.square() if kl_tau != 0 else policy


@dataclass(frozen=True, kw_only=True)
class ImportanceSampling(Algorithm):
    """ℓ_{i,t} = -keep_t·Â·r + τ·(log r)² (`importance_sampling_loss`, `probability_trust_region`)."""

    ipo_threshold: float | None = None
    """δ: the policy term of a token with |π_θ - π_old| > δ is dropped; None keeps every token (prime-rl
    `ipo_threshold` = 0.1)."""
    ipo_kl_tau: float = 0.0
    """τ, the weight of the squared log-ratio (log r)² on every valid token (prime-rl `kl_tau` = 1e-3)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(
            self.ipo_threshold is None or 0 < self.ipo_threshold,
            f"ipo_threshold must be > 0 or None, got {self.ipo_threshold}",
        )
        check(self.ipo_kl_tau >= 0, f"ipo_kl_tau must be >= 0, got {self.ipo_kl_tau}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob,
            batch.old_log_prob,
            batch.mask,
            level="token",
            max_log_ratio=self.max_log_ratio,
            token_log_ratio=delta,
        )
        metrics = ratio_metrics(ratio, delta, batch.mask)
        keep = None
        if self.ipo_threshold is not None:
            keep = probability_trust_region(batch.log_prob, batch.old_log_prob, threshold=self.ipo_threshold)
            metrics["ipo_masked_frac"] = token_mean((~keep).to(delta.dtype), batch.mask)
        per_token = importance_sampling_loss(ratio, delta, batch.advantages, keep, kl_tau=self.ipo_kl_tau)
        return PolicyTerms(per_token, metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = keep·r without the (log r)² term; with it the gradient is not Â·f."""
        if self.ipo_kl_tau != 0:
            return GradientFactor(None, "IPO: f = keep·r plus 2τ·log r/Â from the (log r)² term, not a factor of Â")
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        ).detach()
        if self.ipo_threshold is not None:
            keep = probability_trust_region(batch.log_prob, batch.old_log_prob, threshold=self.ipo_threshold)
            ratio = torch.where(keep, ratio, 0.0)
        return GradientFactor(ratio, "importance sampling: f = keep·r, the unclipped ratio")
