"""pgloss against its peers on one GPU, in one command: each row printed the moment it is measured and
written to a JSON file at once, so that a run cut short keeps its rows.

Sections (each variant in its own process, run by the benchmark that owns it):
  hidden      the loss from hidden states (benchmarks/fused.py), GRPO, on N = 4096, H = 896, V = 151936
              and N = 16384, H = 3584, V = 152064 (T = 256) in bfloat16: the float64 reference, the matmul
              floor, materialised logits (naive), pgloss fused (the route the library picks: its Triton
              kernels on CUDA), the same on the torch route (fused-torch; on a CPU, skipped: the fused
              row's route) and on the head-kernel route (fused-head-kernel; CUDA only), tiled, TRL's
              ChunkedLogProbFunction, torch's linear_cross_entropy, Cut Cross-Entropy and Liger
  plain       the loss from log-probabilities (benchmarks/plain.py), dual-clip PPO on B = 64 x T = 4096
              and B = 256 x T = 8192 in float32, token-mean and seq-mean-token-mean: verl's
              compute_policy_loss_vanilla (read from its files: ray is not needed), pgloss eager, under
              torch.compile, and under CUDA graphs (torch.compile's reduce-overhead mode; CUDA only)
  divergence  the student-teacher JSD(0.5) from hidden states (benchmarks/divergence.py), N = 4096,
              H = 896, V = 151936 in float32: materialised, pgloss fused and tiled, TRL's
              ChunkedDivergenceFunction

A row's figures: its time (median of the repeats; CUDA events), its peak memory above the floor (the
inputs and room for their gradients), both as ratios to the section's baseline (materialised logits;
verl for the plain loss), its time over the matmul floor's (6·N·H·V flops), and its loss against the
section's reference (the float64 loss on materialised logits of the same inputs; verl's for the plain
loss; the float32 materialised divergence). A peer that is not installed, or that needs CUDA on a CPU
run, is a row that says so. `--budget` bounds the whole run: every process gets at most what is left,
and the rows past it are written as skipped.

    python benchmarks/gpu.py                          # cuda, about 8 minutes on an H100
    python benchmarks/gpu.py --device cpu --quick     # tiny shapes on a CPU: the command's own check
    python benchmarks/gpu.py --wheels .gpu-wheels     # first install the missing peers from that folder

The JSON file (--out, default benchmarks/results/gpu.json) is never overwritten: when it exists, the
run writes gpu-2.json, gpu-3.json, ... beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers
from device import cell, describe, resolve_device, run_variant

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Case:
    """One section's shape and how long each of its processes may take."""

    section: str
    sizes: dict
    """the owning benchmark's size arguments (flag name without dashes -> value)"""
    repeats: int
    timeout: float
    """seconds for one variant's process (less when the budget has less left)"""
    slow: dict = field(default_factory=dict)
    """variant -> (repeats, timeout) for the slow peers of this shape"""

    @property
    def label(self) -> str:
        s = self.sizes
        if self.section == "plain":
            return f"B={s['batch']} T={s['length']} float32"
        return f"N={s['tokens']} H={s['hidden']} V={s['vocab']} {s.get('dtype', 'float32')}"


FULL = (
    Case(
        "hidden",
        dict(tokens=4096, seq_len=256, hidden=896, vocab=151936, dtype="bfloat16"),
        repeats=5,
        timeout=45,
        slow={"liger": (3, 60), "liger-static": (3, 60)},
    ),
    Case(
        "hidden",
        dict(tokens=16384, seq_len=256, hidden=3584, vocab=152064, dtype="bfloat16"),
        repeats=3,
        timeout=75,
        slow={"liger": (1, 90), "liger-static": (1, 90)},
    ),
    Case("plain", dict(batch=64, length=4096), repeats=30, timeout=90),
    Case("plain", dict(batch=256, length=8192), repeats=20, timeout=120),
    Case("divergence", dict(tokens=4096, seq_len=256, hidden=896, vocab=151936), repeats=1, timeout=45),
)
QUICK = (
    Case("hidden", dict(tokens=256, seq_len=64, hidden=64, vocab=2048, dtype="bfloat16"), repeats=2, timeout=60),
    Case("plain", dict(batch=4, length=128), repeats=3, timeout=60),
    Case("divergence", dict(tokens=128, seq_len=64, hidden=32, vocab=1024), repeats=1, timeout=60),
)

