"""The checked, masked inputs of one loss call.

Every algorithm starts from `TokenBatch.prepare`, which is where bad input is refused and where
the one effective mask is applied: values at masked positions (NaN and inf included) are replaced
by zeros with `torch.where`, so they reach neither the loss nor the gradient. A mask narrowed
later (a rollout correction's rejections, a family's subset of rows) is applied the same way, by
`TokenBatch.restricted`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .checks import check_finite, check_log_prob, check_values, is_integer
from .inputs import OPTIONAL_INPUTS, OptionalInput, check_names
from .sequence_parallel import SequenceParallel, check_sequence_parallel, row_lengths, row_mean

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype is upcast to float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_tensor(name: str, value: object, *, ndim: tuple[int, ...], floating: bool = True) -> Tensor:
    """Refuse a non-tensor, a wrong rank or (when `floating`) a non-floating dtype, naming `name`."""
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.ndim not in ndim:
        ranks = " or ".join(str(n) for n in ndim)
        raise ValueError(f"{name} must have {ranks} dimensions, got shape {tuple(value.shape)}")
    if floating and value.dtype not in _FLOATS:
        raise TypeError(f"{name} must be a floating tensor, got dtype {value.dtype}")
    return value


def check_device(name: str, value: Tensor, device: torch.device, reference: str = "log_prob") -> None:
    """Refuse `value` on another device than `reference` (the tensor that sets the call's device)."""
    if value.device != device:
        raise ValueError(f"{name} is on {value.device} but {reference} is on {device}")


def check_mask(mask: object, shape: torch.Size, device: torch.device, reference: str = "log_prob") -> Tensor:
    """A `[B, T]` bool or 0/1 mask, returned as bool, on the device of `reference`."""
    mask = check_tensor("mask", mask, ndim=(2,), floating=False)
    if mask.shape != shape:
        raise ValueError(f"mask must have shape {tuple(shape)}, got {tuple(mask.shape)}")
    check_device("mask", mask, device, reference)
    if mask.dtype == torch.bool:
        return mask
    if mask.is_floating_point() or mask.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8):
        check_values(
            mask,
            lambda: (mask != 0) & (mask != 1),
            lambda at: (
                f"mask must hold only 0 and 1 (or be bool), got {mask[tuple(at)].item()} at {tuple(at.tolist())}"
            ),
        )
        return mask != 0
    raise TypeError(f"mask must be bool or 0/1 numbers, got dtype {mask.dtype}")


