"""A statistic of two models' distributions (the exact KL of `full_kl.py`, the divergences of `divergence.py`),
from logits or from hidden states and LM heads: the checks of the two inputs, the tile plan and one run of
`chunks.ChunkLoop` over two sources. The second model (the reference, the teacher) is never differentiated.

From hidden states, each model's head is its weight and its options (`head.HeadOptions`, taken as a `head.Head`),
checked against its weight; per chunk the loop forms one [chunk, vocab_block] buffer per model, never the N × V
logits of either, and reads the hidden states only at the `mask`'s positions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_mask, compute_dtype
from .backends import Plan
from .chunks import ChunkLoop
from .entropy import check_temperature
from .head import Head, HeadKind
from .plan import plan

__all__ = ["check_logit_pair", "check_head_pair", "pair_from_logits", "head_pair", "pair_from_hidden"]


def _floating(label: str, value: object, rank: int | None) -> Tensor:
    """`value` as a floating tensor of `rank` dimensions (any rank for None), or TypeError / ValueError naming
    `label`."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{label} must be a Tensor, got {type(value).__name__}")
    if not value.dtype.is_floating_point:
        raise TypeError(f"{label} must be a floating tensor, got dtype {value.dtype}")
    if rank is not None and value.dim() != rank:
        raise ValueError(f"{label} must have {rank} dimensions, got shape {tuple(value.shape)}")
    return value


def _check_pair(name: str, value: object, other_name: str, other: object, rank: int | None) -> tuple[Tensor, Tensor]:
    """Two floating tensors of `rank` dimensions on one device, named `name` and `other_name` in errors."""
    first, second = _floating(name, value, rank), _floating(other_name, other, rank)
    if first.device != second.device:
        raise ValueError(f"{other_name} is on {second.device} but {name} is on {first.device}")
    return first, second


def check_logit_pair(logits: object, other: object, *, names: tuple[str, str]) -> None:
    """Two floating `[..., V]` logit tensors of one shape on one device (V >= 1), named `names` in errors."""
    name, other_name = names
    first, second = _check_pair(name, logits, other_name, other, None)
    if first.dim() < 1 or first.shape[-1] < 1:
        raise ValueError(f"{name} must have shape [..., V] with V >= 1, got {tuple(first.shape)}")
    if second.shape != first.shape:
        raise ValueError(f"{other_name} must have the shape of {name} {tuple(first.shape)}, got {tuple(second.shape)}")


def check_head_pair(hidden: object, weight: object, other_hidden: object, other_weight: object, *, other: str) -> None:
    """The `[B, T, H]` hidden states and `[V, H]` head of the trained model and of another one
    (`{other}_hidden` `[B, T, H']`, `{other}_weight` `[V, H']`: the reference, the teacher): ranks, widths,
    dtypes and devices agree, one vocabulary, one compute dtype. Errors name the argument."""
    x, x_other = _check_pair("hidden", hidden, f"{other}_hidden", other_hidden, 3)
    w, w_other = _check_pair("weight", weight, f"{other}_weight", other_weight, 2)
    for name, states, head in (("weight", x, w), (f"{other}_weight", x_other, w_other)):
        if head.shape[1] != states.shape[-1]:
            raise ValueError(f"{name} must have shape [V, {states.shape[-1]}], got {tuple(head.shape)}")
        if head.dtype != states.dtype:
            raise TypeError(f"{name} has dtype {head.dtype} but its hidden states have {states.dtype}")
        if head.device != states.device:
            raise ValueError(f"{name} is on {head.device} but its hidden states are on {states.device}")
    if x_other.shape[:2] != x.shape[:2]:
        raise ValueError(f"{other}_hidden must have shape [{x.shape[0]}, {x.shape[1]}, H'], got {tuple(x_other.shape)}")
    if w_other.shape[0] != w.shape[0] or w.shape[0] < 1:
        raise ValueError(
            f"weight and {other}_weight must share a vocabulary V >= 1, got {w.shape[0]} and {w_other.shape[0]}"
        )
    if compute_dtype(w_other.dtype) != compute_dtype(w.dtype):
        raise TypeError(
            f"{other}_weight computes in {compute_dtype(w_other.dtype)} but weight in {compute_dtype(w.dtype)}"
        )


