"""Token masks that enter the one effective mask: the top-entropy-quantile mask, truncated-
completion masking and the entropy-discriminator clipping of Clip_B and Clip_V (at the end).

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
from ..core.checks import check_cut, check_number, check_valid_finite
from ..core.distributed import all_reduce, is_distributed


def entropy_threshold(
    entropies: Tensor | Sequence[Tensor],
    masks: Tensor | Sequence[Tensor],
    *,
    top: float,
    process_group: dist.ProcessGroup | None = None,
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
    for k, (ent, mask) in enumerate(zip(ents, ms, strict=True)):
        ent = check_tensor(f"entropies[{k}]", ent, ndim=(2,))
        mask = check_mask(mask, ent.shape, ent.device, f"entropies[{k}]")
        # One NaN would make the quantile NaN and the mask keep nothing; the quantile reads the host anyway.
        check_valid_finite(f"entropies[{k}]", ent.detach(), mask)
        values.append(ent.detach().to(torch.float64)[mask])
    local = gather_values(torch.cat(values), process_group=process_group, reduce=reduce)
    if local.numel() == 0:
        return local.new_full((), -math.inf)
    return torch.quantile(local, 1.0 - top)


def gather_values(local: Tensor, *, process_group: dist.ProcessGroup | None = None, reduce: bool = True) -> Tensor:
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
    return torch.cat([g[: int(s)] for g, s in zip(gathered, sizes, strict=True)])


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


# -- entropy-discriminator clipping (Clip_B, Clip_V) -----------------------------------------------


def _token_advantages(advantages: Tensor, shape: torch.Size, device: torch.device) -> Tensor:
    advantages = check_tensor("advantages", advantages, ndim=(1, 2))
    if advantages.shape != shape and advantages.shape != shape[:1]:
        raise ValueError(f"advantages must have shape {tuple(shape)} or [{shape[0]}], got {tuple(advantages.shape)}")
    if advantages.device != device:
        raise ValueError(f"advantages is on {advantages.device}, log_prob on {device}")
    adv = advantages.detach().to(torch.float64)
    return (adv[:, None] if adv.ndim == 1 else adv).expand(shape)


def _masked_moments(values: Tensor, mask: Tensor, process_group, reduce: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(count, mean, population std) of `values` over the valid tokens of every rank: two passes."""
    totals = all_reduce(
        torch.stack([torch.where(mask, values, 0.0).sum(), mask.sum().to(torch.float64)]), process_group, reduce
    )
    count = totals[1].clamp(min=1)
    mean = totals[0] / count
    sq = all_reduce(torch.where(mask, values - mean, 0.0).square().sum().reshape(1), process_group, reduce)[0]
    return count, mean, (sq / count).sqrt()


