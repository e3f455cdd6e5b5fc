"""log π(y) and H straight from hidden states and an LM head, without materialising the N × V logits, and the checks
and the gathering of a head that every call from hidden states shares (`full_head`, `check_inputs`, `valid_targets`).

For hidden states x [B, T, H] and the LM head W [V, H] (its bias b [V] or none, its logit scale s and soft-cap c:
`head.HeadOptions`), the tempered logits of token n are

    z_n = c · tanh(s · (W x_n + b) / c) / τ        (s · (W x_n + b) / τ without a soft-cap)

and chunk by chunk over the N = B·T tokens

    log π(y_n) = z_{n,y} − lse(z_n),        H_n = lse(z_n) − Σᵥ π_{n,v} z_{n,v}

(`pgloss.vocab.entropy` holds the per-chunk math), on the backend the call's plan chose (`plan.plan`). The loss of an
algorithm from hidden states, which drives this loop, is `pgloss.from_hidden.loss_from_hidden` (a floor up, beside
the `Algorithm` it drives).
"""

from __future__ import annotations

import sys
from typing import overload

import torch
from torch import Tensor

from ..core.batch import check_mask
from .backends import TRITON_HEAD, Plan
from .chunks import ChunkLoop
from .entropy import LogProbEntropy, check_targets, check_temperature
from .head import HeadKind, HeadOptions, as_head, refuses_head_keywords
from .plan import plan
from .support import SupportLogProbEntropy, check_support

__all__ = ["log_prob_and_entropy_from_hidden", "full_head", "check_inputs", "valid_targets"]

MOVED = {"loss_from_hidden": "pgloss.from_hidden", "PASSED_INPUTS": "pgloss.from_hidden"}
"""The names this module held before the loss's driver moved a floor up, beside the `Algorithm` it drives."""


def __getattr__(name: str) -> object:
    """A moved name is refused with its new home (`from pgloss.vocab.fused import loss_from_hidden` included)."""
    if name in MOVED:
        raise ImportError(f"pgloss.vocab.fused.{name} moved to {MOVED[name]}.{name}: import it from there")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@overload
def full_head(weight: Tensor) -> Tensor: ...
@overload
def full_head(weight: None) -> None: ...
@overload
def full_head(weight: Tensor | None) -> Tensor | None: ...


def full_head(weight: Tensor | None) -> Tensor | None:
    """The whole LM head (or its bias) from an FSDP2-sharded one (a DTensor: `fully_shard` outside its
    forward), gathered once, its gradient averaged back onto the shards as FSDP2 averages every other
    parameter's; any other tensor (or None) is returned as it is.

    A bare `weight.full_tensor()` would hand each shard only its own rank's gradient: DTensor
    takes the gathered gradient for a replicated one. `Partial("avg")` says it is each rank's
    share, so backward reduce-scatters it (a mean over the data-parallel ranks, which the
    `Normalizer`'s `world_size` factor turns into the global loss's gradient).
    """
    # No tensor is a DTensor before its module is loaded: importing it here would cost every process 0.75 CPU s.
    if "torch.distributed.tensor" not in sys.modules:
        return weight
    from torch.distributed.tensor import DTensor, Partial

    if not isinstance(weight, DTensor):
        return weight
    return weight.full_tensor(grad_placements=[Partial("avg")] * weight.device_mesh.ndim)


@overload
def check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor) -> Tensor: ...
@overload
def check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor | None) -> Tensor | None: ...


def check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor | None) -> Tensor | None:
    """Types, shapes, dtypes and devices; token ids in [0, V) where `mask` is valid (everywhere
    when None). Returns the mask as bool (None without a mask)."""
    check_head_inputs(hidden, weight)
    if isinstance(targets, Tensor) and targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device} but hidden is on {hidden.device}")
    valid = None if mask is None else check_mask(mask, hidden.shape[:-1], hidden.device)
    check_targets(targets, hidden.shape[:-1], weight.shape[0], valid)
    return valid


def check_head_inputs(hidden: Tensor, weight: Tensor) -> None:
    """hidden [B, T, H] and weight [V, H]: types, shapes, dtypes and devices (`check_inputs` without token ids and
    mask, for a call that reads no token ids: the top-k divergence)."""
    for name, value, rank in (("hidden", hidden, 3), ("weight", weight, 2)):
        if not isinstance(value, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(value).__name__}")
        if not value.dtype.is_floating_point:
            raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")
        if value.dim() != rank:
            raise ValueError(f"{name} must have {rank} dimensions, got shape {tuple(value.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must have shape [V, {hidden.shape[-1]}] to match hidden, got {tuple(weight.shape)}")
    if weight.shape[0] < 1:
        raise ValueError(f"weight must have at least one row (V >= 1), got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight has dtype {weight.dtype} but hidden has {hidden.dtype}; cast both to one dtype (for a float32 "
            "head over half-precision hidden states, hidden.float(), as TRL's cast_lm_head_to_fp32 does)"
        )
    if weight.device != hidden.device:
        raise ValueError(f"weight is on {weight.device} but hidden is on {hidden.device}")