@dataclass(frozen=True)
class TokenBatch:
    """Inputs of one loss call, checked, upcast and zeroed at masked positions.

    Token tensors are `[B, T]` in the compute dtype (float32, or float64 for float64 input);
    `advantages` is `[B, T]` (a `[B]` input is broadcast over tokens) and `seq_advantages` keeps
    the `[B]` form when one was given. The optional inputs (`ref_log_prob` to `rollout_is_weight`) are those
    of core/inputs.py's `OPTIONAL_INPUTS`, None when not given. `sequence_parallel`: the sequence group
    when the rows are slices of longer sequences (`pgloss.core.sequence_parallel`); the row statistics
    (`row_advantages`, `valid_rows`) are then over whole sequences.
    """

    log_prob: Tensor
    old_log_prob: Tensor
    advantages: Tensor
    mask: Tensor
    seq_advantages: Tensor | None = None
    ref_log_prob: Tensor | None = None
    entropy: Tensor | None = None
    rollout_log_prob: Tensor | None = None
    group_ids: Tensor | None = None
    scores: Tensor | None = None
    full_kl: Tensor | None = None
    teacher_log_prob: Tensor | None = None
    expert: Tensor | None = None
    rollout_is_weight: Tensor | None = None
    sequence_parallel: SequenceParallel | None = None

    @property
    def row_advantages(self) -> Tensor:
        """Â_i, `[B]`: the `[B]` advantages as given, or the mean over a row's valid tokens of `[B, T]` ones."""
        if self.seq_advantages is not None:
            return self.seq_advantages
        return row_mean(self.advantages * self.mask, self.mask, self.sequence_parallel)

    @property
    def valid_rows(self) -> Tensor:
        """Bool `[B]`: the rows with a valid token (anywhere in the sequence, under a sequence group)."""
        if self.sequence_parallel is None:
            return self.mask.any(dim=-1)
        return row_lengths(self.mask, self.sequence_parallel) > 0

    def restricted(self, mask: Tensor) -> TokenBatch:
        """This batch with its effective mask narrowed to the bool `mask` (a subset of `self.mask`: a rollout
        correction's rejections, a family's subset of rows), every real value outside it zeroed as `prepare`
        zeroes the masked positions (a row's value by `kept_rows`): what the narrowing drops reaches no term of
        the loss (the policy term, the KL, the entropy bonus, the NLL), no gradient and no metric, NaN and inf
        included."""
        rows = mask.any(dim=-1)
        fields = {"log_prob": "token", "old_log_prob": "token", "advantages": "token", "seq_advantages": "row"}
        fields |= {name: spec.per for name, spec in OPTIONAL_INPUTS.items() if spec.kind == "real"}
        zeroed: dict[str, Any] = {}  # Any: `replace` checks **kwargs against every field; these are the real inputs
        for name, per in fields.items():
            value = getattr(self, name)
            if value is not None:
                keep = mask if per == "token" else kept_rows(rows, value, self.sequence_parallel)
                zeroed[name] = torch.where(keep, value, 0.0)
        return dataclasses.replace(self, mask=mask, **zeroed)

    @classmethod
    def prepare(
        cls,
        log_prob: Tensor,
        old_log_prob: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        sequence_parallel: SequenceParallel | None = None,
        **inputs: Tensor | None,
    ) -> TokenBatch:
        """Check, upcast and mask the call's tensors; `inputs` are optional inputs (core/inputs.py).

        `old_log_prob` None is on-policy: log π_old is `log_prob` detached (the ratio exactly 1, the gradient
        the on-policy loss's), the one rule of every path (the call, `from_hidden`, `inspect`).

        Row inputs (`advantages` `[B]`, `scores`) are 0 on the rows without a valid token. Under a sequence
        group a row may have no token on this rank and some on another, where its value counts: there they
        are 0 only where they are not finite (the rank that holds the row's tokens refuses those), so that
        every rank sees a row's value without a collective."""
        check_names(inputs)
        sequence_parallel = check_sequence_parallel(sequence_parallel)
        log_prob = check_tensor("log_prob", log_prob, ndim=(2,))
        shape, device, dtype = log_prob.shape, log_prob.device, log_prob.dtype
        bool_mask = check_mask(mask, shape, device)
        cdtype = compute_dtype(dtype)
        # One 0-d zero for every masked fill (each `where(mask, x, 0.0)` would fill its own on the device).
        zero = torch.zeros((), dtype=cdtype, device=device)
        rows: list[Tensor] = []

        def valid_rows() -> Tensor:
            """The rows with a valid token, counted once and only when a row input needs them."""
            if not rows:
                rows.append(bool_mask.any(dim=1))
            return rows[0]

        def token(name: str, value: Tensor, *, is_log_prob: bool) -> Tensor:
            # log-probabilities share log_prob's dtype and are at most 0
            value = check_tensor(name, value, ndim=(2,))
            if value.shape != shape:
                raise ValueError(f"{name} must have the shape of log_prob {tuple(shape)}, got {tuple(value.shape)}")
            check_device(name, value, device)
            if is_log_prob and value.dtype != dtype:
                raise TypeError(
                    f"{name} has dtype {value.dtype} but log_prob has {dtype}; cast the log-probabilities to one dtype"
                )
            check_finite(name, value, bool_mask)
            value = torch.where(bool_mask, value.to(cdtype), zero)
            if is_log_prob:
                check_log_prob(name, value)  # zeroed at masked positions
            return value

        def row(spec: OptionalInput, value: Tensor) -> Tensor:
            value = check_tensor(spec.name, value, ndim=(1,), floating=spec.kind == "real")
            if spec.kind != "real":
                right = value.dtype == torch.bool if spec.kind == "bool" else is_integer(value)
                if value.shape[0] != shape[0] or not right:
                    kind = "a bool" if spec.kind == "bool" else "an integer"
                    raise ValueError(
                        f"{spec.name} must be {kind} tensor of shape [{shape[0]}], got "
                        f"{value.dtype} {tuple(value.shape)}"
                    )
                check_device(spec.name, value, device)
                return value
            if value.shape[0] != shape[0]:
                raise ValueError(f"{spec.name} must have shape [{shape[0]}], got {tuple(value.shape)}")
            check_device(spec.name, value, device)
            check_finite(spec.name, value, bool_mask)
            return torch.where(kept_rows(valid_rows(), value, sequence_parallel), value.to(cdtype), zero)

        def optional(spec: OptionalInput, value: Tensor) -> Tensor:
            value = token(spec.name, value, is_log_prob=spec.log_prob) if spec.per == "token" else row(spec, value)
            return value if spec.grad or spec.kind != "real" else value.detach()

        advantages = check_tensor("advantages", advantages, ndim=(1, 2))
        check_device("advantages", advantages, device)
        seq_advantages = None
        if advantages.ndim == 1:
            if advantages.shape[0] != shape[0]:
                raise ValueError(f"advantages of shape [B] must have B={shape[0]}, got {tuple(advantages.shape)}")
            seq_advantages = advantages.detach().to(cdtype)
            advantages = seq_advantages[:, None].expand(shape)
        advantages = token("advantages", advantages, is_log_prob=False).detach()
        if seq_advantages is not None:
            seq_advantages = torch.where(
                kept_rows(valid_rows(), seq_advantages, sequence_parallel), seq_advantages, zero
            )

        log_prob = token("log_prob", log_prob, is_log_prob=True)
        old = log_prob if old_log_prob is None else token("old_log_prob", old_log_prob, is_log_prob=True)
        return cls(
            log_prob=log_prob,
            old_log_prob=old.detach(),
            advantages=advantages,
            mask=bool_mask,
            seq_advantages=seq_advantages,
            sequence_parallel=sequence_parallel,
            **{name: optional(OPTIONAL_INPUTS[name], value) for name, value in inputs.items() if value is not None},
        )


def kept_rows(valid_rows: Tensor, value: Tensor, sequence_parallel: SequenceParallel | None) -> Tensor:
    """Bool `[B]`: where a row input (`[B]` advantages, `scores`) keeps its value: the rows with a valid token
    here. Under a sequence group a row may have no token on this rank and some on another, where its value
    counts: there it is kept wherever it is finite (the rank that holds the row's tokens refuses a non-finite
    one), so that every rank sees a row's value without a collective."""
    return valid_rows if sequence_parallel is None else valid_rows | value.isfinite()


def per_micro_batch(name: str, value: Tensor | Sequence[Tensor], count: int | None = None) -> list[Tensor]:
    """The step's tensors as a list, one per micro-batch: a tensor is one micro-batch, a sequence holds
    one per micro-batch. ValueError naming `name` when there is none, or not `count` (the masks')."""
    values = [value] if isinstance(value, Tensor) else list(value)
    if not values or (count is not None and len(values) != count):
        raise ValueError(
            f"{name} must hold one tensor per micro-batch"
            + (f" ({count}, as masks), got {len(values)}" if count is not None else ", got none")
        )
    return values
