"""What an LM head does after its matmul, described once for every caller: its options (`HeadOptions`: bias, logit
scale, soft-cap), given as one record (`as_head`), checked by `Head.check` into the `HeadKind` that a loop
(`head_chunks.HeadChunks`) and a kernel (`kernels.RawTile`) read. The keywords that once spelled the record out are
refused with the fix (`refuses_head_keywords`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

import torch
from torch import Tensor

from ..core.checks import check_number
from ..core.output import check

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class HeadKind:
    """What an LM head does after its matmul: r = x Wᵀ + b (the bias b beside the weight W, or none), then
    the logit scale s and the soft-cap c, in TRL 1.16's order (trl/kernels/chunked_divergence.py's `_project`
    adds the bias, chunked_logprob.py's `_transform` scales and caps):

        logits = c · tanh(s · r / c)        (s · r without a soft-cap)

    the temperature τ dividing them after. `HeadKind()` is the plain head x Wᵀ, whose ops it leaves as they
    are. The kind of a head source in `ChunkLoop`; its tensors (hidden, weight, bias) are the loop's inputs."""

    scale: float = 1.0
    softcap: float | None = None

    def transform_(self, z: Tensor, bias: Tensor | None, temperature: float, slope: Tensor | None) -> Tensor:
        """`z` (the tile's x Wᵀ) ← the tempered logits, in place; `slope` (when given) ← ∂logits/∂r before τ,
        s (1 − tanh²(s r / c)), which the gradient needs once the statistic has overwritten `z`."""
        if bias is not None:
            z.add_(bias)
        if self.softcap is not None:
            z.mul_(self.scale / self.softcap).tanh_()
            if slope is not None:
                torch.mul(z, z, out=slope).neg_().add_(1.0).mul_(self.scale)
            z.mul_(self.softcap)
        elif self.scale != 1.0:
            z.mul_(self.scale)
        if temperature != 1.0:
            z.div_(temperature)
        return z

    def grad_(self, grad: Tensor, slope: Tensor | None) -> Tensor:
        """∂L/∂logits (before τ) of a tile → ∂L/∂r, in place: × s (1 − tanh²), or × s without a soft-cap."""
        if self.softcap is not None:
            if slope is None:
                raise ValueError("a soft-capped head's gradient needs the slope its transform_ wrote")
            grad.mul_(slope)
        elif self.scale != 1.0:
            grad.mul_(self.scale)
        return grad


PLAIN = HeadKind()


@dataclass(frozen=True, eq=False)
class HeadOptions:
    """An LM head beyond its weight W [V, H]: its bias b [V] (None: no bias), its logit scale s > 0 and its
    soft-cap c > 0 (None: no soft-cap), applied in `HeadKind`'s order:

        logits = c · tanh(s · (x Wᵀ + b) / c)        (s · (x Wᵀ + b) without a soft-cap)

    Gemma's `final_logit_softcapping` is c, Cohere's `logit_scale` is s, Granite's `logits_scaling` is 1/s
    (`pgloss.integrations.lm_head.head_options` reads them from a transformers model). The calls from hidden
    states take one per model: `head=` (the trained model's), `ref_head=` (the reference's, for the exact KL),
    `teacher_head=` (the teacher's, for a divergence). The bias has the weight's dtype and device; the values are
    checked by the call that receives the record."""

    bias: Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None


PLAIN_HEAD = HeadOptions()


@dataclass(frozen=True, eq=False)
class Head:
    """A head's options as one call received them (`as_head`): the record and the prefix its errors name its
    parts by ("ref_head." for the record `ref_head`)."""

    options: HeadOptions
    names: str = ""

    @property
    def bias(self) -> Tensor | None:
        return self.options.bias

    def with_bias(self, bias: Tensor | None) -> Head:
        """The same head with its bias replaced (gathered from shards, detached)."""
        return Head(HeadOptions(bias, self.options.logit_scale, self.options.softcap), self.names)

    def check(self, weight: Tensor, weight_name: str = "weight") -> HeadKind:
        """The head's kind, its options checked against `weight` [V, H] (named `weight_name`): the bias None or
        a [V] tensor of the weight's dtype and device, the logit scale a finite number > 0, the soft-cap None or
        a finite number > 0. Errors name the argument; no value of a tensor is read."""
        bias, prefix = self.options.bias, self.names
        if bias is not None:
            if not isinstance(bias, Tensor):
                raise TypeError(f"{prefix}bias must be a Tensor or None, got {type(bias).__name__}")
            if bias.shape != weight.shape[:1]:
                raise ValueError(
                    f"{prefix}bias must have shape [V] = [{weight.shape[0]}] (the rows of "
                    f"{weight_name}), got {tuple(bias.shape)}"
                )
            if bias.dtype != weight.dtype:
                raise TypeError(f"{prefix}bias has dtype {bias.dtype} but {weight_name} has {weight.dtype}")
            if bias.device != weight.device:
                raise ValueError(f"{prefix}bias is on {bias.device} but {weight_name} is on {weight.device}")
        scale = check_number(f"{prefix}logit_scale", self.options.logit_scale)
        check(scale > 0, f"{prefix}logit_scale must be a finite number > 0, got {scale}")
        softcap = check_number(f"{prefix}softcap", self.options.softcap, optional=True)
        check(softcap is None or softcap > 0, f"{prefix}softcap must be a finite number > 0 or None, got {softcap}")
        return HeadKind(scale, softcap)


REMOVED_KEYWORDS = ("bias", "logit_scale", "softcap")
"""The head's options once also taken as keywords (`bias=`, `ref_softcap=`, ...), now only in its record."""


def refuses_head_keywords(*prefixes: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A call from hidden states that refuses, with the fix, the keywords that once spelled out its heads' options:
    `{prefix}bias`, `{prefix}logit_scale`, `{prefix}softcap` for each of `prefixes` ("" the trained model's, "ref_",
    "teacher_"). TypeError: pass `{prefix}head=pgloss.HeadOptions(...)` with them instead."""

    def decorate(call: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(call)  # the same signature for inspect and help()
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            for prefix in prefixes:
                given = [name for name in REMOVED_KEYWORDS if f"{prefix}{name}" in kwargs]
                if given:
                    keywords = ", ".join(f"{prefix}{name}=" for name in given)
                    fields = ", ".join(f"{name}=..." for name in given)
                    raise TypeError(
                        f"{call.__name__}() takes the head's options in one record: {keywords} are no longer "
                        f"keywords; pass {prefix}head=pgloss.HeadOptions({fields})"
                    )
            return call(*args, **kwargs)

        return checked

    return decorate


def as_head(head: object, *, prefix: str = "") -> Head:
    """The record `{prefix}head` (a `HeadOptions`, or None for the plain head) as a `Head` whose errors name its
    parts as the caller wrote them (`{prefix}head.bias`, ...)."""
    if head is None:
        head = PLAIN_HEAD
    if not isinstance(head, HeadOptions):
        raise TypeError(f"{prefix}head must be a pgloss.HeadOptions or None, got {type(head).__name__}")
    return Head(head, f"{prefix}head.")