def _discriminator_inputs(log_prob: Tensor, entropy: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    log_prob = check_tensor("log_prob", log_prob, ndim=(2,))
    entropy = check_tensor("entropy", entropy, ndim=(2,))
    if entropy.shape != log_prob.shape:
        raise ValueError(f"entropy must have shape {tuple(log_prob.shape)}, got {tuple(entropy.shape)}")
    mask = check_mask(mask, log_prob.shape, log_prob.device, "log_prob")
    lp = torch.where(mask, log_prob.detach().to(torch.float64), 0.0)
    h = torch.where(mask, entropy.detach().to(torch.float64), 0.0)
    return lp.exp() * (h + lp), mask  # S = p (H + log p)


def clip_b_mask(
    log_prob: Tensor,
    entropy: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mu: float = 2.5,
    process_group: dist.ProcessGroup | None = None,
    reduce: bool = True,
) -> Tensor:
    """Clip_B (Wang et al. 2026, "On the Entropy Dynamics in Reinforcement Fine-Tuning of LLMs",
    arXiv 2602.03392; Trinity-RFT 0.6.0 `algorithm/advantage_fn/clipb_advantage.py`), bool `[B, T]`.

    A logit step ε on the sampled token k changes the entropy by ΔH = -ε S + O(ε²) with the entropy
    discriminator S = p_k (H + log p_k). Penalising a token (Â < 0, ε < 0) moves the entropy by |ε| S:
    the negative-advantage tokens with S far below the batch's mean lower it most. Clip_B drops those
    whose S lies more than μ standard deviations below the mean:

        keep_t = m_t ∧ (Â_t ≥ 0 ∨ S_t - mean(S) ≥ -μ σ(S))

    mean and σ (population) over the valid tokens of the step (all ranks); every token is kept when
    σ < 1e-12. `log_prob` and `entropy` are the old policy's (the pass that computes the old
    log-probs), `advantages` `[B]` or `[B, T]`. Pass the result as the loss's mask, as the other token
    masks (Trinity replaces `response_mask` with it). No host read."""
    mu = check_number("mu", mu)
    if mu <= 0:
        raise ValueError(f"mu must be > 0, got {mu}")
    s, mask = _discriminator_inputs(log_prob, entropy, mask)
    adv = _token_advantages(advantages, s.shape, s.device)
    _, mean, std = _masked_moments(s, mask, process_group, reduce)
    keep = (adv >= 0) | (s - mean >= -mu * std) | (std < 1e-12)
    return mask & keep


def clip_v_mask(
    log_prob: Tensor,
    entropy: Tensor,
    expected_discriminator: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    mu: float = 8.5,
    max_frac: float = 1e-4,
    convention: str = "pgloss",
    process_group: dist.ProcessGroup | None = None,
    reduce: bool = True,
) -> Tensor:
    """Clip_V (arXiv 2602.03392; Trinity-RFT 0.6.0 `algorithm/advantage_fn/clipv_advantage.py`),
    bool `[B, T]`: clip the negative-advantage tokens whose first-order entropy change is an outlier,
    at most a share `max_frac` of the step's valid tokens.

    Over a whole softmax step the entropy moves by ΔH ∝ Â (N - S) with S = p_k (H + log p_k) and
    N = E_{v∼π}[S_v] = Σ_v π_v² (H + log π_v) (`expected_discriminator`, `[B, T]`; Trinity reads it
    from the batch as `necs`). With D = N - S (mean 0 under π):

        clip_t = m_t ∧ Â_t < 0 ∧ D_t > μ σ(D)          σ the population std over the step's valid tokens

    and when more than max(⌊max_frac · n⌋, 1) = K tokens would be clipped (n the valid tokens), only
    the K with the largest D are (a tie at the K-th value clips every tied token; Trinity's `topk` picks
    among them). Every token is kept when σ < 1e-12.

    `convention="trinity"`: Trinity's test also clips zero-advantage tokens with D > μσ (its `keep`
    is `Â > 0 ∨ D ≤ μσ`), and counts them against the share; the cap then re-admits only negative
    ones. Zero-advantage tokens carry no policy gradient but enter the loss's token count.
    One host read for the cap's K-th largest D under torch.distributed (the values are gathered);
    none on one process."""
    mu, max_frac = check_number("mu", mu), check_number("max_frac", max_frac)
    if mu <= 0 or not 0 < max_frac <= 1:
        raise ValueError(f"need mu > 0 and max_frac in (0, 1], got mu={mu}, max_frac={max_frac}")
    if convention not in ("pgloss", "trinity"):
        raise ValueError(f"convention must be 'pgloss' or 'trinity', got {convention!r}")
    s, mask = _discriminator_inputs(log_prob, entropy, mask)
    n_exp = check_tensor("expected_discriminator", expected_discriminator, ndim=(2,))
    if n_exp.shape != s.shape:
        raise ValueError(f"expected_discriminator must have shape {tuple(s.shape)}, got {tuple(n_exp.shape)}")
    d = torch.where(mask, n_exp.detach().to(torch.float64), 0.0) - s
    adv = _token_advantages(advantages, s.shape, s.device)
    count, _, std = _masked_moments(d, mask, process_group, reduce)
    outlier = mask & (d > mu * std)
    negative = outlier & (adv < 0)
    test = outlier & (adv <= 0) if convention == "trinity" else negative
    counts = all_reduce(torch.stack([test.sum(), negative.sum()]).to(torch.float64), process_group, reduce)
    k = torch.clamp(torch.floor(max_frac * count), min=1)
    capped = (counts[0] / count > max_frac) & (counts[1] > k)
    # the K-th largest D among the negative outliers of the step (all ranks)
    ranked = gather_values(torch.where(negative, d, -math.inf).flatten(), process_group=process_group, reduce=reduce)
    ranked = torch.sort(ranked, descending=True).values
    at = (k.to(torch.long) - 1).clamp(max=ranked.numel() - 1).reshape(1)
    kth = ranked.gather(0, at)[0] if ranked.numel() else d.new_full((), math.inf)  # a gather: no host read
    clipped = torch.where(capped, (test & ~negative) | (negative & (d >= kth)), test)
    return mask & ~(clipped & (std >= 1e-12))
