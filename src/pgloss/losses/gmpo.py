"""GMPO: the geometric mean of token ratios, clipped in log space (Zhao et al. 2025,
"Geometric-Mean Policy Optimization", https://arxiv.org/abs/2507.20673).

Per sequence i (minimisation form), with δ_t = log π_θ(y_t|·) - log π_old(y_t|·):

    δ*_t = sgn(A_t) · min( sgn(A_t)·δ_t, sgn(A_t)·clip(δ_t, -ε_low, ε_high) )
    ρ_i  = exp( Σ_t m_t δ*_t / |y_i| )                      (geometric mean of the clipped ratios)
    Â_i  = Σ_t m_t A_t / |y_i|
    L_i  = -Â_i · ρ_i

δ* is the one-sided clip of PPO moved to log space: for A > 0 only a rise above ε_high is cut, for
A < 0 only a fall below -ε_low; a token with A = 0 contributes δ* = 0. A clipped token has no
gradient; every other token's gradient is -Â_i·ρ_i/|y_i| · ∇log π_θ(y_t). The loss is the mean of
L_i over sequences (`loss_agg_mode` is fixed to seq-mean-token-mean).

Reference: verl `compute_policy_loss_geo_mean` (verl/trainer/ppo/core_algos.py, policy loss
`geo_mean`); TRL `trl/experimental/gmpo/gmpo_trainer.py` (the same δ*: min(δ, δ_c) for A > 0, else
max). The paper's ε is 0.4 on both sides. Deliberate differences from verl:

- verl reduces with `torch.mean` over the rows of each micro-batch, ignoring the step's counts;
  here the mean is over the step's non-empty sequences, so the gradient is split-invariant.
- the sequence log-ratio is clamped to ±max_log_ratio before `exp` (verl leaves that clamp
  commented out), so an exploding ratio gives a finite loss with zero gradient.
- |y_i| is clamped at 1 where verl adds 1e-8 (the same value on every non-empty row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.metrics import clip_metrics, ratio_metrics
from ..core.output import PolicyTerms, check
from ..core.ratios import log_ratio
from ..core.sequence_parallel import SequenceParallel, row_mean


def gmpo_clipped_log_ratio(token_log_ratio: Tensor, advantages: Tensor, *, clip_low: float, clip_high: float) -> Tensor:
    """δ*_t = sgn(A)·min(sgn(A)·δ, sgn(A)·clip(δ, -ε_low, ε_high)), `[B, T]`."""
    sign = torch.sign(advantages)
    clipped = token_log_ratio.clamp(-clip_low, clip_high)
    return sign * torch.minimum(sign * token_log_ratio, sign * clipped)


def gmpo_loss(
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float,
    clip_high: float,
    max_log_ratio: float,
    sequence_parallel: SequenceParallel | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(L_i copied onto its tokens `[B, T]`, ρ_i `[B, 1]`, the bool `[B, T]` map of clipped tokens).

    Args:
        token_log_ratio: δ = log π_θ - log π_old, `[B, T]`, finite at masked positions.
        advantages: A, `[B, T]`, detached.
        mask: bool `[B, T]`.
        clip_low, clip_high: ε_low, ε_high ≥ 0 on the log-ratio.
        max_log_ratio: the sequence log-ratio is clamped to ±max_log_ratio before exp.
        sequence_parallel: the sequence group of split rows (the means are over whole sequences).
    """
    starred = gmpo_clipped_log_ratio(token_log_ratio, advantages, clip_low=clip_low, clip_high=clip_high)
    m = mask.to(token_log_ratio.dtype)
    seq_log_ratio, seq_advantage = row_mean(
        torch.stack([starred * m, advantages * m]), m, sequence_parallel, keepdim=True
    )
    ratio = torch.exp(seq_log_ratio.clamp(-max_log_ratio, max_log_ratio))
    clipped = (starred != token_log_ratio).detach() & (advantages != 0) & mask
    return (-seq_advantage * ratio).expand_as(token_log_ratio), ratio, clipped


@dataclass(frozen=True, kw_only=True)
class GMPO(Algorithm):
    """ℓ_{i,t} = L_i = -Â_i · exp(mean_t δ*_t) (this module); the mean over sequences is fixed."""

    loss_agg_mode: str = "seq-mean-token-mean"
    clip_low: float = 0.4
    """ε_low: log-ratios below -ε_low are cut for Â < 0 (the paper's 0.4; verl `clip_ratio_low`)."""
    clip_high: float = 0.4
    """ε_high: log-ratios above ε_high are cut for Â > 0 (the paper's 0.4; verl `clip_ratio_high`)."""

    @property
    def fixed_agg_mode(self) -> str | None:
        return "seq-mean-token-mean"

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.clip_low >= 0, f"clip_low must be >= 0, got {self.clip_low}")
        check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        per_token, ratio, clipped = gmpo_loss(
            delta,
            batch.advantages,
            batch.mask,
            clip_low=self.clip_low,
            clip_high=self.clip_high,
            max_log_ratio=self.max_log_ratio,
            sequence_parallel=batch.sequence_parallel,
        )
        metrics = clip_metrics(clipped & (batch.advantages > 0), clipped & (batch.advantages < 0), batch.mask)
        metrics |= ratio_metrics(ratio, delta, batch.mask)
        return PolicyTerms(per_token, metrics)
