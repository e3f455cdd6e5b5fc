"""The loss straight from hidden states, without materialising the N × V logits.

For hidden states x [B, T, H] and the LM head W [V, H] (its bias b [V] or none, its logit scale s
and soft-cap c: `head.HeadOptions`), the tempered logits of token n are

    z_n = c · tanh(s · (W x_n + b) / c) / τ        (s · (W x_n + b) / τ without a soft-cap)

and chunk by chunk over the N = B·T tokens

    log π(y_n) = z_{n,y} − lse(z_n),        H_n = lse(z_n) − Σᵥ π_{n,v} z_{n,v}

(`pgloss.vocab.entropy` holds the per-chunk math). With G = ∂L/∂(W x + b) of a chunk
(`pgloss.vocab.entropy.chunk_grad_logits` times the head's slope s (1 − tanh²(s (W x + b) / c))),

    ∂L/∂x = G W,        ∂L/∂W = Σ_chunks Gᵀ x,        ∂L/∂b = Σ_chunks Σ_rows G.

`loss_from_hidden` takes one of two paths; both give the loss of `algorithm(log_prob=log π,
entropy=H, ...)` on the full logits, for every algorithm and `Normalizer`:

- one pass (whole sequences fit in a chunk, T ≤ chunk_size): chunks of whole rows, each row chunk's
  loss under the step's `Normalizer` its exact share of the batch loss, so G W and Gᵀ x are formed in
  the forward pass: three N·H·V matmuls, the 6NHV floor (`one_pass.py`).
- recompute (longer sequences, chunks of tokens): `chunks.ChunkLoop` with a head source; forward
  keeps only the per-token lse; backward recomputes each chunk's logits: four matmuls, 8NHV.

Memory beyond the inputs and their gradients: one [chunk, V] buffer and cache-sized blocks; with
`vocab_block` < V (or a `memory_budget`), one [chunk, vocab_block] tile, the statistics accumulated
over tiles with an online max and each tile recomputed for the gradient (8NHV on either route).

The same idea: Liger-Kernel's fused linear losses (Hsu et al. 2024, https://arxiv.org/abs/2410.10989)
and "Cut Your Losses in Large-Vocabulary Language Models" (Wijmans et al. 2024,
https://arxiv.org/abs/2411.09009).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, overload

import torch
from torch import Tensor

from ..core.batch import check_mask, compute_dtype
from ..core.inputs import OPTIONAL_INPUTS, check_names
from ..core.normalizer import Normalizer
from ..core.output import LossOutput
from ..kl.corrections import FULL
from . import head_tile
from .chunks import ChunkLoop, plan_tiles
from .entropy import LogProbEntropy, check_targets, check_temperature
from .head import Head, HeadKind, HeadOptions, as_head, refuses_head_keywords
from .kernels import route
from .one_pass import AttachGradients, FusedAlgorithm, loss_one_pass

__all__ = ["loss_from_hidden", "log_prob_and_entropy_from_hidden", "full_head"]


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
def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor) -> Tensor: ...
@overload
def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor | None) -> Tensor | None: ...


def _check_inputs(hidden: Tensor, weight: Tensor, targets: Tensor, mask: Tensor | None) -> Tensor | None:
    """Types, shapes, dtypes and devices; token ids in [0, V) where `mask` is valid (everywhere
    when None). Returns the mask as bool (None without a mask)."""
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
    if isinstance(targets, Tensor) and targets.device != hidden.device:
        raise ValueError(f"targets is on {targets.device} but hidden is on {hidden.device}")
    valid = None if mask is None else check_mask(mask, hidden.shape[:-1], hidden.device)
    check_targets(targets, hidden.shape[:-1], weight.shape[0], valid)
    return valid


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

    Returns:
        (log_prob, entropy) [B, T] in float32 (float64 for float64 inputs), with gradients to
        hidden, weight and bias (whichever requires grad).
    """
    return _log_prob_and_entropy(
        hidden,
        weight,
        targets,
        as_head(head),
        temperature=temperature,
        mask=mask,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        memory_budget=memory_budget,
    )


def _log_prob_and_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    head: Head,
    *,
    temperature: float,
    mask: Tensor | None,
    chunk_size: int | None,
    vocab_block: int | None,
    memory_budget: int | None,
) -> tuple[Tensor, Tensor]:
    """`log_prob_and_entropy_from_hidden` for a head already taken from the call's record (`head.as_head`)."""
    weight = full_head(weight)
    head = head.with_bias(full_head(head.bias))
    valid = _check_inputs(hidden, weight, targets, mask)
    kind, bias = head.check(weight), head.bias
    temperature = check_temperature(temperature)
    batch, length, size = hidden.shape
    tiles = head_tiles(batch * length, weight, chunk_size, vocab_block, memory_budget, kind)
    rows = None if valid is None else valid.reshape(-1)
    statistic = LogProbEntropy(valid_targets(targets, valid).reshape(-1))
    flat = hidden.reshape(batch * length, size)
    if route(statistic, (kind,), weight) == "head-kernel":  # the logits formed inside its kernels
        log_prob, entropy = statistic.head_kernel(kind, temperature, tiles[1], rows, flat, weight, bias)
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