HIDDEN = (
    "reference",
    "floor",
    "naive",
    "fused",
    "fused-torch",
    "fused-head-kernel",
    "tiled",
    "trl",
    "lce",
    "cce",
    "liger",
    "liger-static",
)
"""The hidden-state variants in the order they run: the reference and the baselines first, so that every
later row's ratios and agreement are known when it is printed; the slowest peer last (twice: warmed up on
another shape, as every row is, and on the timed one, which tells a recompilation's failure from Liger's)."""
DIVERGENCE = ("materialised", "fused", "tiled", "trl")
PLAIN_MODES = ("token-mean", "seq-mean-token-mean")
PLAIN_ROWS = {"verl": "verl", "pgloss": "pgloss", "compiled": "pgloss compiled", "graphs": "pgloss CUDA graphs"}
"""The plain section's rows: plain.py's implementations, by the key of its result."""
NEEDS = {
    ("hidden", "trl"): "trl",
    ("hidden", "liger"): "liger",
    ("hidden", "liger-static"): "liger",
    ("hidden", "cce"): "cce",
    ("divergence", "trl"): "trl",
    ("plain", "verl"): "verl",
}
"""(section, variant) -> the peer (peers.PEERS) it measures."""
TRITON = {"liger", "cce"}
"""The peers whose kernels are Triton's."""
SAME_ON_CPU = {
    ("hidden", "fused-torch"): ("fused", "the library's route is the torch route"),
    ("hidden", "liger-static"): ("liger", "inductor's CPU code never meets the recompilation's failure it tells apart"),
}
"""(section, variant) -> (the row that already measures it on a CPU, why): a second process would time the same
computation (the library's own route there is the torch route, pgloss.vocab.kernels.route; Liger's warm-up shape
matters only to inductor's GPU code)."""
CUDA_ONLY = {("hidden", "fused-head-kernel"): "the head-kernel route"}
"""(section, variant) -> the pgloss route it measures, whose Triton kernels a CPU runs only in Triton's interpreter
(minutes at --quick's shape)."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes, torch.compile left out: checks the command in well under a minute on a CPU",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the measurements (default 480, --quick 170): rows past it are skipped",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE / "results" / "gpu.json",
        help="the JSON file; an existing one is kept and the next free name -2, -3, ... is used",
    )
    parser.add_argument("--sections", default="hidden,plain,divergence", help="comma-separated subset")
    parser.add_argument(
        "--fused-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="one more fused row with this keyword of loss_from_hidden (e.g. chunk_size=2048), repeatable",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes at a time, CPU only (default 1; --quick: 2): on a GPU each runs alone",
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="a folder of wheels (make gpu-wheels): the missing peers are installed from it first, "
        "offline (pip install --no-index --find-links)",
    )
    args = parser.parse_args(argv)
    if args.budget is None:
        args.budget = 170.0 if args.quick else 480.0
    if args.jobs is None:
        args.jobs = 2 if args.quick and args.device == "cpu" else 1
    if args.jobs < 1 or (args.jobs > 1 and args.device == "cuda"):
        parser.error(f"--jobs {args.jobs}: give 1 or more, and 1 on cuda (each process has the GPU to itself)")
    unknown = set(args.sections.split(",")) - {"hidden", "plain", "divergence"}
    if unknown:
        parser.error(f"--sections: unknown {sorted(unknown)}; valid: hidden, plain, divergence")
    return args


def free_path(path: Path) -> Path:
    """`path`, or the first of path-2, path-3, ... that does not exist: an earlier result is never overwritten."""
    candidate, n = path, 1
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def shown(path: Path) -> str:
    """`path` relative to the current directory when it lies under it."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def finite(value):
    """A JSON-safe number: NaN and infinities become None."""
    return value if value is None or math.isfinite(value) else None


class Report:
    """The rows so far: printed one by one, and the JSON file rewritten whole after each (atomically)."""

    COLUMNS = (
        ("variant", 20, None),
        ("status", 13, None),
        ("time (s)", 10, ".4f"),
        ("peak (MiB)", 11, ".0f"),
        ("time / base", 12, ".2f"),
        ("mem / base", 11, ".3f"),
        ("time / floor", 13, ".2f"),
        ("loss", 14, ".7g"),
        ("rel. err", 9, ".1e"),
    )

    def __init__(self, path: Path, header: dict):
        self.path, self.header, self.rows = path, header, []
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.save()

    def save(self) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(json.dumps({"header": self.header, "rows": self.rows}, indent=1) + "\n")
        os.replace(temporary, self.path)

    def section(self, section: str, label: str, baseline: str, reference: str) -> None:
        print(f"\n## {section}: {label}; base: {baseline}; loss error against: {reference}", flush=True)
        print("| " + " | ".join(name.ljust(width) for name, width, _ in self.COLUMNS) + " | note", flush=True)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.save()
        keys = (
            "variant",
            "status",
            "time_s",
            "peak_mib",
            "time_ratio",
            "memory_ratio",
            "floor_ratio",
            "loss",
            "loss_rel_error",
        )
        cells = [
            str(row[key]).ljust(width) if spec is None else cell(row.get(key), spec, width)
            for key, (_, width, spec) in zip(keys, self.COLUMNS, strict=True)
        ]
        print("| " + " | ".join(cells) + " | " + row.get("note", ""), flush=True)


