"""Time of the plain loss from log-probabilities: pgloss against verl's compute_policy_loss_vanilla.

Both compute dual-clip PPO (ε = 0.2, c = 3) on the same [B, T] float32 batch with uneven
lengths and per-token advantages, forward and backward to `log_prob`, with their metrics
(verl: pg_clipfrac, ppo_kl, pg_clipfrac_lower; pgloss: those and the high/low split, ratio
mean/max/min). The global counts are given to both, as a trainer's engine gives them:
verl's `global_batch_info`, pgloss's `Normalizer` (counted once per step, outside the loop).

pgloss runs eager, and its loss call under `torch.compile(fullgraph=True)` (inductor; the backward
is compiled too; compile time is spent in the warm-up, not timed), and on CUDA a third time under
`mode="reduce-overhead"` (CUDA graphs: the compiled kernels replayed as one graph, without a launch
each). The call has no host sync and no graph break, so the whole loss is one graph.
`--no-compile` leaves both compiled columns out.

The metrics are read on the host after each step as a trainer logs them: `--read each` (the default)
reads each value by itself (`float(v)`: a copy and a sync each on a GPU, as verl's actor does),
`--read once` stacks them into one copy, `--read none` leaves them on the device.

Runs are interleaved (verl, pgloss, pgloss compiled, verl, ...) so that the machine's load hits all
alike; the median of each is reported with the ratios. `--profile` then runs each implementation
under `torch.profiler` and prints, per step, the host's time, the device's kernels and their time,
and the operations that took the host longest: where a step's time goes.

    python benchmarks/plain.py --batch 64 --length 4096 --repeats 30 --threads 1
    python benchmarks/plain.py --device cuda --batch 256 --length 8192 --read once --profile

verl is never a runtime dependency of pgloss: `make test` installs verl 0.9.1 (--no-deps, plus what
its loss path imports) into .venv for the adapters' tests, and this benchmark reads its loss from those
files (peers.verl_policy_loss: verl's own functions, without importing its package, which needs ray).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import pgloss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, describe, resolve_device
from device import timed as timed_call
from peers import VerlActorConfig, installed, verl_policy_loss

MODES = ("token-mean", "seq-mean-token-mean")
READS = ("each", "once", "none")
COMPILED = {"compiled": "default", "graphs": "reduce-overhead"}
"""pgloss's compiled implementations: torch.compile's mode for each."""
CUDA_ONLY = {"graphs": "CUDA graphs (torch.compile's reduce-overhead mode) need CUDA"}
"""The compiled implementations a CPU run leaves out, with why (a result's `absent`; inductor skips the graphs on a
CPU, which would time the compiled row again)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="B, sequences")
    parser.add_argument("--length", type=int, default=4096, help="T, padded length")
    parser.add_argument("--repeats", type=int, default=30, help="timed runs of each implementation")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--modes", default=",".join(MODES), help="loss_agg_modes, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-compile", dest="compile", action="store_false", help="leave out pgloss under torch.compile"
    )
    parser.add_argument(
        "--read",
        choices=READS,
        default="each",
        help="how the metrics reach the host after a step, for both libraries: each value by itself, "
        "all in one copy, or not at all",
    )
    parser.add_argument(
        "--no-read-metrics", dest="read", action="store_const", const="none", help="the same as --read none"
    )
    parser.add_argument(
        "--profile", action="store_true", help="after the timing, where each implementation's step time goes"
    )
    add_device_argument(parser)
    parser.add_argument("--child", default=None, help="one loss_agg_mode, its results as one JSON line")
    return parser.parse_args(argv)


def make_batch(batch: int, length: int, seed: int, device=None) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 8, length + 1, (batch,), generator=gen)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    old = -torch.rand(batch, length, generator=gen) * 3
    data = {
        "old_log_prob": old,
        "log_prob": -(old + 0.2 * torch.randn(batch, length, generator=gen)).abs(),  # log-probs are <= 0
        "advantages": torch.randn(batch, length, generator=gen),
        "mask": mask,
    }
    return {k: v.to(device) for k, v in data.items()} if device is not None else data