def head_tiles(
    tokens: int,
    weight: Tensor,
    chunk_size: int | None,
    vocab_block: int | None,
    memory_budget: int | None,
    kind: HeadKind,
) -> tuple[int, int]:
    """`plan_tiles` for one LM head like `weight`: on the torch route a logits buffer in the compute dtype, one
    more for the matmul's output in a half-precision head's own dtype, and one for a soft-cap's slope; on the
    kernel route the matmul's output alone; on the head-kernel route the float32 ∂W slab (`head_tile.plan`)."""
    which = route(LogProbEntropy, (kind,), weight)
    if which == "head-kernel":
        return head_tile.plan(tokens, weight, chunk_size, vocab_block, memory_budget)
    if which == "kernel":
        return plan_tiles(
            tokens,
            weight.shape[0],
            chunk_size=chunk_size,
            vocab_block=vocab_block,
            memory_budget=memory_budget,
            itemsize=weight.element_size(),
            kernel=True,
        )
    dtype = compute_dtype(weight.dtype)
    buffers = (1 if weight.dtype == dtype else 2) + int(kind.softcap is not None)
    return plan_tiles(
        tokens,
        weight.shape[0],
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        memory_budget=memory_budget,
        buffers=buffers,
        itemsize=torch.finfo(dtype).bits // 8,
    )


PASSED_INPUTS = {name: spec for name, spec in OPTIONAL_INPUTS.items() if name not in ("entropy", "full_kl")}
"""The optional inputs `from_hidden` passes to the loss as given; it computes the entropy and the exact KL."""


