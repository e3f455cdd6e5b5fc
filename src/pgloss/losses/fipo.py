"""FIPO's Future-KL influence weight (Ma et al. 2026, https://arxiv.org/abs/2603.19835).

FIPO keeps DAPO's clipped token loss and reweights each token by how much the current update is
already moving the rest of the response (ms-swift's Loss Types documentation and implementation):

    Δ_k        = m_k · clamp(log r_k, ±M)           (0 where r_k > δ when the δ cap is set)
    FutureKL_t = Σ_{k ≥ t} γ^{k-t} Δ_k,             γ = 2^(-1/decay_rate)
    f_t        = clip( exp(clamp(FutureKL_t, ±M)), lo, 1 + ε_f ),   lo = 1 if clip_high_only else 1 - ε_f
                 (not clipped when ε_f is None)
    safety     : where A < 0 and r_t > safety_threshold,  f_t = clip(f_t, 1 - ε_f, 1)
    L_t        = sg[f_t] · L_clip,t

The safety rule keeps FIPO from amplifying the penalty on a bad token whose ratio has already
exploded (ms-swift hard-codes the interval [0.8, 1.0], which is [1 - ε_f, 1] at its default ε_f = 0.2;
with no clipping, ε_f = None, we use ms-swift's [0.8, 1.0]).
The weight is detached: it rescales the clipped loss's gradient and adds none of its own.
M is `max_log_ratio`, the clamp of every log-ratio before exp (the ratio r uses the same one): the
Future-KL and its weight stay finite for any finite log-probabilities.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.batch import TokenBatch
from ..core.metrics import token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import log_ratio
from ..core.sequence_parallel import SequenceParallel, along_sequence
from .closed_form import GradientFactor
from .ppo import ClippedPolicy

_BLOCK = 128
_SAFETY_RANGE = 0.2  # ms-swift's fixed safety interval [0.8, 1.0], used when the weight is not clipped


def discounted_future_sum(values: Tensor, *, gamma: float) -> Tensor:
    """F_t = Σ_{k ≥ t} γ^{k-t} x_k along the last dimension, `[B, T]`.

    Computed in blocks of 128 positions: inside a block by a small triangular matrix of powers of γ,
    across blocks by carrying F at the block's end. Exact for any length, with no γ^{-T} overflow.
    """
    length = values.shape[-1]
    out = torch.empty_like(values)
    idx = torch.arange(_BLOCK, device=values.device)
    distance = idx[None, :] - idx[:, None]  # k - t
    decay = torch.where(distance >= 0, gamma ** distance.clamp(min=0).to(values.dtype), 0.0).to(values.dtype)
    carry = values.new_zeros(values.shape[:-1])
    for end in range(length, 0, -_BLOCK):
        start = max(0, end - _BLOCK)
        size = end - start
        block = values[..., start:end]
        tail = gamma ** torch.arange(size, 0, -1, device=values.device, dtype=values.dtype)  # γ^{end - t}
        out[..., start:end] = block @ decay[:size, :size].T + carry[..., None] * tail
        carry = out[..., start]
    return out


def fipo_influence(
    token_log_ratio: Tensor,
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    decay_rate: float,
    clip_range: float | None,
    clip_high_only: bool,
    safety_threshold: float | None,
    delta: float | None,
    max_log_ratio: float,
    sequence_parallel: SequenceParallel | None = None,
) -> tuple[Tensor, Tensor]:
    """The detached influence weight f and the Future-KL it came from, both `[B, T]`.

    Args:
        token_log_ratio: log r, `[B, T]`, zero at masked positions.
        ratio: r = exp(clamped log r), `[B, T]`.
        advantages: Â, `[B, T]`.
        mask: bool `[B, T]`.
        decay_rate: half-life in tokens; γ = 2^(-1/decay_rate).
        clip_range: ε_f; f is clipped to [1 - ε_f, 1 + ε_f] ([1, 1 + ε_f] if `clip_high_only`); None: no clip.
        safety_threshold: ratio above which a negative-advantage token's weight is held in [1 - ε_f, 1].
        delta: tokens with r > δ do not contribute to the Future-KL (None: all contribute).
        max_log_ratio: M, the clamp of each log r and of the Future-KL before exp.
        sequence_parallel: the sequence group of split rows: the Future-KL runs over the whole sequence.
    """
    with torch.no_grad():
        shift = torch.where(mask, token_log_ratio.clamp(-max_log_ratio, max_log_ratio), 0.0)
        if delta is not None:
            shift = torch.where(ratio > delta, 0.0, shift)
        gamma = math.pow(2.0, -1.0 / decay_rate)
        future = along_sequence(lambda rows: discounted_future_sum(rows, gamma=gamma), shift, sequence_parallel)
        future = torch.where(mask, future, 0.0)
        weight = torch.exp(future.clamp(-max_log_ratio, max_log_ratio))
        if clip_range is not None:
            weight = weight.clamp(1.0 if clip_high_only else 1.0 - clip_range, 1.0 + clip_range)
        if safety_threshold is not None:
            unsafe = (advantages < 0) & (ratio > safety_threshold)
            safe_low = 1.0 - (_SAFETY_RANGE if clip_range is None else clip_range)
            weight = torch.where(unsafe, weight.clamp(safe_low, 1.0), weight)
    return weight, future


@dataclass(frozen=True, kw_only=True)
class FIPO(ClippedPolicy):
    """DAPO's clipped token loss reweighted by the detached Future-KL influence (losses/fipo.py):
    ℓ_{i,t} = sg[f_{i,t}] · max(-Â·r, -Â·clip(r, 1-ε_low, 1+ε_high)), with the δ cap.

    The defaults are the paper's 32B headline run (Table 2 and the authors' 32B launcher): weight
    clipped to [1, 1.2] (high only), safety threshold 10, dual clip c = 10 (here δ = 10, which for
    Â < 0 is the dual clip and also keeps tokens with r > δ out of the Future-KL, as ms-swift does).
    The 7B run (Table 3): `fipo_clip_high_only=False, fipo_safety_threshold=3.0`. ms-swift's
    defaults: `fipo_clip_high_only=True, fipo_safety_threshold=4.0, delta=None`.
    """

    fipo_decay_rate: float = 32.0
    """Half-life of the Future-KL discount in tokens: γ = 2^(-1/fipo_decay_rate)."""
    fipo_clip_range: float | None = 0.2
    """ε_f in (0, 1): the weight is clipped to [1 - ε_f, 1 + ε_f] (or [1, 1 + ε_f]); None: not clipped."""
    fipo_clip_high_only: bool = True
    """Clip the weight to [1, 1 + ε_f] instead of [1 - ε_f, 1 + ε_f]."""
    fipo_safety_threshold: float | None = 10.0
    """For Â < 0 and r above this, the weight is held in [1 - ε_f, 1] ([0.8, 1] when ε_f is None); None disables it."""

    def __post_init__(self) -> None:
        # FIPO's own constraint first, so that a sequence ratio_level is named as the culprit
        # rather than the loss_agg_mode it would otherwise conflict with.
        check(self.ratio_level == "token", f"fipo uses token ratios, got ratio_level={self.ratio_level!r}")
        super().__post_init__()
        check(self.fipo_decay_rate > 0, f"fipo_decay_rate must be > 0, got {self.fipo_decay_rate}")
        if self.fipo_clip_range is not None:
            check(
                0 < self.fipo_clip_range < 1,
                f"fipo_clip_range must lie in (0, 1), or be None for no clipping "
                f"(ms-swift's 0), got {self.fipo_clip_range}",
            )
        if self.fipo_safety_threshold is not None:
            check(
                self.fipo_safety_threshold > 0, f"fipo_safety_threshold must be > 0, got {self.fipo_safety_threshold}"
            )

    def _influence(self, batch: TokenBatch) -> tuple[Tensor, Tensor]:
        """(the detached influence weight, the future KL) of `batch`'s tokens (`fipo_influence`), read by the
        loss and by its closed-form gradient."""
        return fipo_influence(
            log_ratio(batch.log_prob, batch.old_log_prob),
            self.ratio(batch),
            batch.advantages,
            batch.mask,
            decay_rate=self.fipo_decay_rate,
            clip_range=self.fipo_clip_range,
            clip_high_only=self.fipo_clip_high_only,
            safety_threshold=self.fipo_safety_threshold,
            delta=self.delta,
            max_log_ratio=self.max_log_ratio,
            sequence_parallel=batch.sequence_parallel,
        )

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        terms = super().policy_terms(batch)
        weight, future = self._influence(batch)
        metrics = terms.metrics | {
            "fipo_weight_mean": token_mean(weight, batch.mask),
            "fipo_future_kl_mean": token_mean(future, batch.mask),
        }
        return PolicyTerms(weight * terms.per_token, metrics)

    def gradient_factor(self, batch: TokenBatch) -> GradientFactor:
        """f = sg[influence]·r·b(r): the clipped token loss's factor times the detached weight."""
        clipped = super().gradient_factor(batch)
        if clipped.factor is None:
            return clipped
        influence, _ = self._influence(batch)
        return GradientFactor(influence * clipped.factor, "FIPO: f = sg[influence]·r·b(r)")
