"""Checks of input values, and the opt-in anomaly mode that finds non-finite inputs.

Shapes, dtypes, devices and hyperparameters are always checked: that costs nothing. Checks of
tensor *values* are different: on an accelerator each one is a host sync. So:

- value checks that guard against an internal error or a silently wrong loss (a mask of values
  other than 0 and 1, group ids outside the step's `Normalizer`, token ids outside the
  vocabulary, a `Normalizer` counted on fewer tokens than the call holds) run on CPU tensors
  always, where they cost no sync, and on accelerator tensors only inside `detect_anomaly()`
  (`host_reads`). Under `torch.compile` they are skipped as on an accelerator: a read of a value
  would break the graph;
- a positive log-probability is refused on every device (`check_log_prob`): by a ValueError with
  its position where the host reads the values for free, elsewhere by an assert on the device
  (`torch._assert_async`), which needs no sync and compiles;
- non-finite values at *valid* positions (a NaN log-prob, a -inf log-prob, a NaN advantage) are
  not checked by default: like any torch computation the loss then comes out NaN. Inside
  `detect_anomaly()` they raise a ValueError naming the tensor and its first (row, column).
  Non-finite values at masked positions are always harmless (`pgloss.core.batch`).

    with pgloss.detect_anomaly():
        out = algorithm(log_prob, old_log_prob, advantages, mask)   # raises at the first bad value

Like `torch.autograd.detect_anomaly`, the mode is for finding a bug, not for production: every
check inside it synchronises with the host.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import numbers
import typing
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
from torch import Tensor

_ANOMALY = contextvars.ContextVar("pgloss_detect_anomaly", default=False)
_ON_ACCELERATOR = contextvars.ContextVar("pgloss_as_on_accelerator", default=False)


@contextlib.contextmanager
def detect_anomaly(enabled: bool = True) -> Iterator[None]:
    """Within this context, pgloss checks input values everywhere (one host sync per check on an
    accelerator) and raises on non-finite values at valid positions. Nests; thread- and task-local."""
    token = _ANOMALY.set(bool(enabled))
    try:
        yield
    finally:
        _ANOMALY.reset(token)


def anomaly_enabled() -> bool:
    """True inside `detect_anomaly()`; always False while `torch.compile` traces (a host read
    would break the graph: run the step eagerly to find a bad value)."""
    if torch.compiler.is_compiling():
        return False
    return _ANOMALY.get()


@contextlib.contextmanager
def as_on_accelerator(enabled: bool = True) -> Iterator[None]:
    """Within this context, CPU tensors are checked as accelerator tensors are (`host_reads` is False
    outside `detect_anomaly()`): the value checks are skipped, a positive log-prob is refused by the
    device assert. A CPU run then takes the path of a GPU run, which is how the tests prove that a call
    reads nothing on the host. Nests; thread- and task-local."""
    token = _ON_ACCELERATOR.set(bool(enabled))
    try:
        yield
    finally:
        _ON_ACCELERATOR.reset(token)


def host_reads(tensor: Tensor) -> bool:
    """True when reading `tensor`'s values on the host costs no sync: a CPU tensor outside
    `torch.compile` tracing (and outside `as_on_accelerator()`), or any tensor inside
    `detect_anomaly()` (where syncs are the point)."""
    if anomaly_enabled():
        return True
    return tensor.device.type == "cpu" and not torch.compiler.is_compiling() and not _ON_ACCELERATOR.get()


def is_integer(tensor: Tensor) -> bool:
    """True for an integer dtype (ids, token ids); bool, floating and complex are not integers."""
    return not (tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool)


def check_values(tensor: Tensor, bad: Callable[[], Tensor], message: Callable[[Tensor], str]) -> None:
    """Raise ValueError(message(first bad index)) when `bad()` (a bool tensor shaped like the values)
    has a True element. Runs when `host_reads(tensor)`: for CPU tensors always, for accelerator
    tensors (a host sync) only inside `detect_anomaly()`. A 0-d `bad()` gives an empty index (shape [0])."""
    if not host_reads(tensor):
        return
    flags = bad()
    if bool(flags.any()):
        raise ValueError(message(flags.nonzero()[0]))


def check_log_prob(name: str, value: Tensor, mask: Tensor | None = None) -> None:
    """A log-probability is at most 0: refuse a positive one where `mask` is valid (everywhere when
    None: pass values already zeroed at masked positions), naming `name`; probabilities passed for
    log-probabilities are the likely cause. Refused on every device, never with a host sync:

    - where the host reads the values for free (`host_reads`: a CPU tensor outside `torch.compile`,
      any tensor inside `detect_anomaly()`), a ValueError naming the first positive value and its
      position;
    - elsewhere (an accelerator, a compiled call, `as_on_accelerator()`), `torch._assert_async`, a check
      on the device: a RuntimeError with this message at once on CPU, a device-side assert on CUDA,
      reported at the host's next sync with the device (CUDA cannot go on after it: rerun the step
      inside `detect_anomaly()` to find the tensor and position). Nothing on `meta` tensors.

    NaN is not positive: `check_finite` finds it."""
    if value.numel() == 0:
        return
    valid = value.detach() if mask is None else torch.where(mask, value.detach(), 0.0)
    if not host_reads(value):
        torch._assert_async(
            (valid > 0).any().logical_not(),
            f"{name} must hold log-probabilities (<= 0), got a positive value at a valid position; "
            "were probabilities passed instead of their log? (run the step inside "
            "pgloss.detect_anomaly() for its position)",
        )
        return
    if bool(valid.amax() > 0):
        where = tuple(int(i) for i in (valid > 0).nonzero()[0])
        raise ValueError(
            f"{name} must hold log-probabilities (<= 0), got {float(value.detach()[where])} at a valid position "
            f"{where}; were probabilities passed instead of their log?"
        )


def check_finite(name: str, value: Tensor | None, mask: Tensor) -> None:
    """Inside `detect_anomaly()`: raise if `value` (`[B, T]`, or `[B]` per sequence) is NaN or ±inf
    where `mask` is valid, naming `name` and the first (row, column). Outside: nothing, no sync."""
    if value is None or not anomaly_enabled():
        return
    values = value.detach()
    valid = mask if values.ndim == mask.ndim else mask.any(dim=-1)
    flags = valid & ~torch.isfinite(values)
    if bool(flags.any()):
        where = tuple(int(i) for i in flags.nonzero()[0])
        at = f"(row {where[0]}, column {where[1]})" if len(where) == 2 else f"row {where[0]}"
        raise ValueError(f"{name} is {float(values[where])} at a valid position {at}")


def check_cut(name: str, value: Any, device: torch.device) -> Tensor:
    """A threshold that values are compared with: a real number or a 0-d floating tensor (±inf
    allowed: keep everything or nothing), never NaN, which no value passes. Returned as a 0-d
    float64 tensor on `device` (filled there, never copied from the host). A NaN tensor is refused by
    a value check (`check_values`)."""
    if isinstance(value, Tensor):
        if value.ndim != 0 or not value.dtype.is_floating_point:
            raise TypeError(
                f"{name} must be a real number or a 0-d floating tensor, got a {value.dtype} tensor "
                f"of shape {tuple(value.shape)}"
            )
        check_values(value, lambda: torch.isnan(value), lambda _: f"{name} is NaN: no value passes it")
        return value.detach().to(device=device, dtype=torch.float64)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number or a 0-d floating tensor, got {value!r} ({type(value).__name__})"
        )
    if math.isnan(value):
        raise ValueError(f"{name} is NaN: no value passes it")
    return torch.full((), float(value), dtype=torch.float64, device=device)  # a fill: no copy from the host


def check_valid_finite(name: str, values: Tensor, mask: Tensor) -> None:
    """Refuse NaN or ±inf `values` where `mask` is valid, naming `name` and the position: for the
    step-level functions that read values on the host anyway (a quantile, a sort), always."""
    flags = mask & ~torch.isfinite(values)
    if bool(flags.any()):
        where = tuple(int(i) for i in flags.nonzero()[0])
        raise ValueError(f"{name} is {float(values[where])} at a valid position {where}")


# ---- hyperparameters: checked by name, always (no tensors involved) ----


@typing.overload
def check_number(name: str, value: Any, *, optional: Literal[False] = False) -> float: ...
@typing.overload
def check_number(name: str, value: Any, *, optional: bool) -> float | None: ...


def check_number(name: str, value: Any, *, optional: bool = False) -> float | None:
    """`value` as a float: TypeError unless a real number (bool excluded; None when `optional`),
    ValueError unless finite."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"{name} must be a real number{' or None' if optional else ''}, got {value!r} ({type(value).__name__})"
        )
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return float(value)


def check_flag(name: str, value: Any) -> bool:
    """`value` as a bool: TypeError for anything else (a string such as "no" is truthy)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's base type (float, int, bool, str, ...) and whether None is allowed."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        out[name] = (base, optional)
    return out


def check_fields(config: object) -> None:
    """Check every float, int, bool and str field of the frozen dataclass `config` by its annotation,
    naming the field, and store numbers as float or int (a numpy float becomes a float)."""
    cls: type = type(config)  # as `type`: mypy reads `type[object]` against Hashable as an unbound __hash__
    for name, (kind, optional) in _field_types(cls).items():
        value = getattr(config, name)
        if value is None and optional:
            continue
        if kind is float:
            value = check_number(name, value, optional=optional)
        elif kind is int:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
            value = int(value)
        elif kind in (bool, str) and not isinstance(value, kind):
            raise TypeError(f"{name} must be a {kind.__name__}, got {value!r} ({type(value).__name__})")
        object.__setattr__(config, name, value)