def read_metrics(metrics: dict, read: str):
    """The step's metrics as a trainer takes them to the host (`--read`): each by itself, all in one copy, or
    left where they are."""
    if read == "each":
        return {k: float(v) for k, v in metrics.items()}
    if read == "once":
        on_device = {k: v for k, v in metrics.items() if isinstance(v, torch.Tensor)}  # verl's may be floats
        values = torch.stack([v.float() for v in on_device.values()]).tolist() if on_device else []
        return {**metrics, **dict(zip(on_device, values, strict=True))}
    return metrics


def verl_step(mode: str, data: dict, *, read: str = "each"):
    verl = verl_policy_loss()  # read from verl's files: no ray needed
    mask = data["mask"]
    config = VerlActorConfig(clip_ratio=0.2, clip_ratio_c=3.0)
    config.global_batch_info.update(
        dp_size=1,
        batch_num_tokens=int(mask.sum()),  # as verl's ppo_loss fills it
        global_batch_size=int(mask.any(dim=1).sum()),
    )
    response_mask = mask.float()

    def step(log_prob):
        loss, metrics = verl["compute_policy_loss_vanilla"](
            data["old_log_prob"], log_prob, data["advantages"], response_mask, loss_agg_mode=mode, config=config
        )
        loss.backward()
        return loss.detach(), read_metrics(metrics, read)

    return step


def pgloss_step(mode: str, data: dict, *, compile_mode: str | None = None, read: str = "each"):
    """One step of pgloss's dual-clip PPO: eager, or its call under `torch.compile(mode=compile_mode)`."""
    algorithm = pgloss.get("dual_clip_ppo", loss_agg_mode=mode)
    normalizer = pgloss.Normalizer.count(data["mask"])

    def call(log_prob):
        out = algorithm(log_prob, data["old_log_prob"], data["advantages"], data["mask"], normalizer=normalizer)
        return out.loss, out.metrics

    if compile_mode is not None:
        call = torch.compile(call, fullgraph=True, mode=compile_mode)

    def step(log_prob):
        loss, metrics = call(log_prob)
        loss.backward()
        return loss.detach(), read_metrics(metrics, read)

    return step


def implementations(mode: str, data: dict, args) -> dict:
    """The steps this run compares, by name: verl (where installed), pgloss eager, and with compile pgloss
    compiled, and on CUDA pgloss under CUDA graphs (`CUDA_ONLY`)."""
    steps = {"verl": verl_step(mode, data, read=args.read)} if installed("verl") else {}
    steps["pgloss"] = pgloss_step(mode, data, read=args.read)
    if args.compile:
        for name, compile_mode in COMPILED.items():
            if name not in CUDA_ONLY or data["mask"].is_cuda:
                steps[name] = pgloss_step(mode, data, compile_mode=compile_mode, read=args.read)
    return steps


def timed(step, data) -> tuple[float, torch.Tensor, torch.Tensor]:
    log_prob = data["log_prob"].clone().requires_grad_(True)
    result = {}
    seconds, _ = timed_call(lambda: result.update(loss=step(log_prob)[0]), log_prob.device)
    return seconds, result["loss"], log_prob.grad


def measure(mode: str, data: dict, args) -> dict:
    """One loss_agg_mode: the median milliseconds of verl, pgloss and (with compile) pgloss compiled over
    `args.repeats` interleaved runs, and the largest differences of their losses and gradients (pgloss's
    alone, with None against verl, where verl is not installed)."""
    steps = implementations(mode, data, args)
    times = {name: [] for name in steps}
    for _ in range(3):  # warm-up (and, for the compiled step, compilation)
        for step in steps.values():
            timed(step, data)
    for _ in range(args.repeats):
        for name, step in steps.items():
            times[name].append(timed(step, data)[0])
    results = {name: timed(step, data) for name, step in steps.items()}
    _, our_loss, our_grad = results["pgloss"]
    row = {
        "mode": mode,
        "ms": {name: 1e3 * statistics.median(times[name]) for name in steps},
        "loss": float(our_loss),
        "verl_loss": None,
        "loss_vs_verl": None,
        "grad_vs_verl": None,
        "absent": {name: CUDA_ONLY[name] for name in COMPILED if args.compile and name not in steps},
    }
    if "verl" in results:
        _, verl_loss, verl_grad = results["verl"]
        row.update(
            verl_loss=float(verl_loss),
            loss_vs_verl=abs(float(verl_loss - our_loss)),
            grad_vs_verl=float((verl_grad - our_grad).abs().max()),
        )
    for name in COMPILED:
        if name in results:
            _, c_loss, c_grad = results[name]
            row.update(
                {
                    f"{name}_loss": float(c_loss),
                    f"{name}_vs_eager": abs(float(c_loss - our_loss)),
                    f"{name}_grad_vs_eager": float((c_grad - our_grad).abs().max()),
                }
            )
    if args.profile:
        row["profile"] = {name: profile(step, data) for name, step in steps.items()}
    return row


