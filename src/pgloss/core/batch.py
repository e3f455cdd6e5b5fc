"""The checked, masked inputs of one loss call.

Every algorithm starts from `TokenBatch.prepare`, which is where bad input is refused and where
the one effective mask is applied: values at masked positions (NaN and inf included) are replaced
by zeros with `torch.where`, so they reach neither the loss nor the gradient.
"""

from __future__ import annotations

from collections.abc import Sequence

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import check_finite, check_log_prob, check_values, is_integer

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
        check_values(mask, lambda: (mask != 0) & (mask != 1),
                     lambda at: f"mask must hold only 0 and 1 (or be bool), got {mask[tuple(at)].item()} at {tuple(at.tolist())}")
        return mask != 0
    raise TypeError(f"mask must be bool or 0/1 numbers, got dtype {mask.dtype}")


@dataclass(frozen=True)
class TokenBatch:
    """Inputs of one loss call, checked, upcast and zeroed at masked positions.

    Token tensors are `[B, T]` in the compute dtype (float32, or float64 for float64 input);
    `advantages` is `[B, T]` (a `[B]` input is broadcast over tokens) and `seq_advantages` keeps
    the `[B]` form when one was given. `scores` are the raw sequence rewards `[B]` (TOPR) and
    `full_kl` the exact per-token KL `[B, T]` with its gradient (`pgloss.vocab.full_kl`); `expert`
    the `[B]` bool flags of expert (demonstration) rows (CHORD).
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
    expert: Tensor | None = None

    @classmethod
    def prepare(
        cls,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        ref_log_prob: Tensor | None = None,
        entropy: Tensor | None = None,
        rollout_log_prob: Tensor | None = None,
        group_ids: Tensor | None = None,
        scores: Tensor | None = None,
        full_kl: Tensor | None = None,
        expert: Tensor | None = None,
    ) -> "TokenBatch":
        log_prob = check_tensor("log_prob", log_prob, ndim=(2,))
        shape, device, dtype = log_prob.shape, log_prob.device, log_prob.dtype
        bool_mask = check_mask(mask, shape, device)
        cdtype = compute_dtype(dtype)

        def token(name: str, value: Tensor | None, *, is_log_prob: bool) -> Tensor | None:
            # log-probabilities share log_prob's dtype and are at most 0
            if value is None:
                return None
            value = check_tensor(name, value, ndim=(2,))
            if value.shape != shape:
                raise ValueError(f"{name} must have the shape of log_prob {tuple(shape)}, got {tuple(value.shape)}")
            check_device(name, value, device)
            if is_log_prob and value.dtype != dtype:
                raise TypeError(
                    f"{name} has dtype {value.dtype} but log_prob has {dtype}; cast the log-probabilities to one dtype"
                )
            check_finite(name, value, bool_mask)
            value = torch.where(bool_mask, value.to(cdtype), 0.0)
            if is_log_prob:
                check_log_prob(name, value)  # zeroed at masked positions
            return value

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
            valid_rows = bool_mask.any(dim=1)
            seq_advantages = torch.where(valid_rows, seq_advantages, 0.0)

        if group_ids is not None:
            group_ids = check_tensor("group_ids", group_ids, ndim=(1,), floating=False)
            if group_ids.shape[0] != shape[0] or not is_integer(group_ids):
                raise ValueError(f"group_ids must be an integer tensor of shape [{shape[0]}], got "
                                 f"{group_ids.dtype} {tuple(group_ids.shape)}")
            check_device("group_ids", group_ids, device)

        if scores is not None:
            scores = check_tensor("scores", scores, ndim=(1,))
            if scores.shape[0] != shape[0]:
                raise ValueError(f"scores must have shape [{shape[0]}], got {tuple(scores.shape)}")
            check_device("scores", scores, device)
            check_finite("scores", scores, bool_mask)
            scores = torch.where(bool_mask.any(dim=1), scores.detach().to(cdtype), 0.0)

        if expert is not None:
            expert = check_tensor("expert", expert, ndim=(1,), floating=False)
            if expert.shape[0] != shape[0] or expert.dtype != torch.bool:
                raise ValueError(f"expert must be a bool tensor of shape [{shape[0]}], got {expert.dtype} "
                                 f"{tuple(expert.shape)}")
            check_device("expert", expert, device)

        return cls(
            log_prob=token("log_prob", log_prob, is_log_prob=True),
            old_log_prob=token("old_log_prob", old_log_prob, is_log_prob=True).detach(),
            advantages=advantages,
            mask=bool_mask,
            seq_advantages=seq_advantages,
            ref_log_prob=None if ref_log_prob is None else token("ref_log_prob", ref_log_prob, is_log_prob=True).detach(),
            entropy=token("entropy", entropy, is_log_prob=False),
            rollout_log_prob=None
            if rollout_log_prob is None
            else token("rollout_log_prob", rollout_log_prob, is_log_prob=True).detach(),
            group_ids=group_ids,
            scores=scores,
            full_kl=token("full_kl", full_kl, is_log_prob=False),
            expert=expert,
        )


def per_micro_batch(name: str, value: "Tensor | Sequence[Tensor]", count: int | None = None) -> list[Tensor]:
    """The step's tensors as a list, one per micro-batch: a tensor is one micro-batch, a sequence holds
    one per micro-batch. ValueError naming `name` when there is none, or not `count` (the masks')."""
    values = [value] if isinstance(value, Tensor) else list(value)
    if not values or (count is not None and len(values) != count):
        raise ValueError(f"{name} must hold one tensor per micro-batch"
                         + (f" ({count}, as masks), got {len(values)}" if count is not None else ", got none"))
    return values
