"""The token covariance that Clip-Cov and KL-Cov act on, and the selection they share (Cui et al. 2025,
"The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
https://arxiv.org/abs/2505.22617). The families: `clip_cov.py` (a random draw of tokens detached from the
gradient) and `kl_cov.py` (a |log r| penalty on the top-k tokens).

Both score each valid token by the centred product of its advantage and log-probability, with
means over the valid tokens of the call:

    cov_t = (A_t - mean_m A) · (log π_θ(y_t) - mean_m log π_θ)        (detached)

and act on k = max(⌊ratio·N⌋, 1) of them, N the valid tokens (`selection_size`). k stays a tensor, so a
call runs on `meta` tensors and under `torch.compile`.

The selection is a function of the tokens of one call: the means, N and the draw couple every
token of the batch it is given. Split a step into micro-batches and each selects among its own
tokens, as in verl. To select over the whole step instead, take the step's selection before its
micro-batches, `algorithm.step_selection(log_probs, ...)` (every micro-batch and, under
torch.distributed, every rank: the means, N, the draw or the top-k are the step's; `step_covariance`,
`StepTokens`), and give each micro-batch's call its part, `dataclasses.replace(algorithm, selection=part)`.
Everything else (the surrogate, the aggregation) is split-invariant, so the step's loss and gradient then
do not depend on the split. The covariance reads the current policy's log-probs, which a trainer sees one
micro-batch at a time: take them from a no-grad forward pass over the step (the parameters do not
change within a step), or pass the old log-probs where the step is on-policy (π_θ = π_old at its
first update). One process's step selection on its whole batch is exactly `clip_cov_loss`'s and
`kl_cov_loss`'s selection on that batch (the same keys from the same generator state; the same top-k).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.batch import check_mask, check_tensor, per_micro_batch
from ..core.distributed import is_distributed
from ..correction.token_masks import gather_values


def token_covariance(log_prob: Tensor, advantages: Tensor, mask: Tensor) -> Tensor:
    """cov_t = (A - mean_m A)(log π - mean_m log π) over the valid tokens, detached, `[B, T]`."""
    m = mask.to(log_prob.dtype)
    count = m.sum().clamp(min=1)
    lp = log_prob.detach()
    mean_a = (advantages * m).sum() / count
    mean_lp = (lp * m).sum() / count
    return (advantages - mean_a) * (lp - mean_lp)


def selection_size(ratio: float, mask: Tensor) -> Tensor:
    """k = max(⌊ratio · N_valid⌋, 1), as verl, as a 0-d int64 tensor (no host sync)."""
    return (ratio * mask.sum(dtype=torch.float64)).floor().clamp(min=1).long()


def first_ranked(keys: Tensor, count: Tensor | int, *, descending: bool) -> Tensor:
    """Bool map (the shape of `keys`) of the `count` positions first in the order of `keys`, ties
    in row-major order; `count` may be a 0-d tensor: no host sync."""
    flat = keys.reshape(-1)
    order = flat.argsort(descending=descending, stable=True)
    rank = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=flat.device))
    return (rank < count).view(keys.shape)


class StepTokens:
    """The valid tokens of a step's micro-batches on this rank, in order (micro-batch, then row-major),
    and where this rank's tokens sit among every rank's (rank order)."""

    def __init__(self, masks: list[Tensor], *, process_group: dist.ProcessGroup | None, reduce: bool) -> None:
        self.masks = masks
        self.index = [m.reshape(-1).nonzero().squeeze(-1) for m in masks]
        self.count = sum(len(i) for i in self.index)
        device = masks[0].device
        sizes = gather_values(torch.tensor([self.count], device=device), process_group=process_group, reduce=reduce)
        rank = dist.get_rank(process_group) if is_distributed(reduce) else 0
        self.offset = int(sizes[:rank].sum())
        self.total = int(sizes.sum())

    def values(self, tensors: list[Tensor]) -> Tensor:
        """The valid values of `tensors` (one per micro-batch), concatenated, 1-d."""
        return torch.cat([t.reshape(-1)[i] for t, i in zip(tensors, self.index, strict=True)])

    def scatter(self, chosen: Tensor) -> list[Tensor]:
        """Bool maps, one per micro-batch, of the local tokens at positions `chosen` (of `values`)."""
        flags = torch.zeros(self.count, dtype=torch.bool, device=chosen.device).index_fill(0, chosen, True)
        out, start = [], 0
        for mask, index in zip(self.masks, self.index, strict=True):
            part = flags[start : start + len(index)].to(mask.device)
            out.append(
                torch.zeros(mask.numel(), dtype=torch.bool, device=mask.device)
                .index_fill(0, index[part], True)
                .view_as(mask)
            )
            start += len(index)
        return out

    def local(self, global_index: Tensor) -> Tensor:
        """The global positions (every rank's tokens, in rank order) that are this rank's, as local positions."""
        mine = (global_index >= self.offset) & (global_index < self.offset + self.count)
        return global_index[mine] - self.offset


def step_covariance(
    log_probs: Tensor | Sequence[Tensor],
    advantages: Tensor | Sequence[Tensor],
    masks: Tensor | Sequence[Tensor],
    *,
    process_group: dist.ProcessGroup | None = None,
    reduce: bool = True,
) -> list[Tensor]:
    """cov_t = (A_t - mean A)(log π_t - mean log π) with the means over the step's valid tokens (every
    micro-batch, and every rank when torch.distributed is initialized and `reduce`: a collective);
    one detached `[B, T]` tensor per micro-batch. `advantages` `[B]` or `[B, T]` per micro-batch."""
    ms = [check_mask(m, m.shape, m.device) for m in per_micro_batch("masks", masks)]
    lps = [check_tensor("log_probs", lp, ndim=(2,)).detach() for lp in per_micro_batch("log_probs", log_probs, len(ms))]
    advs = [
        check_tensor("advantages", a, ndim=(1, 2)).detach() for a in per_micro_batch("advantages", advantages, len(ms))
    ]
    advs = [a[:, None].expand_as(m) if a.ndim == 1 else a for a, m in zip(advs, ms, strict=True)]
    for k, (lp, a, m) in enumerate(zip(lps, advs, ms, strict=True)):
        if lp.shape != m.shape or a.shape != m.shape:
            raise ValueError(
                f"micro-batch {k}: log_probs, advantages and masks must share one [B, T] shape, got "
                f"{tuple(lp.shape)}, {tuple(a.shape)}, {tuple(m.shape)}"
            )
    dtype = torch.float64 if lps[0].dtype == torch.float64 else torch.float32
    zero = torch.zeros((), dtype=torch.float64, device=ms[0].device)  # the sums over micro-batches, in float64
    sums = torch.stack(
        [
            sum((torch.where(m, a, 0.0).sum() for a, m in zip(advs, ms, strict=True)), zero),
            sum((torch.where(m, lp, 0.0).sum() for lp, m in zip(lps, ms, strict=True)), zero),
            sum((m.sum() for m in ms), zero),
        ]
    )
    if is_distributed(reduce):
        dist.all_reduce(sums, group=process_group)
    count = sums[2].clamp(min=1)
    mean_a, mean_lp = (sums[0] / count).to(dtype), (sums[1] / count).to(dtype)
    return [
        torch.where(m, (a.to(dtype) - mean_a) * (lp.to(dtype) - mean_lp), 0.0)
        for a, lp, m in zip(advs, lps, ms, strict=True)
    ]


SPLIT_SELECTION = (
    "its token selection is drawn among a call's own tokens, a slice of each sequence; take the "
    "step's with step_selection(..., process_group=<every rank holding the step's tokens>) and give "
    "each call its part, dataclasses.replace(algorithm, selection=part)"
)
"""Why Clip-Cov and KL-Cov without a `selection` refuse sequences split across ranks (`sequence_split_refusal`)."""


def check_selection(selection: object, mask: Tensor) -> Tensor | None:
    """A family's `selection` field for this call: None, or a bool tensor of the call's shape, moved to its device."""
    if selection is None:
        return None
    if not isinstance(selection, Tensor) or selection.dtype != torch.bool or selection.shape != mask.shape:
        raise ValueError(
            f"selection must be a bool tensor of the call's shape {tuple(mask.shape)} (this call's part of "
            f"step_selection), got {getattr(selection, 'dtype', type(selection).__name__)} "
            f"{tuple(getattr(selection, 'shape', ()))}"
        )
    return selection.to(mask.device)
