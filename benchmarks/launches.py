"""Kernel launches of the plain loss from log-probabilities: pgloss against verl's compute_policy_loss_vanilla.

On a GPU each aten operation that computes is one kernel launch, and at B = 64, T = 4096 a loss's
kernels are short: their count, not their arithmetic, sets the eager time. This counts them on
the CPU, with no GPU: every aten operation dispatched in the forward call (the loss and its
metrics), in the backward pass (`loss.backward()`) and in reading the metrics to the host, seen
below autograd by a `TorchDispatchMode` (the operations a CUDA run would launch, one by one).

What is counted as a launch: every operation but views (`detach`, `expand`, `view`, `select`, ...:
metadata only) and bare allocations (`empty`, `empty_strided`, ...). A 0-d `scalar_tensor` is
counted: `torch.where(mask, x, 0.0)` fills its 0.0 on x's device (one launch on CUDA). A read of a
value on the host (`_local_scalar_dense`, from `.item()` or `float()`) is counted apart, as `reads`:
a copy to the host and a sync each. pgloss is counted on its accelerator path
(`pgloss.core.checks.as_on_accelerator`: the value checks a CPU call runs for free are skipped, the
log-prob check is an assert on the device), which is what a CUDA call launches.

Both libraries get the same batch as `benchmarks/plain.py` (uneven lengths, per-token advantages,
float32, the step's counts given); verl's loss is dual-clip PPO always (`clip_ratio_c` = 3), so its
row is compared with pgloss's `dual_clip_ppo`, and pgloss's `ppo` (GRPO's loss without its KL
term) is counted beside it. The time of one forward and backward with the metrics read (interleaved
runs, the median; CPU by default, `--device cuda` on a GPU) is measured in the same run, with its
ratio to verl's.

    python benchmarks/launches.py --batch 64 --length 4096 --repeats 15 --threads 1
    python benchmarks/launches.py --ops      # each operation, in order, for every row
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pgloss
from pgloss.core.checks import as_on_accelerator

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, describe, resolve_device
from peers import VerlActorConfig, installed, verl_policy_loss
from plain import make_batch, timed

ALLOCATIONS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
"""Operations that allocate without writing: no kernel."""
READS = {"_local_scalar_dense"}
"""A value read on the host (`.item()`, `float()`): a copy to the host and a sync on CUDA."""


class Operations(TorchDispatchMode):
    """The aten operations dispatched inside the context, by kind: `launches` (names in order), `reads`, `views`."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []
        self.reads = 0
        self.views = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in READS:
            self.reads += 1
        elif func.is_view or name in ALLOCATIONS:
            self.views += 1
        else:
            self.launches.append(name)
        return func(*args, **(kwargs or {}))


Call = Callable[[torch.Tensor], tuple[torch.Tensor, dict]]
"""log_prob -> (loss, metrics): one library's forward call."""


def verl_call(mode: str, data: dict) -> Call:
    verl = verl_policy_loss()
    mask = data["mask"]
    config = VerlActorConfig(clip_ratio=0.2, clip_ratio_c=3.0)
    config.global_batch_info.update(
        dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=int(mask.any(dim=1).sum())
    )
    response_mask = mask.float()  # outside the call: verl's trainer holds the float mask

    def call(log_prob):
        return verl["compute_policy_loss_vanilla"](
            data["old_log_prob"], log_prob, data["advantages"], response_mask, loss_agg_mode=mode, config=config
        )

    return call


def pgloss_call(name: str, mode: str, data: dict) -> Call:
    algorithm = pgloss.get(name, loss_agg_mode=mode)
    normalizer = pgloss.Normalizer.count(data["mask"])

    def call(log_prob):
        out = algorithm(log_prob, data["old_log_prob"], data["advantages"], data["mask"], normalizer=normalizer)
        return out.loss, out.metrics

    return call


def count(call: Call, data: dict) -> dict:
    """The operations of one forward call, its backward pass and the host read of its metrics."""
    log_prob = data["log_prob"].clone().requires_grad_(True)
    call(log_prob)[0].backward()  # warm-up: first-call work (caches, lazy imports) is not the call's
    log_prob.grad = None
    with as_on_accelerator(), Operations() as forward:
        loss, metrics = call(log_prob)
    with Operations() as backward:
        loss.backward()
    with Operations() as read:
        [float(value) for value in metrics.values()]
    return {"forward": forward, "backward": backward, "read": read, "metrics": len(metrics)}


def step(call: Call) -> Callable[[torch.Tensor], tuple[torch.Tensor, dict]]:
    """Forward, backward and the metrics read to the host, as a trainer's step does (`plain.timed` times it)."""

    def run(log_prob):
        loss, metrics = call(log_prob)
        loss.backward()
        return loss.detach(), {key: float(value) for key, value in metrics.items()}

    return run


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="B, sequences")
    parser.add_argument("--length", type=int, default=4096, help="T, padded length")
    parser.add_argument("--repeats", type=int, default=15, help="timed runs of each row (0: counts only)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--modes", default="token-mean,seq-mean-token-mean", help="loss_agg_modes, comma-separated")
    parser.add_argument("--names", default="dual_clip_ppo,ppo", help="pgloss names, comma-separated")
    parser.add_argument("--ops", action="store_true", help="print each row's operations in order")
    parser.add_argument("--seed", type=int, default=0)
    add_device_argument(parser)
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    if not installed("verl"):
        raise SystemExit("verl is not installed: `make test` installs verl 0.9.1 into .venv (its files are read)")
    data = make_batch(args.batch, args.length, args.seed, device)
    print(
        f"{describe(device)}; B={args.batch}, T={args.length}, "
        f"{int(data['mask'].sum())} valid tokens, float32; launches: aten operations but views and allocations; "
        f"time: forward + backward + metrics read, median of {args.repeats} interleaved runs"
    )
    header = f"{'loss_agg_mode':<21}{'call':<16}{'forward':>8}{'backward':>9}{'total':>6}{'reads':>6}{'metrics':>8}"
    print(header + (f"{'ms':>9}{'/ verl':>8}" if args.repeats else ""))
    for mode in args.modes.split(","):
        calls = {"verl": verl_call(mode, data)}
        calls |= {f"pgloss {name}": pgloss_call(name, mode, data) for name in args.names.split(",")}
        counts = {label: count(call, data) for label, call in calls.items()}
        ms = {}
        if args.repeats:
            steps = {label: step(call) for label, call in calls.items()}
            times: dict[str, list[float]] = {label: [] for label in steps}
            for k in range(args.repeats + 2):  # two warm-up rounds
                for label, run in steps.items():
                    seconds = timed(run, data)[0]
                    if k >= 2:
                        times[label].append(seconds)
            ms = {label: 1e3 * statistics.median(values) for label, values in times.items()}
        for label, c in counts.items():
            f, b = len(c["forward"].launches), len(c["backward"].launches)
            reads = c["forward"].reads + c["backward"].reads + c["read"].reads
            line = f"{mode:<21}{label:<16}{f:>8}{b:>9}{f + b:>6}{reads:>6}{c['metrics']:>8}"
            if ms:
                line += f"{ms[label]:>9.2f}{ms[label] / ms['verl']:>8.3f}"
            print(line)
        if args.ops:
            for label, c in counts.items():
                for part in ("forward", "backward"):
                    ops = c[part].launches
                    print(f"  {mode} {label} {part} ({len(ops)}): {' '.join(ops)}")
                    print(f"    by name: {dict(Counter(ops).most_common())}")


if __name__ == "__main__":
    main()