def profile(step, data, steps: int = 10) -> dict:
    """Where one step's time goes, over `steps` steps under torch.profiler: the host's milliseconds a step,
    the device kernels a step and their milliseconds (CUDA only), and the five operations with the most host
    time of their own."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    cuda = data["mask"].is_cuda
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    log_prob = data["log_prob"].clone().requires_grad_(True)
    step(log_prob)  # a replay outside the profile: the graphs' first use is not this one
    with profiler(activities=activities) as prof:
        wall = time.perf_counter()
        for _ in range(steps):
            log_prob.grad = None
            step(log_prob)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - wall
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    return {
        "host_ms": 1e3 * wall / steps,
        "kernels": len(kernels) / steps,
        "device_ms": sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / steps if cuda else None,
        "top": [(e.key, e.self_cpu_time_total / 1e3 / steps) for e in ops[:5]],
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    data = make_batch(args.batch, args.length, args.seed, device)
    if args.child:
        print(json.dumps(measure(args.child, data, args)))
        return
    if not installed("verl"):
        raise SystemExit(
            "verl is not installed: `make test` installs verl 0.9.1 into .venv (its files are read, ray is not needed)"
        )
    print(
        f"{describe(device)}; B={args.batch}, T={args.length}, {int(data['mask'].sum())} valid tokens, float32, "
        f"{args.repeats} interleaved runs each; metrics read: {args.read}"
    )
    rows = [measure(mode, data, args) for mode in args.modes.split(",")]
    compiled = [name for name in COMPILED if name in rows[0]["ms"]]
    header = f"{'loss_agg_mode':<22}{'verl (ms)':>11}{'pgloss (ms)':>13}{'ratio':>8}"
    header += "".join(f"{name + ' (ms)':>15}{'/ eager':>9}{'/ verl':>8}" for name in compiled)
    print(header + "   max |Δloss|  max |Δgrad|" + "".join(f"  {name}: |Δloss|  |Δgrad|" for name in compiled))
    for row in rows:
        ms = row["ms"]
        line = f"{row['mode']:<22}{ms['verl']:>11.2f}{ms['pgloss']:>13.2f}{ms['pgloss'] / ms['verl']:>8.3f}"
        line += "".join(f"{ms[n]:>15.2f}{ms[n] / ms['pgloss']:>9.3f}{ms[n] / ms['verl']:>8.3f}" for n in compiled)
        line += f"   {row['loss_vs_verl']:.2e}     {row['grad_vs_verl']:.2e}"
        line += "".join(f"     {row[n + '_vs_eager']:.2e}  {row[n + '_grad_vs_eager']:.2e}" for n in compiled)
        print(line)
    for row in rows if args.profile else []:
        print(f"\nwhere a step's time goes, {row['mode']} (torch.profiler, 10 steps):")
        for name, seen in row["profile"].items():
            device_ms = "-" if seen["device_ms"] is None else f"{seen['device_ms']:.3f}"
            top = ", ".join(f"{op} {ms:.3f}" for op, ms in seen["top"])
            print(
                f"  {name:<9} host {seen['host_ms']:.3f} ms, {seen['kernels']:.0f} kernels, device {device_ms} ms;"
                f" host ms by op: {top}"
            )


if __name__ == "__main__":
    main()
