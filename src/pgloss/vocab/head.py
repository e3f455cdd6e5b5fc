"""What an LM head does after its matmul, described once for every caller: its options (`HeadOptions`: bias, logit
scale, soft-cap), given as one record or as keywords and turned into one by `as_head`, checked by `Head.check` into
the `HeadKind` that a loop (`head_chunks.HeadChunks`) and a kernel (`kernels.RawTile`) read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..core.checks import check_number
from ..core.output import check


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
    `teacher_head=` (the teacher's, for a divergence); their keywords `bias=`, `logit_scale=`, `softcap=` (and
    `ref_...`, `teacher_...`) are the same record spelled out, turned into one by `as_head`. The bias has the
    weight's dtype and device; the values are checked by the call that receives the record."""

    bias: Tensor | None = None
    logit_scale: float = 1.0
    softcap: float | None = None


PLAIN_HEAD = HeadOptions()


@dataclass(frozen=True, eq=False)
class Head:
    """A head's options as one call received them (`as_head`): the record and the prefix its errors name its
    parts by ("ref_" for the keywords `ref_bias`, ...; "ref_head." for the record `ref_head`)."""

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


def _spelled(bias: object, logit_scale: object, softcap: object, prefix: str) -> list[str]:
    """The keywords of a head given other than at their defaults (no tensor value is read; a logit scale that
    is no number is refused by name)."""
    plain_scale = check_number(f"{prefix}logit_scale", logit_scale) == 1.0
    return [
        name
        for name, given in (
            ("bias", bias is not None),
            ("logit_scale", not plain_scale),
            ("softcap", softcap is not None),
        )
        if given
    ]


def as_head(
    head: object, bias: object = None, logit_scale: object = 1.0, softcap: object = None, *, prefix: str = ""
) -> Head:
    """The one converter of a head's spelling: the record `{prefix}head` (a `HeadOptions`), or its keywords
    `{prefix}bias`, `{prefix}logit_scale`, `{prefix}softcap`, as a `Head` whose errors name what the caller
    wrote. Both at once (a keyword other than its default beside the record) is refused, naming them."""
    if head is None:
        return Head(HeadOptions(bias, logit_scale, softcap), prefix)  # type: ignore[arg-type]
    if not isinstance(head, HeadOptions):
        raise TypeError(f"{prefix}head must be a pgloss.HeadOptions or None, got {type(head).__name__}")
    spelled = _spelled(bias, logit_scale, softcap, prefix)
    if spelled:
        keywords = ", ".join(f"{prefix}{name}" for name in spelled)
        raise ValueError(
            f"{prefix}head and {keywords} both describe the head: pass {prefix}head=HeadOptions(...) "
            f"alone, or the keywords {prefix}bias, {prefix}logit_scale, {prefix}softcap alone"
        )
    return Head(head, f"{prefix}head.")


def head_given(head: object, bias: object, logit_scale: object, softcap: object, *, prefix: str = "") -> bool:
    """Whether a head was described at all: by its record, or by a keyword other than its default."""
    return head is not None or bool(_spelled(bias, logit_scale, softcap, prefix))
