"""CISPO: clip the importance-sampling weight, not the update (MiniMax-M1, https://arxiv.org/abs/2506.13585).

Per token (minimisation form, paper eq. 4-5):

    L = -sg[ r̂ ] · A · log π_θ(y_t|·),     r̂ = clip(r, 1 - ε_low^IS, 1 + ε_high^IS)

The weight is detached, so every token keeps the REINFORCE gradient -r̂·A·∇log π_θ, scaled but
never zeroed: where PPO's gradient vanishes, CISPO's does not.

Two conventions are in use, chosen by `cispo_convention`:
- "relative" (the paper; verl, slime, NeMo-RL, ROLL): r̂ = clip(r, 1 - clip_low, 1 + clip_high).
  The paper sets ε_low^IS "to a large value" (no lower bound) and tunes only ε_high^IS: here
  `clip_low=None` by default; verl clips below at 1 - clip_ratio_low (pass `clip_low`).
- "absolute" (TRL, ms-swift, Liger; ms-swift's Loss Types documentation): r̂ = min(r, ε_high), with
  `clip_high` the cap itself and no lower bound. TRL's default cap is its `epsilon` = 0.2, which
  down-weights every token with r > 0.2: set `clip_high` explicitly (e.g. 5.0) when porting.
The default is the paper's relative form with cap 1 + 4 = 5.
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
from .closed_form import GradientFactor

CISPO_CONVENTIONS = ("relative", "absolute")


def cispo_cap(clip_high: float, convention: str) -> float:
    """The upper bound of r̂: 1 + clip_high ("relative") or clip_high itself ("absolute")."""
    if convention not in CISPO_CONVENTIONS:
        raise ValueError(f"cispo_convention must be one of {CISPO_CONVENTIONS}, got {convention!r}")
    return clip_high if convention == "absolute" else 1.0 + clip_high


def cispo_weight(ratio: Tensor, *, clip_low: float | None, clip_high: float, convention: str = "relative") -> Tensor:
    """r̂ = clip(r, 1 - clip_low, cap), detached, cap = `cispo_cap(clip_high, convention)`; no lower
    bound when `clip_low` is None."""
    lower = None if clip_low is None else 1.0 - clip_low
    return ratio.detach().clamp(min=lower, max=cispo_cap(clip_high, convention))


def cispo_loss(log_prob: Tensor, weight: Tensor, advantages: Tensor) -> Tensor:
    """-sg[r̂]·A·log π_θ per token; `weight` is `cispo_weight(...)`, `[B, T]`."""
    return -weight.detach() * advantages * log_prob


@dataclass(frozen=True, kw_only=True)
class CISPO(Algorithm):
    """ℓ_{i,t} = -sg[r̂] · Â · log π_θ, r̂ = clip(r, 1 - ε_low, 1 + ε_high) or min(r, ε_high) (this module)."""

    clip_low: float | None = None
    """ε_low^IS; None: no lower bound (the paper). verl clips at 1 - clip_ratio_low."""
    clip_high: float = 4.0
    """ε_high^IS: the weight is capped at 1 + clip_high ("relative") or at clip_high ("absolute", TRL's
    `epsilon_high`)."""
    cispo_convention: str = "relative"
    """"relative" (the paper, verl, slime, NeMo-RL) or "absolute" (TRL, ms-swift, Liger): see the module."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_low is not None:
            check(self.clip_low >= 0, f"clip_low must be >= 0 or None, got {self.clip_low}")
        check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        check(
            self.cispo_convention in CISPO_CONVENTIONS,
            f"cispo_convention must be one of {CISPO_CONVENTIONS}, got {self.cispo_convention!r}",
        )
        if self.cispo_convention == "absolute":
            check(
                self.clip_low is None, f"cispo_convention='absolute' has no lower bound; got clip_low={self.clip_low}"
            )
            check(self.clip_high > 0, f"cispo_convention='absolute' needs a cap clip_high > 0, got {self.clip_high}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        weight = cispo_weight(ratio, clip_low=self.clip_low, clip_high=self.clip_high, convention=self.cispo_convention)
        high = ratio.detach() > cispo_cap(self.clip_high, self.cispo_convention)
        low = torch.zeros_like(high) if self.clip_low is None else ratio.detach() < 1.0 - self.clip_low
        metrics = clip_metrics(high, low, batch.mask)
        metrics |= ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        return PolicyTerms(cispo_loss(batch.log_prob, weight, batch.advantages), metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = r̂ (`cispo_weight`), the detached weight."""
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        weight = cispo_weight(ratio, clip_low=self.clip_low, clip_high=self.clip_high, convention=self.cispo_convention)
        return GradientFactor(weight, "CISPO: f = clip(r), a detached weight")