def pair_from_logits(
    statistic: object,
    logits: Tensor,
    other_logits: Tensor,
    other: str,
    *,
    temperature: float,
    chunk_size: int | None,
    vocab_block: int | None,
    memory_budget: int | None,
) -> Tensor:
    """`statistic` per position of `logits` [..., V] against `{other}_logits` of the same shape."""
    check_logit_pair(logits, other_logits, names=("logits", f"{other}_logits"))
    temperature = check_temperature(temperature)
    vocab = logits.shape[-1]
    flat, other_flat = logits.reshape(-1, vocab), other_logits.detach().reshape(-1, vocab)
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    tiles = plan(statistic, ("logits", "logits"), flat, flat.shape[0], **sizes)
    values = ChunkLoop.apply(statistic, ("logits", "logits"), temperature, tiles, None, flat, other_flat)
    return values.view(logits.shape[:-1])


def head_pair(
    statistic: object,
    hidden: Tensor,
    weight: Tensor,
    other_hidden: Tensor,
    other_weight: Tensor,
    other: str,
    *,
    head: Head,
    other_head: Head,
    mask: Tensor | None,
    chunk_size: int | None,
    vocab_block: int | None,
    memory_budget: int | None,
) -> tuple[tuple[HeadKind, HeadKind], Plan, tuple, tuple, Tensor | None]:
    """The two heads of a loop of `statistic` (an instance or its class: the backend is chosen for it), each
    as its call gave it (`head.as_head`), checked (`check_head_pair`, then each head's options by
    `head.Head.check` against its weight, the other's named `{other}_weight`): their kinds, the loop's plan
    (`plan.plan`: the backend and its tiles), each model's loop inputs (hidden states as [N, H] rows, weight, bias),
    the other's detached, and the mask checked (`core.batch.check_mask`; None for None)."""
    check_head_pair(hidden, weight, other_hidden, other_weight, other=other)
    valid = None if mask is None else check_mask(mask, hidden.shape[:2], hidden.device, "hidden")
    kinds = (head.check(weight), other_head.check(other_weight, f"{other}_weight"))
    bias, other_bias = head.bias, other_head.bias
    tokens = hidden.shape[0] * hidden.shape[1]
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    tiles = plan(statistic, kinds, weight, tokens, **sizes)
    first = (hidden.reshape(tokens, hidden.shape[-1]), weight, bias)
    second = (
        other_hidden.detach().reshape(tokens, other_hidden.shape[-1]),
        other_weight.detach(),
        None if other_bias is None else other_bias.detach(),
    )
    return kinds, tiles, first, second, valid


def pair_from_hidden(
    statistic: object,
    hidden: Tensor,
    weight: Tensor,
    other_hidden: Tensor,
    other_weight: Tensor,
    other: str,
    *,
    head: Head,
    other_head: Head,
    temperature: float,
    mask: Tensor | None,
    chunk_size: int | None,
    vocab_block: int | None,
    memory_budget: int | None,
) -> Tensor:
    """`statistic` per position [B, T] of the head (`weight` and `head`) on `hidden` against the other model's
    head on `{other}_hidden` (`head_pair`); 0 where `mask` (None: every position) is not."""
    kinds, tiles, first, second, valid = head_pair(
        statistic,
        hidden,
        weight,
        other_hidden,
        other_weight,
        other,
        head=head,
        other_head=other_head,
        mask=mask,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        memory_budget=memory_budget,
    )
    temperature = check_temperature(temperature)
    rows = None if valid is None else valid.reshape(-1)
    values = ChunkLoop.apply(statistic, kinds, temperature, tiles, rows, *first, *second).view(hidden.shape[:2])
    return values if valid is None else torch.where(valid, values, 0.0)
