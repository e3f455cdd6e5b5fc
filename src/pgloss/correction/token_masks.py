"""Token masks that enter the one effective mask: the top-entropy-quantile mask and truncated-
completion masking.

Apply them to a micro-batch's mask *before* counting the step's `Normalizer`, and pass the result
as the loss's `mask`: the numerator, the denominator and every metric then count the same tokens.
(TRL multiplies its loss by the entropy mask and keeps the masked tokens in its denominator, the
problem of TRL PR#3744; ms-swift does the same with a local quantile.)

Top-entropy mask ("Beyond the 80/20 Rule", Wang et al. 2025, arXiv 2506.01939; TRL
`top_entropy_quantile`): keep the valid tokens whose entropy is at least the (1 - ρ) quantile of
the entropies of the step's valid tokens, ρ = `top` (0.2 in the paper). The quantile is global: over
every micro-batch and rank (`entropy_threshold`), as TRL gathers across processes and unlike
ms-swift's local `nanquantile`. It uses the entropies known before the step (those of the pass that
computes the old log-probs), so it does not depend on how the step is cut. torch.quantile's linear
interpolation, as TRL.

Truncated completions (TRL `mask_truncated_completions`, ms-swift `overlong_filter`, AReaL
`mask_no_eos_with_zero`): a response that ran out of budget without an end token is left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.batch import check_mask, check_tensor, per_micro_batch
from ..core.distributed import is_distributed
from ..core.checks import check_cut, check_number, check_valid_finite


def entropy_threshold(
    entropies: Tensor | Sequence[Tensor],
    masks: Tensor | Sequence[Tensor],
    *,
    top: float,
    process_group: "dist.ProcessGroup | None" = None,
    reduce: bool = True,
) -> Tensor:
    """The (1 - top) quantile of the valid entropies of the step's micro-batches (and, when
    torch.distributed is initialized and `reduce`, of every rank of `process_group`: a collective).
    0-d float64 tensor; -inf when no token is valid (then the mask keeps nothing anyway)."""
    if not 0 < check_number("top", top) <= 1:
        raise ValueError(f"top must be a share in (0, 1], got {top!r}")
    ms = per_micro_batch("masks", masks)
    ents = per_micro_batch("entropies", entropies, len(ms))
    values = []
    for k, (ent, mask) in enumerate(zip(ents, ms)):
        ent = check_tensor(f"entropies[{k}]", ent, ndim=(2,))
        mask = check_mask(mask, ent.shape, ent.device, f"entropies[{k}]")
        # One NaN would make the quantile NaN and the mask keep nothing; the quantile reads the host anyway.
        check_valid_finite(f"entropies[{k}]", ent.detach(), mask)
        values.append(ent.detach().to(torch.float64)[mask])
    local = gather_values(torch.cat(values), process_group=process_group, reduce=reduce)
    if local.numel() == 0:
        return local.new_tensor(-math.inf)
    return torch.quantile(local, 1.0 - top)


def gather_values(local: Tensor, *, process_group: "dist.ProcessGroup | None" = None, reduce: bool = True) -> Tensor:
    """The 1-d `local` values of every rank, concatenated in rank order (uneven lengths: padded for
    the all-gather, then cut); `local` itself outside torch.distributed or with `reduce=False`."""
    if not is_distributed(reduce):
        return local
    world = dist.get_world_size(process_group)
    size = torch.tensor([local.numel()], device=local.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=process_group)
    longest = max(int(s) for s in sizes)
    padded = torch.cat([local, local.new_zeros(longest - local.numel())])
    gathered = [torch.zeros_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded, group=process_group)
    return torch.cat([g[: int(s)] for g, s in zip(gathered, sizes)])


def top_entropy_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | float) -> Tensor:
    """Bool `[B, T]`: the valid tokens with entropy ≥ `threshold` (from `entropy_threshold`; a real
    number or a 0-d tensor, not NaN)."""
    entropy = check_tensor("entropy", entropy, ndim=(2,))
    mask = check_mask(mask, entropy.shape, entropy.device, "entropy")
    return mask & (entropy.detach().to(torch.float64) >= check_cut("threshold", threshold, entropy.device))


def truncated_completion_mask(mask: Tensor, finished: Tensor) -> Tensor:
    """Bool `[B, T]`: `mask` with the rows of unfinished (truncated, no end token) responses cleared.
    `finished` is bool `[B]`."""
    finished = check_tensor("finished", finished, ndim=(1,), floating=False)
    if finished.dtype != torch.bool:
        raise TypeError(f"finished must be a bool tensor, got {finished.dtype}")
    mask = check_tensor("mask", mask, ndim=(2,), floating=False)
    if finished.shape[0] != mask.shape[0]:
        raise ValueError(f"finished must have shape [{mask.shape[0]}], got {tuple(finished.shape)}")
    return check_mask(mask, mask.shape, mask.device) & finished[:, None].to(mask.device)
