"""A step's metrics: the metrics of its loss calls combined over micro-batches and ranks (`StepMetrics`).

A loss call's metrics are over that call's tokens. A step cut into micro-batches and spread over ranks
has its own: a mean over the step's tokens is Σ_k w_k·x_k / Σ_k w_k over the calls k, each weighted by
what it averages over, not the mean of the calls' means (biased as soon as the calls hold different
numbers of tokens: TRL #6380). How each metric combines is said where it is made (`core/metrics.py`:
`Stat`); this file only applies it.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from .distributed import all_reduce, is_distributed, world_size
from .metrics import LOSS, MAX, MEAN, MIN, Stat
from .output import LossOutput


class StepMetrics:
    """The metrics of one optimizer step, from the `LossOutput`s of its calls on every rank.

        step = pgloss.StepMetrics()
        for micro in micro_batches:                 # on every rank
            out = algorithm(**micro, normalizer=normalizer)
            out.loss.backward()
            step.add(out)                           # no host sync
        logged = step.as_floats()                   # two collectives, one host sync
        step.reset()                                # or a new StepMetrics for the next step

    Each metric combines as its `Stat` says: a mean as Σ w·x / Σ w over the step's calls (w: the tokens
    or rows it is a mean over), an extreme as the extreme, a term of the loss (`pg_loss`, `kl_loss`) as
    its sum over micro-batches averaged over ranks (the loss whose gradient DDP's step takes, when every
    call had the step's `Normalizer`). With the step's counts in every call, the step's metrics are
    those of one call on the whole batch.

    Empty calls: a call without valid tokens (its means NaN) adds weight 0 and changes nothing; a metric
    over no token in the whole step is NaN (a mean or extreme over nothing), never 0. A metric absent from
    every call is absent from the result. A value that is NaN at a valid position stays NaN.

    Ranks: under an initialised `torch.distributed` (and `reduce=True`) the step is reduced over
    `process_group`: `compute()` makes exactly two all-reduces (SUM; MAX, minima as maxima of negatives)
    of fixed size, so every rank must call it, even one that added nothing (it then returns no names:
    it knows none). Every rank that added calls must have added the same metric names (the same
    algorithm with the same inputs); otherwise `compute()` gives NaN for every metric and `as_floats()`
    raises. Rank-local: `reduce=False`.

    `dtype`: the accumulation's (float64 by default; float32 where the device has no float64). `device`:
    where a rank that added nothing builds its buffers (default: the added values' device; without any,
    the current CUDA device under NCCL, else the CPU). `capacity`: the most metric slots one step holds.
    """

    def __init__(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        dtype: torch.dtype = torch.float64,
        device: torch.device | str | None = None,
        capacity: int = 256,
    ) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        if not isinstance(reduce, bool):
            raise TypeError(f"reduce must be a bool, got {reduce!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.process_group, self.reduce, self.dtype, self.capacity = process_group, reduce, dtype, capacity
        self.device = None if device is None else torch.device(device)
        self._calls: list[dict[str, Stat]] = []
        self._kinds: dict[str, tuple[str, int, Callable[..., Tensor] | None]] = {}

    def add(self, output: LossOutput | Mapping[str, Stat]) -> None:
        """Add one call's metrics: its `LossOutput` (or a mapping of `Stat`s). No host sync."""
        stats: Mapping[str, Stat]
        if isinstance(output, LossOutput):
            bare = sorted(set(output.metrics) - set(output.stats))
            if bare:
                raise TypeError(
                    f"metrics {bare} are bare tensors that do not say how a step combines them; "
                    "build them as pgloss.core.metrics.Stat (token_mean, Stat.max, ...)"
                )
            stats = output.stats
        elif isinstance(output, Mapping):
            stats = output
        else:
            raise TypeError(f"output must be a pgloss.LossOutput or a mapping of Stat, got {type(output).__name__}")
        for name, stat in stats.items():
            if not isinstance(stat, Stat):
                raise TypeError(f"metric {name!r} must be a pgloss.core.metrics.Stat, got {type(stat).__name__}")
            kind = (stat.reduce, 1 if stat.parts is None else len(stat.parts), stat.finish)
            if stat.reduce not in (MEAN, MAX, MIN, LOSS):
                raise ValueError(f"metric {name!r} has reduce={stat.reduce!r}; expected one of mean, max, min, loss")
            if stat.reduce != LOSS and stat.weight is None:
                raise ValueError(f"metric {name!r} (reduce={stat.reduce!r}) needs its weight: what it is over")
            known = self._kinds.setdefault(name, kind)
            if known != kind:
                raise ValueError(f"metric {name!r} changed how it combines within a step: {known[:2]} then {kind[:2]}")
            if self.device is None:
                self.device = stat.value.device
        self._calls.append(dict(stats))

    def reset(self) -> None:
        """Forget the added calls (a new step)."""
        self._calls.clear()
        self._kinds.clear()

    @property
    def names(self) -> list[str]:
        """The metrics added so far on this rank, sorted."""
        return sorted(self._kinds)

    def compute(self) -> dict[str, Tensor]:
        """The step's metrics, 0-d tensors of `dtype`, reduced over the ranks. No host sync."""
        values, agree = self._reduce()
        nan = torch.full((), torch.nan, dtype=self.dtype, device=agree.device)
        return {name: torch.where(agree, value, nan) for name, value in values.items()}

    def as_floats(self) -> dict[str, float]:
        """`compute()` as Python floats (NaN where undefined), read in one host sync. Raises ValueError
        when the ranks added different metric names."""
        values, agree = self._reduce()
        numbers = torch.stack([agree.to(self.dtype), *values.values()]).tolist()
        if numbers[0] != 1.0:
            raise ValueError(
                "the ranks added different metric names to StepMetrics: every rank must add the "
                "outputs of the same algorithm called with the same inputs"
            )
        return dict(zip(values, numbers[1:], strict=True))

    # -- the reduction ---------------------------------------------------------------------------

    def _buffer_device(self) -> torch.device:
        if self.device is not None:
            return self.device
        if is_distributed(self.reduce) and dist.get_backend(self.process_group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _reduce(self) -> tuple[dict[str, Tensor], Tensor]:
        """(values by name, whether every rank that added calls added these names), two all-reduces."""
        device, dtype = self._buffer_device(), self.dtype
        layout = sorted(self._kinds)
        sums, extremes = [], []  # per name: its slots in the SUM and in the MAX buffer
        for name in layout:
            s, e = self._local(name, device)
            sums.append(s)
            extremes.append(e)
        width_sum = sum(len(s) for s in sums)
        width_max = sum(len(e) for e in extremes)
        if max(width_sum, width_max) > self.capacity:
            raise ValueError(
                f"{len(layout)} metrics take {max(width_sum, width_max)} slots, more than "
                f"capacity={self.capacity}; pass a larger capacity to StepMetrics"
            )
        summed = torch.zeros(self.capacity, dtype=dtype, device=device)
        peaks = torch.full((self.capacity + 4,), -torch.inf, dtype=dtype, device=device)
        if sums:
            summed[:width_sum] = torch.cat(sums)
        if width_max:
            peaks[:width_max] = torch.cat([e for e in extremes if len(e)])
        if layout:  # the layout's fingerprint as two 16-bit halves (exact in float32), its max and -min
            crc = zlib.crc32(repr([(name, *self._kinds[name][:2]) for name in layout]).encode())
            high, low = crc >> 16, crc & 0xFFFF
            for at, value in zip(range(-4, 0), (high, low, -high, -low), strict=True):
                peaks[at].fill_(value)  # a fill: `peaks[at] = value` would copy a host tensor to the device
        all_reduce(summed, self.process_group, self.reduce)
        all_reduce(peaks, self.process_group, self.reduce, op=dist.ReduceOp.MAX)
        agree = ((peaks[-4] == -peaks[-2]) & (peaks[-3] == -peaks[-1])) | (peaks[-4] == -torch.inf)  # or none added
        ranks = world_size(self.process_group, self.reduce)
        values, at_sum, at_max = {}, 0, 0
        for name, s, e in zip(layout, sums, extremes, strict=True):
            part_sums, at_sum = summed[at_sum : at_sum + len(s)], at_sum + len(s)
            peak, at_max = peaks[at_max : at_max + len(e)], at_max + len(e)
            values[name] = self._finish(name, part_sums, peak, ranks)
        return values, agree

    def _local(self, name: str, device: torch.device) -> tuple[Tensor, Tensor]:
        """This rank's slots of `name`: in the SUM buffer (Σ w·part..., Σ w for a mean; the count for an
        extreme; Σ x for a loss term) and in the MAX buffer (the max, or -min)."""
        reduce, n_parts, _ = self._kinds[name]
        stats = [call[name] for call in self._calls if name in call]
        dtype = self.dtype
        none = torch.zeros(0, device=device, dtype=dtype)
        if reduce == LOSS:
            return torch.stack([s.value.to(device, dtype) for s in stats]).sum().reshape(1), none
        weights = []
        for s in stats:
            assert s.weight is not None  # add() refuses a mean or an extreme without its weight
            weights.append(s.weight.to(device, dtype))
        weight = torch.stack(weights)  # [calls]
        if reduce == MEAN:
            parts = torch.stack([torch.stack([p.to(device, dtype) for p in (s.parts or (s.value,))]) for s in stats])
            weighted = torch.where(weight[:, None] > 0, weight[:, None] * parts, 0.0).sum(dim=0)
            return torch.cat([weighted, weight.sum().reshape(1)]), none
        value = torch.stack([s.value.to(device, dtype) for s in stats])
        if reduce == MIN:
            value = -value  # the minimum is the negated maximum of the negatives
        peak = torch.where(weight > 0, value, -torch.inf).amax().reshape(1)
        return weight.sum().reshape(1), peak

    def _finish(self, name: str, sums: Tensor, peak: Tensor, ranks: int) -> Tensor:
        reduce, _, finish = self._kinds[name]
        if reduce == LOSS:
            return sums[0] / ranks
        if reduce == MEAN:
            means = sums[:-1] / sums[-1]  # 0/0 = NaN over no weight
            return means[0] if finish is None else finish(*means)
        value = peak[0] if reduce == MAX else -peak[0]
        return torch.where(sums[0] > 0, value, torch.nan)