class Clock:
    """The run's budget: what one process may still take."""

    def __init__(self, budget: float):
        self.deadline = time.monotonic() + budget

    def allow(self, timeout: float) -> float:
        return min(timeout, self.deadline - time.monotonic())


def blocked(section: str, variant: str, device: str) -> tuple[str, str] | None:
    """(status, note) for a row that cannot run here: its peer (or Triton under it) not installed, a
    CUDA-only peer on a CPU run, or a row that on a CPU measures what another row does; None when it can run."""
    same = SAME_ON_CPU.get((section, variant))
    if same is not None and device != "cuda":
        row, why = same
        return "skipped", f"on a CPU {why}: the {row} row measures it"
    if (section, variant) in CUDA_ONLY and device != "cuda":
        return "needs CUDA", f"{CUDA_ONLY[section, variant]}'s Triton kernels run on CUDA (here only interpreted)"
    name = NEEDS.get((section, variant))
    if name is None:
        return None
    peer = peers.PEERS[name]
    if not peers.installed(peer.module):
        return "not installed", f"{peer.distribution} is not installed (make gpu-wheels; then --wheels)"
    if name in TRITON and not peers.installed("triton"):
        return "not installed", f"triton is not installed: {peer.distribution}'s kernels are Triton's"
    if peer.needs_cuda and device != "cuda":
        return "needs CUDA", f"{peer.distribution}'s kernels run on CUDA only"
    return None


def sized_argv(case: Case, device: str) -> list[str]:
    argv = []
    for key, value in case.sizes.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return argv + ["--device", device]


def ratio(value, base):
    return value / base if value is not None and base else None


