"""A detector of host syncs that runs on CPU tensors: the operations that make the host wait for an
accelerator, refused by name while a loss call runs (forward and backward).

`meta` tensors catch a host *read* (an `.item()`, `bool(tensor)`, indexing by a tensor); they cannot
see the other kind of sync, a tensor built from Python data on the device (`x.new_tensor(-inf)`,
`torch.tensor(c, device=...)`: a host-to-device copy, which CUDA's sync debug mode reports), nor an
operation whose output size depends on values (`nonzero`, boolean indexing), which meta tensors
run as if nothing were read. On CPU, with real values, every one of them is an aten call that a
`TorchDispatchMode` sees (measured on torch 2.13):

| what the code does | what dispatches |
|---|---|
| `.item()`, `bool(t)`, `int(t)`, `float(t)`, `x[t]` with a 0-d `t` | `aten._local_scalar_dense` |
| `torch.tensor(...)`, `t.new_tensor(...)`, `torch.as_tensor(number or list)` | `aten.lift_fresh` |
| `t.nonzero()`, `torch.where(cond)`, `torch.argwhere` | `aten.nonzero` |
| `x[bool mask]`, `x[bool mask] = v` | `aten.index.Tensor` / `aten.index_put_` with a bool index |
| `torch.equal`, `torch.allclose` | `aten.equal` / `aten.allclose` (a Python bool) |
| `t.tolist()`, `t.numpy()` | nothing: caught by name with a `TorchFunctionMode` |

Allowed, since none of them waits for the device: fills (`torch.full`, `new_full`, `zeros`), a Python
number as an operand (`torch.where(c, x, 0.0)` dispatches `aten.scalar_tensor`, a CPU scalar passed
to the kernel as an argument), `torch._assert_async` (checked on the device, reported later).

One compile hazard is refused beside them (`HAZARDS`): a dtype view, `t.view(torch.uint8)`.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten


class HostSync(AssertionError):
    """An operation that would make the host wait for the device, with the operation's name."""


# Operations that wait for the device whatever their arguments.
ALWAYS = {
    aten._local_scalar_dense.default: "reads a value on the host (.item(), bool(), int(), float(), a 0-d tensor index)",
    aten.lift_fresh.default: "builds a tensor from Python data (torch.tensor, new_tensor, as_tensor): a host-to-device copy",
    aten.lift_fresh_copy.default: "builds a tensor from Python data: a host-to-device copy",
    aten.nonzero.default: "an output whose size depends on values (nonzero, torch.where(cond), argwhere)",
    aten.masked_select.default: "an output whose size depends on values (masked_select)",
    aten._unique2.default: "an output whose size depends on values (unique)",
    aten.unique_dim.default: "an output whose size depends on values (unique)",
    aten.unique_consecutive.default: "an output whose size depends on values (unique_consecutive)",
    aten.bincount.default: "an output whose size depends on values (bincount)",
    aten.equal.default: "returns a Python bool (torch.equal)",
    aten.allclose.default: "returns a Python bool (torch.allclose)",
    aten.is_nonzero.default: "returns a Python bool",
}
READ_BY_NAME = ("tolist", "numpy", "__array__")  # Tensor methods that read values without an aten call
# Not a sync, a compile hazard of the same code: a tensor's bits viewed as another dtype. Inductor's CUDA
# split reductions refused `mask.view(torch.uint8).argmax()` at real sizes ("torch.bool is not supported
# by torch.iinfo"), while the small shapes a test compiles went through; convert (`.to`) instead.
HAZARDS = {aten.view.dtype: "views a tensor's bits as another dtype (a compile hazard: convert with .to)"}


def sync_reason(func, args, kwargs) -> str | None:
    """Why `func(*args, **kwargs)` waits for the device, or None."""
    if func in ALWAYS:
        return ALWAYS[func]
    if func in HAZARDS:
        return HAZARDS[func]
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1] if i is not None):
            return "indexes by a bool mask (a nonzero inside: the output size depends on values)"
    if (
        func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor)
        and kwargs.get("output_size") is None
    ):
        return "repeat_interleave without output_size (the output size depends on values)"
    if func is aten._to_copy.default and "device" in kwargs and kwargs["device"] is not None:
        source, target = args[0].device, torch.device(kwargs["device"])
        if source.type != target.type:
            return f"copies from {source} to {target}"
    return None


class _DispatchDetector(TorchDispatchMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = sync_reason(func, args, kwargs)
        if reason is not None:
            self.record(f"{func}: {reason}")
        return func(*args, **kwargs)


class _FunctionDetector(TorchFunctionMode):
    def __init__(self, record):
        super().__init__()
        self.record = record

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in READ_BY_NAME and args and isinstance(args[0], torch.Tensor):
            self.record(f"Tensor.{func.__name__}: reads values on the host")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def no_host_sync():
    """Raise `HostSync` at the first operation that would wait for an accelerator (or view a tensor's
    bits as another dtype, `HAZARDS`), inside the context (autograd's backward, run from inside it,
    included). The value checks that read inputs on the host
    for free on CPU run as on an accelerator (skipped: `pgloss.core.checks.as_on_accelerator`)."""
    from pgloss.core.checks import as_on_accelerator

    def record(what):
        raise HostSync(what)

    with as_on_accelerator(), _FunctionDetector(record), _DispatchDetector(record):
        yield


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
"""Where the sync checks run: CPU everywhere (the detector above), and CUDA where there is a GPU."""


@contextlib.contextmanager
def no_host_sync_on(device):
    """`no_host_sync()` on CPU; on CUDA the device's own check, `torch.cuda.set_sync_debug_mode("error")`,
    which raises at the first call that waits on the host. The inputs go to the device before the context
    (their copy is a sync of its own)."""
    if torch.device(device).type != "cuda":
        with no_host_sync():
            yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def on(device, tensors: dict) -> dict:
    """The dict's tensors moved to `device`."""
    return {key: value.to(device) for key, value in tensors.items()}
