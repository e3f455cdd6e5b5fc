"""Time of the plain loss from log-probabilities: pgloss against verl's compute_policy_loss_vanilla.

Both compute dual-clip PPO (ε = 0.2, c = 3) on the same [B, T] float32 batch with uneven
lengths and per-token advantages, forward and backward to `log_prob`, with their metrics
(verl: pg_clipfrac, ppo_kl, pg_clipfrac_lower; pgloss: those and the high/low split, ratio
mean/max/min). The global counts are given to both, as a trainer's engine gives them:
verl's `global_batch_info`, pgloss's `Normalizer` (counted once per step, outside the loop).

pgloss runs twice: eager, and its loss call under `torch.compile(fullgraph=True)` (inductor; the
backward is compiled too; compile time is spent in the warm-up, not timed). The call has no host
sync and no graph break, so the whole loss is one graph. `--no-compile` leaves that column out.

Runs are interleaved (verl, pgloss, pgloss compiled, verl, ...) so that the machine's load hits all
alike; the median of each is reported with the ratios.

    python benchmarks/plain.py --batch 64 --length 4096 --repeats 30 --threads 1

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

import torch

import pgloss

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, describe, resolve_device
from device import timed as timed_call
from peers import VerlActorConfig, installed, verl_policy_loss

MODES = ("token-mean", "seq-mean-token-mean")


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
        "--no-read-metrics",
        dest="read_metrics",
        action="store_false",
        help="leave every metric on the device (no host read after the step), for both libraries",
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


def verl_step(mode: str, data: dict, *, read_metrics: bool = True):
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
        return loss.detach(), ({k: float(v) for k, v in metrics.items()} if read_metrics else metrics)

    return step


def pgloss_step(mode: str, data: dict, *, compiled: bool = False, read_metrics: bool = True):
    algorithm = pgloss.get("dual_clip_ppo", loss_agg_mode=mode)
    normalizer = pgloss.Normalizer.count(data["mask"])

    def call(log_prob):
        out = algorithm(log_prob, data["old_log_prob"], data["advantages"], data["mask"], normalizer=normalizer)
        return out.loss, out.metrics

    if compiled:
        call = torch.compile(call, fullgraph=True)

    def step(log_prob):
        loss, metrics = call(log_prob)
        loss.backward()
        return loss.detach(), ({k: float(v) for k, v in metrics.items()} if read_metrics else metrics)

    return step


def timed(step, data) -> tuple[float, torch.Tensor, torch.Tensor]:
    log_prob = data["log_prob"].clone().requires_grad_(True)
    result = {}
    seconds, _ = timed_call(lambda: result.update(loss=step(log_prob)[0]), log_prob.device)
    return seconds, result["loss"], log_prob.grad


def measure(mode: str, data: dict, args) -> dict:
    """One loss_agg_mode: the median milliseconds of verl, pgloss and (with compile) pgloss compiled over
    `args.repeats` interleaved runs, and the largest differences of their losses and gradients (pgloss's
    alone, with None against verl, where verl is not installed)."""
    read = args.read_metrics
    steps = {"verl": verl_step(mode, data, read_metrics=read)} if installed("verl") else {}
    steps["pgloss"] = pgloss_step(mode, data, read_metrics=read)
    if args.compile:
        steps["compiled"] = pgloss_step(mode, data, compiled=True, read_metrics=read)
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
    }
    if "verl" in results:
        _, verl_loss, verl_grad = results["verl"]
        row.update(
            verl_loss=float(verl_loss),
            loss_vs_verl=abs(float(verl_loss - our_loss)),
            grad_vs_verl=float((verl_grad - our_grad).abs().max()),
        )
    if args.compile:
        _, c_loss, c_grad = results["compiled"]
        row.update(
            compiled_loss=float(c_loss),
            compiled_vs_eager=abs(float(c_loss - our_loss)),
            compiled_grad_vs_eager=float((c_grad - our_grad).abs().max()),
        )
    return row


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
        f"{args.repeats} interleaved runs each; metrics {'read on the host' if args.read_metrics else 'not read'}"
    )
    header = f"{'loss_agg_mode':<22}{'verl (ms)':>11}{'pgloss (ms)':>13}{'ratio':>8}"
    if args.compile:
        header += f"{'compiled (ms)':>15}{'/ eager':>9}{'/ verl':>8}"
    print(header + "   max |Δloss|  max |Δgrad|" + ("  compiled: |Δloss|  |Δgrad|" if args.compile else ""))
    for mode in args.modes.split(","):
        row = measure(mode, data, args)
        ms = row["ms"]
        line = f"{mode:<22}{ms['verl']:>11.2f}{ms['pgloss']:>13.2f}{ms['pgloss'] / ms['verl']:>8.3f}"
        if args.compile:
            line += f"{ms['compiled']:>15.2f}{ms['compiled'] / ms['pgloss']:>9.3f}{ms['compiled'] / ms['verl']:>8.3f}"
        line += f"   {row['loss_vs_verl']:.2e}     {row['grad_vs_verl']:.2e}"
        if args.compile:
            line += f"     {row['compiled_vs_eager']:.2e}  {row['compiled_grad_vs_eager']:.2e}"
        print(line)


if __name__ == "__main__":
    main()
