"""M2PO's second-moment mask (AReaL 1.0.4 `_apply_m2po_masking`, "Second-Momentum PPO") for
decoupled, three-policy PPO.

Decoupled PPO (Hilton et al. 2022, arXiv 2110.00641; AReaL `ppo_actor_loss_fn`) clips the ratio
against a proximal policy π_prox and reweights by the behaviour policy that sampled, π_behave:

    ℓ_t = w_t · max(-Â r_t, -Â clip(r_t, 1-ε_low, 1+ε_high)),   r_t = π_θ/π_prox,   w_t = sg(π_prox/π_behave)

In pgloss that is any clipped algorithm called with `old_log_prob=` the proximal log-probs and
`rollout_log_prob=` the behaviour log-probs, with a `pgloss.RolloutCorrection` (token
weight; truncate or mask; AReaL keeps rejected tokens in the denominator: count the `Normalizer`
on the original masks).

M2PO masks the tokens whose second moment m2_t = (log π_behave - log π_prox)² is largest, the
fewest such that the mean m2 of the remaining valid tokens is below `threshold` (at least one
token is kept). AReaL applies it per micro-batch; here the cut is found over the whole step
(every micro-batch and rank, `m2po_cutoff`), so the mask does not depend on the split. With the
m2 values sorted in descending order, m2_(1) ≥ m2_(2) ≥ ... ≥ m2_(n), k is the smallest index with
mean(m2_(k+1..n)) < threshold (k = n - 1 when there is none), and a token is kept when
m2_t ≤ m2_(k+1). Tied values at the cut are all kept (AReaL masks an arbitrary part of them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor, per_micro_batch
from ..core.checks import check_cut, check_log_prob, check_number, check_valid_finite
from .token_masks import gather_values


def second_moment(behave_log_prob: Tensor, prox_log_prob: Tensor, mask: Tensor | None = None) -> Tensor:
    """m2_t = (log π_behave - log π_prox)², detached, float64; `[B, T]`. Log-probabilities are at
    most 0 where `mask` is valid (everywhere without one; a value check)."""
    behave = check_tensor("behave_log_prob", behave_log_prob, ndim=(2,))
    prox = check_tensor("prox_log_prob", prox_log_prob, ndim=(2,))
    if behave.shape != prox.shape:
        raise ValueError(
            f"behave_log_prob and prox_log_prob must share one shape, got {tuple(behave.shape)} and {tuple(prox.shape)}"
        )
    check_device("prox_log_prob", prox, behave.device, "behave_log_prob")
    if mask is not None:
        mask = check_mask(mask, behave.shape, behave.device, "behave_log_prob")
    check_log_prob("behave_log_prob", behave, mask)
    check_log_prob("prox_log_prob", prox, mask)
    return (behave.detach().to(torch.float64) - prox.detach().to(torch.float64)).square()


def m2po_cutoff(
    behave_log_probs: Tensor | Sequence[Tensor],
    prox_log_probs: Tensor | Sequence[Tensor],
    masks: Tensor | Sequence[Tensor],
    *,
    threshold: float,
    process_group: dist.ProcessGroup | None = None,
    reduce: bool = True,
) -> Tensor:
    """The largest m2 M2PO keeps over the step's micro-batches (and every rank when torch.distributed
    is initialized and `reduce`: a collective); 0-d float64, +inf when no token is valid."""
    if check_number("threshold", threshold) <= 0:
        raise ValueError(f"threshold must be a finite number > 0, got {threshold!r}")
    ms = per_micro_batch("masks", masks)
    behaves = per_micro_batch("behave_log_probs", behave_log_probs, len(ms))
    proxes = per_micro_batch("prox_log_probs", prox_log_probs, len(ms))
    values = []
    for k, (behave, prox, mask) in enumerate(zip(behaves, proxes, ms, strict=True)):
        m2 = second_moment(behave, prox, mask)
        mask = check_mask(mask, m2.shape, m2.device, "behave_log_prob")
        # A NaN m2 would sort first and shift the cut; the sort reads the host anyway.
        check_valid_finite(f"m2 of behave_log_probs[{k}] and prox_log_probs[{k}]", m2, mask)
        values.append(m2[mask])
    m2 = gather_values(torch.cat(values), process_group=process_group, reduce=reduce)
    if m2.numel() == 0:
        return m2.new_full((), math.inf)
    ordered = torch.sort(m2, descending=True).values
    tail_mean = ordered.flip(0).cumsum(0).flip(0) / torch.arange(len(ordered), 0, -1, dtype=m2.dtype, device=m2.device)
    below = tail_mean < threshold
    cut = torch.where(below.any(), below.to(torch.uint8).argmax(), len(ordered) - 1)
    return ordered[cut]


def m2po_mask(behave_log_prob: Tensor, prox_log_prob: Tensor, mask: Tensor, cutoff: Tensor | float) -> Tensor:
    """Bool `[B, T]`: the valid tokens with m2 ≤ `cutoff` (from `m2po_cutoff`; a real number or a
    0-d tensor, not NaN)."""
    m2 = second_moment(behave_log_prob, prox_log_prob, mask)
    mask = check_mask(mask, m2.shape, m2.device, "behave_log_prob")
    return mask & (m2 <= check_cut("cutoff", cutoff, m2.device))
