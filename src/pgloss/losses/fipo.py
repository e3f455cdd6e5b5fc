"""FIPO's Future-KL influence weight (Ma et al. 2026, https://arxiv.org/abs/2603.19835).

FIPO keeps DAPO's clipped token loss and reweights each token by how much the current update is
already moving the rest of the response (ms-swift's Loss Types documentation and implementation):

    Δ_k        = m_k · log r_k                      (0 where r_k > δ when the δ cap is set)
    FutureKL_t = Σ_{k ≥ t} γ^{k-t} Δ_k,             γ = 2^(-1/decay_rate)
    f_t        = clip( exp(FutureKL_t), lo, 1 + ε_f ),   lo = 1 if clip_high_only else 1 - ε_f
                 (not clipped when ε_f is None)
    safety     : where A < 0 and r_t > safety_threshold,  f_t = clip(f_t, 1 - ε_f, 1)
    L_t        = sg[f_t] · L_clip,t

The safety rule keeps FIPO from amplifying the penalty on a bad token whose ratio has already
exploded (ms-swift hard-codes the interval [0.8, 1.0], which is [1 - ε_f, 1] at its default ε_f = 0.2;
with no clipping, ε_f = None, we use ms-swift's [0.8, 1.0]).
The weight is detached: it rescales the clipped loss's gradient and adds none of its own.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

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
    """
    with torch.no_grad():
        shift = torch.where(mask, token_log_ratio, 0.0)
        if delta is not None:
            shift = torch.where(ratio > delta, 0.0, shift)
        future = discounted_future_sum(shift, gamma=math.pow(2.0, -1.0 / decay_rate))
        future = torch.where(mask, future, 0.0)
        weight = torch.exp(future)
        if clip_range is not None:
            weight = weight.clamp(1.0 if clip_high_only else 1.0 - clip_range, 1.0 + clip_range)
        if safety_threshold is not None:
            unsafe = (advantages < 0) & (ratio > safety_threshold)
            safe_low = 1.0 - (_SAFETY_RANGE if clip_range is None else clip_range)
            weight = torch.where(unsafe, weight.clamp(safe_low, 1.0), weight)
    return weight, future
