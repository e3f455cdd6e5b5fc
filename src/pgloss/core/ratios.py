"""Importance ratios between the current policy π_θ and the policy that sampled, π_old.

Four levels, the vocabulary of verl's and TRL's `importance_sampling_level`:

- token (PPO, GRPO, DAPO):   r_{i,t} = π_θ(y_{i,t}|·) / π_old(y_{i,t}|·)
- sequence (GSPO, 2507.18071 eq. 7), length-normalised:
      s_i = (π_θ(y_i|x) / π_old(y_i|x))^{1/|y_i|} = exp( (1/|y_i|) Σ_t log r_{i,t} )
- sequence_token (GSPO-token, 2507.18071 eq. 13), the value of s_i with the gradient of each token:
      s_{i,t} = sg[s_i] · π_θ(y_{i,t}|·) / sg[π_θ(y_{i,t}|·)]
- sequence_product (the "sample level" loss of "OpenR1 in practice (6)", 2025-06-04), the whole-sequence likelihood ratio:
      ρ_i = π_θ(y_i|x) / π_old(y_i|x) = exp( Σ_t log r_{i,t} )

Sequence ratios come back as `[B, 1]` so they broadcast over tokens. Every log-ratio is clamped to
[-max_log_ratio, max_log_ratio] before `exp`; beyond the bound the gradient is zero (a ratio of e^20
is far outside any clip range, where PPO-style losses have no gradient anyway).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sequence_parallel import SequenceParallel, row_mean, row_sum

RATIO_LEVELS = ("token", "sequence", "sequence_token", "sequence_product")


def log_ratio(log_prob: Tensor, old_log_prob: Tensor) -> Tensor:
    """log r_{i,t} = log π_θ - log π_old, unclamped; `[B, T]`."""
    return log_prob - old_log_prob


def sequence_log_ratio(
    token_log_ratio: Tensor, mask: Tensor, *, length_normalized: bool, sequence_parallel: SequenceParallel | None = None
) -> Tensor:
    """Σ_t m_t log r_t, divided by |y_i| = Σ_t m_t when `length_normalized`; `[B, 1]`.

    A row with no valid token gets 0 (ratio one), never 0/0. Under a sequence group the sums are over the
    whole sequence (one all-reduce, differentiable: `core.sequence_parallel`).
    """
    masked = token_log_ratio * mask
    if length_normalized:
        return row_mean(masked, mask, sequence_parallel, keepdim=True)
    return row_sum(masked, sequence_parallel, keepdim=True)


def importance_ratio(
    log_prob: Tensor,
    old_log_prob: Tensor,
    mask: Tensor,
    *,
    level: str,
    max_log_ratio: float,
    token_log_ratio: Tensor | None = None,
    sequence_parallel: SequenceParallel | None = None,
) -> Tensor:
    """The importance ratio at `level` (see the module docstring), `[B, T]` or `[B, 1]`.
    `token_log_ratio`: log π_θ - log π_old when the caller has it (one pass less), with the gradient
    the ratio should carry. `sequence_parallel`: the sequence group of split rows (the sequence levels sum
    over whole sequences)."""
    token_log_ratio = log_ratio(log_prob, old_log_prob) if token_log_ratio is None else token_log_ratio
    if level == "token":
        log_r = token_log_ratio
    elif level == "sequence":
        log_r = sequence_log_ratio(token_log_ratio, mask, length_normalized=True, sequence_parallel=sequence_parallel)
    elif level == "sequence_product":
        log_r = sequence_log_ratio(token_log_ratio, mask, length_normalized=False, sequence_parallel=sequence_parallel)
    elif level == "sequence_token":
        seq = sequence_log_ratio(token_log_ratio, mask, length_normalized=True, sequence_parallel=sequence_parallel)
        # sg[log s_i] + log π_θ - sg[log π_θ]: value log s_i, gradient d log π_θ(y_t).
        log_r = seq.detach() + (log_prob - log_prob.detach())
    else:
        raise ValueError(f"level must be one of {RATIO_LEVELS}, got {level!r}")
    return torch.exp(log_r.clamp(-max_log_ratio, max_log_ratio))