@refuses_head_keywords("", "ref_")
def loss_from_hidden(
    algorithm: FusedAlgorithm,  # a pgloss.Algorithm, handed in by its from_hidden: vocab/ sits below base.py
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    old_log_prob: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    normalizer: Normalizer | None = None,
    head: HeadOptions | None = None,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_head: HeadOptions | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
    **inputs: Tensor | None,
) -> LossOutput:
    """`algorithm`'s loss on the LM head's tempered logits, computed without materialising them:

        logits = c · tanh(s · (hidden @ weightᵀ + bias) / c) / τ        (no tanh without a soft-cap c)

    Equal to `algorithm(log_prob=log π(y), entropy=H, ...)` with log π and H from the full
    logits (see the module docstring), with gradients for `hidden`, `weight` and `bias`. The entropy
    gets a gradient only when `algorithm.entropy_coef` ≠ 0; otherwise it feeds the metric only.

    When whole sequences fit in a chunk (T ≤ chunk_size) and a gradient is wanted, the gradients
    are computed during this call (6NHV flops, `one_pass.loss_one_pass`) and handed out by `loss.backward()`,
    scaled by the caller's ∂/∂loss; backward then runs once, and `per_token` carries no gradient. Otherwise
    the logits are recomputed in backward (8NHV flops). Row-coupled algorithms
    (`algorithm.couples_rows`: Clip-Cov, KL-Cov, REAL) and the exact KL always take that route, so
    that one call sees the whole batch.

    On-policy (`old_log_prob=None`), log π_old is the detached log π of this same pass, as the plain call
    takes it (`pgloss.Algorithm.__call__`): the ratio is exactly 1 and the gradient that of the on-policy loss,
    without a second pass over the head to compute log π_old first.

    Args:
        algorithm: a `pgloss.Algorithm`, e.g. `pgloss.get("grpo")`.
        hidden: [B, T, H] final hidden states of the policy (the positions that predict `targets`); never read
            at masked positions (NaN and inf allowed there: `chunks.HeadRows`), nor `ref_hidden`.
        weight: [V, H] output projection (the LM head), same dtype and device as `hidden`; an
            FSDP2-sharded head (DTensor) is gathered once for the call (`full_head`).
        targets: [B, T] integer token ids; values at masked positions are ignored (e.g. -100).
        old_log_prob: [B, T] log π_old(y) of the policy that sampled the batch, as for `algorithm(...)`; None:
            on-policy, the detached log π computed here (the same values and gradient as passing it).
        advantages: [B] or [B, T], as for `algorithm(...)`.
        mask: [B, T] bool or 0/1, the tokens that count, as for `algorithm(...)`.
        temperature: τ > 0, the sampling temperature.
        normalizer: the step's counts, as for `algorithm(...)` (None: this call is the whole step).
        head: the LM head's bias b, logit scale s and soft-cap c, a `pgloss.HeadOptions` (None: the plain
            head); its bias has the weight's dtype and device and is gathered like it.
            `pgloss.integrations.lm_head.head_options(model)` reads them from a transformers model.
        ref_hidden: [B, T, H'], the reference model's final hidden states, for kl_estimator="full": the exact
            KL(π‖π_ref) per token is computed from them chunk by chunk
            (`pgloss.vocab.full_kl.full_kl_from_hidden`) and passed as `full_kl`.
        ref_weight: [V, H'], the reference model's LM head, with `ref_hidden`.
        ref_head: the reference head's options, as `head` (never differentiated); only with `ref_hidden`.
        chunk_size: tokens per chunk (rounded down to whole sequences on the one-pass path);
            None picks about 2²⁷ / V (≈ 512 MiB of float32 logits per chunk).
        vocab_block: vocabulary columns per tile (None: the whole vocabulary). Below V, each chunk's
            log-sum-exp, log π(y), H and exact KL accumulate over tiles with an online max, and
            each tile's logits are recomputed for the gradient (8NHV flops on either route).
        memory_budget: bytes for the loop's logits buffers, exclusive with chunk_size and
            vocab_block; the chunk and tile are chosen from it (`pgloss.vocab.chunks.plan_tiles`).
        **inputs: the optional inputs of `algorithm(...)` but `entropy` and `full_kl` (computed here);
            floating tensors are cast to the compute dtype (float32, or float64 for float64 parameters).
    """
    check_names(inputs, PASSED_INPUTS)
    policy, ref = as_head(head), as_head(ref_head, prefix="ref_")
    weight = full_head(weight)
    policy = policy.with_bias(full_head(policy.bias))
    valid = _check_inputs(hidden, weight, targets, mask)
    kind, bias = policy.check(weight), policy.bias
    temperature = check_temperature(temperature)
    tokens = hidden.shape[0] * hidden.shape[1]
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    chunk_size, vocab_block = head_tiles(tokens, weight, **sizes, kind=kind)
    safe_targets = valid_targets(targets, valid)
    dtype = compute_dtype(weight.dtype)

    def cast(value: Tensor | None) -> Tensor | None:
        floating = isinstance(value, Tensor) and value.dtype.is_floating_point
        return value.to(dtype) if floating and value is not None else value

    # The mask as bool, checked once here rather than again by every chunk's call. Any: the call's inputs by name.
    batch: dict[str, Any] = dict(
        old_log_prob=cast(old_log_prob),
        advantages=advantages,
        mask=valid,
        **{name: cast(value) for name, value in inputs.items() if value is not None},
    )
    exact_kl = algorithm.kl_estimator == FULL and (algorithm.kl_coef != 0 or ref_hidden is not None)
    if exact_kl:
        if ref_hidden is None or ref_weight is None:
            raise ValueError(f"{algorithm.name} has kl_estimator='full' and needs ref_hidden and ref_weight")
        from .full_kl import FullKL
        from .pair import pair_from_hidden

        batch["full_kl"] = pair_from_hidden(
            FullKL(),
            hidden,
            weight,
            ref_hidden,
            full_head(ref_weight),
            "ref",
            head=policy,
            other_head=ref.with_bias(full_head(ref.bias)),
            temperature=temperature,
            mask=valid,
            **sizes,
        )
    elif ref_hidden is not None or ref_weight is not None or ref_head is not None:
        raise ValueError(
            f"ref_hidden, ref_weight and ref_head are for kl_estimator='full'; {algorithm.name} has "
            f"kl_estimator={algorithm.kl_estimator!r} (pass ref_log_prob)"
        )
    length = hidden.shape[1]
    params = (hidden, weight) if bias is None else (hidden, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    # On-policy with rollout log-probs and no step counts given, the counts may read log π_old = log π (a rollout
    # correction's rejections), known only once log π is: the one pass needs them before its first chunk.
    counted_on_log_prob = normalizer is None and old_log_prob is None and inputs.get("rollout_log_prob") is not None
    # The head-kernel route holds no logits for a one pass to reuse: its recompute costs the same 8NHV.
    head_kernel = route(LogProbEntropy, (kind,), weight) == "head-kernel"
    if (
        head_kernel
        or not needs_grad
        or length == 0
        or length > chunk_size
        or algorithm.couples_rows
        or exact_kl
        or counted_on_log_prob
    ):
        # Sequences longer than a chunk, row-coupled losses, the exact KL and those counts: log π and H by token
        # chunks, one call for the batch, logits recomputed in backward.
        log_prob, entropy = _log_prob_and_entropy(
            hidden,
            weight,
            safe_targets,
            policy,
            temperature=temperature,
            mask=valid,
            chunk_size=chunk_size,
            vocab_block=vocab_block,
            memory_budget=None,
        )
        return algorithm(log_prob=log_prob, entropy=entropy, normalizer=normalizer, **batch)

    step = normalizer
    if step is None:  # this batch is the whole step: counted once for every chunk, as the call counts it
        step = algorithm.whole_step_normalizer(valid, batch["old_log_prob"], **inputs)
    with torch.no_grad():
        log_prob, entropy, *grads = loss_one_pass(
            algorithm,
            hidden,
            weight,
            bias,
            kind,
            safe_targets,
            temperature,
            chunk_size // length,
            vocab_block,
            step,
            batch,
        )
        out = algorithm(log_prob=log_prob, entropy=entropy, normalizer=step, **batch)
    loss = AttachGradients.apply(out.loss, hidden, weight, bias, *grads)
    return dataclasses.replace(out, loss=loss)