def in_groups(calls: list, jobs: int):
    """Each result of `calls` (functions of no argument), in order, running up to `jobs` at a time: a group
    is started together and its results are handed back in order once all of it has finished (with one
    job, each result as soon as it exists)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for start in range(0, len(calls), jobs):
            yield from pool.map(lambda call: call(), calls[start : start + jobs])


def run_hidden(case: Case, args, report: Report, clock: Clock) -> None:
    script = HERE / "fused.py"
    report.section(case.section, case.label, "naive (materialised logits)", "reference (float64 logits)")
    rows = [(variant, variant, []) for variant in HIDDEN]
    rows[HIDDEN.index("tiled") : HIDDEN.index("tiled")] = [
        (f"fused {option}", "fused", ["--fused-option", option]) for option in args.fused_option
    ]

    def call(name, variant, extra):
        repeats, timeout = case.slow.get(variant, (case.repeats, case.timeout))
        argv = sized_argv(case, args.device) + ["--repeats", str(repeats)] + extra
        return {**measure(case, name, variant, script, argv, timeout, args.device, clock), "repeats": repeats}

    known: dict[str, dict] = {}
    for result in in_groups([lambda row=row: call(*row) for row in rows], args.jobs):
        known[result["variant"]] = result
        base, floor, reference = known.get("naive", {}), known.get("floor", {}), known.get("reference", {})
        if result["variant"] != "reference":
            result.update(
                baseline="naive",
                time_ratio=ratio(result.get("time_s"), base.get("time_s")),
                memory_ratio=ratio(result.get("peak_mib"), base.get("peak_mib")),
                floor_ratio=ratio(result.get("time_s"), floor.get("time_s")),
            )
            agreement(result, reference.get("loss"), "reference")
        report.add(result)


def run_divergence(case: Case, args, report: Report, clock: Clock) -> None:
    script = HERE / "divergence.py"
    report.section(case.section, case.label, "materialised", "materialised (float32)")
    argv = sized_argv(case, args.device)
    calls = [
        lambda variant=variant: {
            **measure(case, variant, variant, script, argv, case.timeout, args.device, clock),
            "repeats": 1,
        }
        for variant in DIVERGENCE
    ]
    base = {}
    for result in in_groups(calls, args.jobs):
        if result["variant"] == "materialised":
            base = result
        result.update(
            baseline="materialised",
            time_ratio=ratio(result.get("time_s"), base.get("time_s")),
            memory_ratio=ratio(result.get("peak_mib"), base.get("peak_mib")),
        )
        agreement(result, base.get("loss"), "materialised")
        report.add(result)


def run_plain(case: Case, args, report: Report, clock: Clock) -> None:
    """One process per loss_agg_mode (verl, pgloss and pgloss compiled interleaved in it): three rows each."""
    script = HERE / "plain.py"
    argv = sized_argv(case, args.device) + ["--repeats", str(case.repeats)] + (["--no-compile"] if args.quick else [])

    def call(mode):
        allowed = clock.allow(case.timeout)
        if allowed < 5:
            return {"status": "skipped", "note": "the run's --budget is spent"}
        return run_variant(str(script), argv, mode, allowed)

    verl_missing = blocked("plain", "verl", args.device)
    for mode, out in zip(
        PLAIN_MODES, in_groups([lambda mode=mode: call(mode) for mode in PLAIN_MODES], args.jobs), strict=True
    ):
        shape = f"{case.label} {mode}"
        report.section(case.section, shape, "verl", "verl's loss")
        ms = out.get("ms", {})
        verl_ms = ms.get("verl")
        for key, name in PLAIN_ROWS.items():
            row = {
                "section": "plain",
                "shape": shape,
                "variant": name,
                "repeats": case.repeats,
                "baseline": "verl",
                "reference": "verl",
                "time_s": None,
                "peak_mib": None,
                "loss": None,
                "note": "",
            }
            if key == "verl" and verl_missing:
                row.update(status=verl_missing[0], note=verl_missing[1])
            elif key != "verl" and key != "pgloss" and args.quick:
                row.update(status="skipped", note="--quick leaves torch.compile out (tens of seconds on a CPU)")
            elif key in out.get("absent", {}):  # plain.py says which of its rows need CUDA
                row.update(status="needs CUDA", note=out["absent"][key])
            elif key not in ms:
                row.update(status=out.get("status", "failed"), note=out.get("note", ""))
            else:
                row.update(status="measured", time_s=ms[key] / 1e3, time_ratio=ratio(ms[key], verl_ms))
                if key == "verl":
                    row["loss"] = out["verl_loss"]
                elif key == "pgloss":
                    row.update(loss=out["loss"], grad_error=out["grad_vs_verl"])
                else:
                    row.update(
                        loss=out[f"{key}_loss"],
                        compiled_vs_eager=out[f"{key}_vs_eager"],
                        compiled_grad_vs_eager=out[f"{key}_grad_vs_eager"],
                    )
                if key != "verl":
                    agreement(row, out["verl_loss"], "verl")
            report.add(row)


def measure(
    case: Case, name: str, variant: str, script: Path, argv: list[str], timeout: float, device: str, clock: Clock
) -> dict:
    """One row: the variant's own process, or the reason it did not run."""
    row = {
        "section": case.section,
        "shape": case.label,
        "variant": name,
        "time_s": None,
        "peak_mib": None,
        "loss": None,
        "note": "",
    }
    reason = blocked(case.section, variant, device)
    allowed = clock.allow(timeout)
    if reason is None and allowed < 5:
        reason = ("skipped", "the run's --budget is spent")
    if reason is not None:
        row["status"], row["note"] = reason
        return row
    result = run_variant(str(script), argv, variant, allowed)
    result.pop("variant", None)
    row.update(result)
    row.setdefault("status", "measured" if row.get("time_s") is not None else "skipped")
    for key in ("time_s", "peak_mib", "loss"):
        row[key] = finite(row.get(key))
    return row


def agreement(row: dict, reference, name: str) -> None:
    """The row's loss against `reference` (absolute and relative error)."""
    row["reference"] = name
    loss = row.get("loss")
    if loss is None or reference is None:
        return
    row["loss_error"] = abs(loss - reference)
    row["loss_rel_error"] = row["loss_error"] / abs(reference) if reference else None


def header(args, device) -> dict:
    return {
        "command": " ".join([shown(Path(__file__)), *sys.argv[1:]]),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": describe(device),
        "python": platform.python_version(),
        "versions": peers.versions(),
        "quick": args.quick,
        "budget_s": args.budget,
        "jobs": args.jobs,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    device = resolve_device(args.device)
    installs = peers.install_missing(args.wheels) if args.wheels else {}
    clock = Clock(args.budget)
    report = Report(free_path(args.out), {**header(args, device), "installs": installs})
    info = report.header
    print(f"{info['date']}  {info['device']}  python {info['python']}", flush=True)
    print("versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in info["versions"].items()), flush=True)
    for peer, outcome in installs.items():
        print(f"{peer}: {outcome}", flush=True)
    print(f"rows -> {shown(report.path)} (budget {args.budget:.0f} s, processes at a time: {args.jobs})", flush=True)
    runners = {"hidden": run_hidden, "plain": run_plain, "divergence": run_divergence}
    sections = args.sections.split(",")
    for case in QUICK if args.quick else FULL:
        if case.section in sections:
            runners[case.section](case, args, report, clock)
    print(f"\n{len(report.rows)} rows in {shown(report.path)}", flush=True)


if __name__ == "__main__":
    main()