@refuses_head_keywords("")
def log_prob_and_entropy_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    head: HeadOptions | None = None,
    mask: Tensor | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """log π(y) and H of the tempered logits z / τ, each [B, T], without the [B, T, V] logits, where

        z = c · tanh(s · (hidden @ weightᵀ + bias) / c)        (s · (hidden @ weightᵀ + bias) without a soft-cap)

    (`head.HeadOptions`: TRL 1.16's order, bias, scale, soft-cap, then τ).

    Args:
        hidden: [B, T, H] floating hidden states.
        weight: [V, H] output projection of the same dtype and device.
        targets: [B, T] integer token ids in [0, V) (at valid positions, with a `mask`).
        temperature: τ > 0.
        head: the head's bias b ([V] of the weight's dtype and device, or None), logit scale s > 0 (Cohere's
            `logit_scale`; Granite's `logits_scaling` is 1/s) and soft-cap c > 0 of c · tanh(logits / c) (Gemma's
            `final_logit_softcapping`, or None), a `pgloss.HeadOptions` (None: the plain head x Wᵀ);
            `pgloss.integrations.lm_head.head_options(model)` reads them from a transformers model.
        mask: [B, T] bool or 0/1, the positions that count (None: all). Elsewhere hidden states and targets are
            never read (NaN, inf and -100 allowed: `chunks.HeadRows`), log π and H are 0 and pass no gradient.
        chunk_size: tokens per chunk; None picks about 2²⁷ / V.
        vocab_block: vocabulary columns per tile (None: the whole vocabulary); below V, log-sum-exp,
            log π(y) and H accumulate over tiles with an online max (`chunks.plan_tiles`).
        memory_budget: bytes for the loop's buffers, exclusive with chunk_size and vocab_block:
            the tiles are chosen from it (`chunks.plan_tiles`; a soft-cap adds one buffer, its slope).
        support: [B, T, k] integer token ids, the support the rollout sampled each position from (its top-k ids
            or top-p nucleus, padded with -1), or None (the whole vocabulary). Given, log π(y) and H are those of
            softmax(z) restricted to the support (`pgloss.vocab.support`: SkyRL's sample-support replay); a
            position with no id gives 0 and no gradient. Ids are checked at valid positions only. Torch route
            only (the kernel routes refuse it by name).

    Returns:
        (log_prob, entropy) [B, T] in float32 (float64 for float64 inputs), with gradients to
        hidden, weight and bias (whichever requires grad).
    """
    weight = full_head(weight)
    policy = as_head(head)
    policy = policy.with_bias(full_head(policy.bias))
    valid = check_inputs(hidden, weight, targets, mask)
    kind = policy.check(weight)
    temperature = check_temperature(temperature)
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    ids = None
    if support is not None:
        if isinstance(support, Tensor) and support.device != hidden.device:
            raise ValueError(f"support is on {support.device} but hidden is on {hidden.device}")
        ids = check_support(support, hidden.shape[:-1], weight.shape[0], valid)
    statistic = LogProbEntropy if ids is None else SupportLogProbEntropy
    tiles = plan(statistic, (kind,), weight, hidden.shape[0] * hidden.shape[1], **sizes)
    return log_prob_and_entropy_on_plan(hidden, weight, targets, policy.bias, kind, temperature, valid, tiles, ids)


def log_prob_and_entropy_on_plan(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None,
    kind: HeadKind,
    temperature: float,
    valid: Tensor | None,
    tiles: Plan,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`log_prob_and_entropy_from_hidden` on inputs already checked (the head gathered, `valid` the mask as bool
    or None, `support` None or the int64 ids of `support.check_support`), on the call's plan (`plan.plan`)."""
    batch, length, size = hidden.shape
    rows = None if valid is None else valid.reshape(-1)
    y = valid_targets(targets, valid).reshape(-1)
    statistic: LogProbEntropy | SupportLogProbEntropy
    if support is None:
        statistic = LogProbEntropy(y)
    else:
        statistic = SupportLogProbEntropy(y, support.reshape(batch * length, support.shape[-1]))
    flat = hidden.reshape(batch * length, size)
    if tiles.backend is TRITON_HEAD:  # the logits formed inside its kernels
        log_prob, entropy = TRITON_HEAD.run(statistic, kind, temperature, tiles.vocab_block, rows, flat, weight, bias)
    else:
        log_prob, entropy = ChunkLoop.apply(statistic, (kind,), temperature, tiles, rows, flat, weight, bias)
    log_prob, entropy = log_prob.view(batch, length), entropy.view(batch, length)
    if valid is None:
        return log_prob, entropy
    return torch.where(valid, log_prob, 0.0), torch.where(valid, entropy, 0.0)


def valid_targets(targets: Tensor, valid: Tensor | None) -> Tensor:
    """The targets as int64 token ids, 0 where not `valid` (their values there, e.g. -100, are never read)."""
    if valid is None:
        return targets.long()
    return torch.where(valid, targets, torch.zeros((), dtype=targets.dtype, device=targets.device)).long()
