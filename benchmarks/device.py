"""The device side of every benchmark: `--device cpu|cuda`, a clean refusal without CUDA, the
device's name for the report, peak memory above a baseline and the time of one call; and the
runner that gives each variant its own process (`run_variants`) and the table's cells (`cell`).

On CUDA, memory is the caching allocator's `max_memory_allocated` and time is measured with CUDA
events; on CPU, memory is the process's resident high-water mark (one variant per process) and time
is wall-clock with `time.perf_counter` beside the process's CPU time.
"""

from __future__ import annotations

import argparse
import os
import time


def add_device_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="where to run (cuda: peak memory from the caching allocator, time from CUDA events)",
    )


def resolve_device(name: str):
    """torch.device(name), or exit with a one-line reason when CUDA is asked for and absent."""
    import torch

    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "--device cuda: no CUDA device is visible to this torch "
            f"({torch.__version__}, CUDA build: {torch.version.cuda is not None}); run with --device cpu"
        )
    return torch.device(name)


def describe(device) -> str:
    """The device in words, for the first line of a report."""
    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (
            f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    return f"CPU, {torch.get_num_threads()} threads of {os.cpu_count()} cores, torch {torch.__version__}"


def _rss_mib(field: str) -> float:
    """VmRSS / VmHWM of this process in MiB (Linux); ru_maxrss as a fallback for the peak."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Memory:
    """Peak memory above a baseline, on CPU (process RSS) or CUDA (the caching allocator)."""

    def __init__(self, device):
        import torch

        self.torch, self.cuda = torch, device.type == "cuda"
        self.baseline = 0.0

    def set_baseline(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()
            self.baseline = self.torch.cuda.memory_allocated() / 2**20
            self.torch.cuda.reset_peak_memory_stats()
        else:
            self.baseline = _rss_mib("VmRSS")

    def peak_above_baseline(self) -> float:
        if self.cuda:
            return self.torch.cuda.max_memory_allocated() / 2**20 - self.baseline
        return _rss_mib("VmHWM") - self.baseline


def timed(fn, device) -> tuple[float, float]:
    """(seconds, CPU seconds of this process) of fn(): CUDA events on a GPU, perf_counter on CPU
    (CPU time is the steadier figure on a shared machine; on a GPU it is the host's share)."""
    import torch

    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        cpu = time.process_time()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1000, time.process_time() - cpu
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def measure_from_hidden(args, make_inputs, build_variant) -> dict:
    """One variant of a from-hidden-states benchmark, in its child process (`--child <variant>`): the inputs of
    `make_inputs(args, torch, device)` (a `hidden` and a `weight` among them), the gradients' room set aside as the
    memory baseline, a warm-up on one sequence, then one forward and backward of `build_variant(args.child, args)`
    timed, with its peak above the baseline, its loss and ‖∂W‖; a variant that fails to build or warm up is
    reported skipped, with its reason."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = resolve_device(args.device)
    result = {"variant": args.child, "time_s": None, "cpu_s": None, "peak_mib": None, "loss": None, "note": ""}
    inputs = make_inputs(args, torch, device)
    memory = Memory(device)
    placeholders = [torch.ones_like(inputs["hidden"]), torch.ones_like(inputs["weight"])]  # the gradients' room
    memory.set_baseline()
    del placeholders
    try:
        run = build_variant(args.child, args)
        warm = {
            k: (v[:1].detach().requires_grad_() if k == "hidden" else v if "weight" in k else v[:1])
            for k, v in inputs.items()
        }
        run(warm).backward()  # warm-up on one sequence: thread pools, allocator
        del warm
    except Exception as error:
        result["note"] = f"skipped: {str(error).splitlines()[0][:150]}"
        return result
    inputs["weight"].grad = None
    out = {}

    def step():
        loss = run(inputs)
        loss.backward()
        out["loss"] = float(loss.detach())

    seconds, cpu = timed(step, device)
    result.update(
        time_s=seconds,
        cpu_s=cpu,
        peak_mib=memory.peak_above_baseline(),
        loss=out["loss"],
        grad_w_norm=float(inputs["weight"].grad.norm()),
    )
    return result


def run_variant(script: str, argv: list[str], variant: str, timeout: float) -> dict:
    """One variant in its own process (`script` with `argv` and `--child <variant>`), so that its peak
    memory is its own: the JSON line it prints, or a note saying why there is none (with `status`
    "timed out" or "failed"; a failed one keeps the last 4,000 characters of its stderr in `stderr`, the
    traceback a table cell cannot hold)."""
    import json
    import subprocess
    import sys

    command = [sys.executable, os.path.abspath(script), *argv, "--child", variant]
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "status": "timed out", "note": f"stopped after {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        reason = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        return {
            "variant": variant,
            "status": "failed",
            "note": f"failed: {reason[:150]}",
            "stderr": proc.stderr[-4000:],
        }
    return json.loads(lines[-1])


def run_variants(script: str, argv: list[str], variants: list[str], timeout: float) -> list[dict]:
    """`run_variant` for each of `variants`, in order."""
    return [run_variant(script, argv, variant, timeout) for variant in variants]


def cell(value, spec: str, width: int) -> str:
    """A table cell: `value` formatted by `spec`, "-" when absent, right-aligned to `width`."""
    return ("-" if value is None else format(value, spec)).rjust(width)
