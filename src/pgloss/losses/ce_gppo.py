"""CE-GPPO: PPO's clip in the forward pass, a bounded gradient kept outside the clip band
("CE-GPPO: Controlling Entropy via Gradient-Preserving Clipping Policy Optimization in
Reinforcement Learning", Su et al. 2025, paper/CE-GPPO.pdf in https://github.com/Kwai-Klear/CE-GPPO).

PPO zeroes the gradient of a token once its ratio leaves [1-ε_low, 1+ε_high] in the direction its
advantage pushes. CE-GPPO keeps the clipped value but lets a scaled gradient through, with
r/sg[r] = 1 in value and ∇log π_θ in gradient:

    low  = A < 0 and r < 1 - ε_low
    high = A > 0 and r > 1 + ε_high
    L = -β₁·(1 - ε_low)·(r/sg[r])·A       on low
    L = -β₂·(1 + ε_high)·(r/sg[r])·A      on high
    L = -r·A                               elsewhere
    then for A < 0:  L = min(L, -c·A)      (dual clip, no gradient where it binds)

The gradient on low tokens is -β₁(1-ε_low)·A·∇log π_θ, on high ones -β₂(1+ε_high)·A·∇log π_θ.
Defaults of the reference code: β₁ = 0.75, β₂ = 1, c = 3. It reads ε from its trainer config; ours
is DAPO's band ε_low = 0.2, ε_high = 0.28. β₁ = β₂ = 1 is GPPO (Klear-Reasoner, Su et al. 2025,
https://arxiv.org/abs/2508.07629); with β = 1 the forward value equals the clipped surrogate's.

Reference: `compute_gppo_loss_general_beta` in Kwai-Klear/CE-GPPO (README.md, commit d5abd5c);
no framework ships it. At r = 1 no bound is active: the gradient is REINFORCE's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import clip_metrics, ratio_metrics
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio


@dataclass(frozen=True)
class GradientPreservingClip:
    """Per-token loss and where each branch was taken (bool, `[B, T]`)."""

    loss: Tensor
    clipped_high: Tensor
    clipped_low: Tensor
    clipped_dual: Tensor


def ce_gppo_loss(
    log_ratio: Tensor,
    advantages: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    beta_low: float,
    beta_high: float,
    dual_clip: float | None,
) -> GradientPreservingClip:
    """CE-GPPO's per-token loss; see the module docstring.

    Args:
        log_ratio: log r = log π_θ - log π_old, already clamped, `[B, T]`; r = exp(log r), and
            r/sg[r] = exp(log r - sg[log r]), exactly 1 in value even where r underflows.
        advantages: A, `[B, T]`, detached.
        clip_low, clip_high: ε_low, ε_high ≥ 0.
        beta_low, beta_high: β₁, β₂ ≥ 0, the gradient scales on the low and high branches.
        dual_clip: c > 1 or None.
    """
    ratio = torch.exp(log_ratio)
    negative, positive = advantages < 0, advantages > 0
    low = negative & (ratio.detach() < 1.0 - clip_low)
    high = positive & (ratio.detach() > 1.0 + clip_high)
    straight = torch.exp(log_ratio - log_ratio.detach())  # not ratio / sg[ratio]: 0/0 where exp underflows
    loss = torch.where(
        low,
        -beta_low * (1.0 - clip_low) * straight * advantages,
        torch.where(high, -beta_high * (1.0 + clip_high) * straight * advantages, -ratio * advantages),
    )
    dual = torch.zeros_like(low)
    if dual_clip is not None:
        bound = -dual_clip * advantages
        dual = negative & (loss > bound)
        loss = torch.where(dual, bound, loss)
    return GradientPreservingClip(loss=loss, clipped_high=high, clipped_low=low, clipped_dual=dual)


@dataclass(frozen=True, kw_only=True)
class CEGPPO(Algorithm):
    """CE-GPPO's gradient-preserving clip (`ce_gppo_loss`)."""

    clip_low: float = 0.2
    """ε_low: the lower bound is 1 - clip_low."""
    clip_high: float = 0.28
    """ε_high: the upper bound is 1 + clip_high."""
    gppo_beta_low: float = 0.75
    """β₁, the gradient scale of clipped tokens with Â < 0 (reference `gppo_loss_beta1`)."""
    gppo_beta_high: float = 1.0
    """β₂, the gradient scale of clipped tokens with Â > 0 (reference `gppo_loss_beta2`)."""
    dual_clip: float | None = 3.0
    """c > 1: for Â < 0 the loss is at most -c·Â (reference `clip_ratio_c`); None disables it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.clip_low >= 0, f"clip_low must be >= 0, got {self.clip_low}")
        check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        check(
            self.gppo_beta_low >= 0 and self.gppo_beta_high >= 0,
            f"gppo_beta_low and gppo_beta_high must be >= 0, got {self.gppo_beta_low}, {self.gppo_beta_high}",
        )
        if self.dual_clip is not None:
            check(self.dual_clip > 1, f"dual_clip must be > 1, got {self.dual_clip}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        token_log_ratio = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        out = ce_gppo_loss(
            token_log_ratio.clamp(-self.max_log_ratio, self.max_log_ratio),
            batch.advantages,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            beta_low=self.gppo_beta_low,
            beta_high=self.gppo_beta_high,
            dual_clip=self.dual_clip,
        )
        metrics = clip_metrics(
            out.clipped_high, out.clipped_low, batch.mask, None if self.dual_clip is None else out.clipped_dual
        )
        metrics |= ratio_metrics(ratio, token_log_ratio, batch.mask)
        return PolicyTerms(out.loss, metrics)
