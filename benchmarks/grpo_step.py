"""The GRPO optimizer step users run: TRL 1.16's GRPOTrainer, on a model of a real architecture's shape,
with TRL's own loss, TRL with Liger's kernels, and pgloss's adapter plain and fused.

Each step is `trainer.train()`'s own: the rollout, the rewards and group advantages, the forward and
backward through the model, gradient clipping and the optimizer update. The rollout is TRL's hook for a
custom generator (`rollout_func`), here returning fixed random completions, so that the step is the
loss's and the model's and not generation's: per group of G, lengths L, L - L/2G, ..., the completions
drawn from a seeded generator (the same in every variant), the reward the completion's length (so the
group advantages are not zero and the on-policy loss is -Σᵢ Aᵢ·Lᵢ / Σᵢ Lᵢ ≠ 0). The model is random
(bfloat16 weights, seeded, the same in every variant), built from the architecture's configuration with a
word-level tokenizer built here: nothing is downloaded.

  trl     GRPOTrainer, its defaults (loss_type="dapo": its chunked log-prob head, then its loss)
  pgloss  PGLossGRPOTrainer (pgloss.integrations.trl): the loss TRL's config asks for, computed by pgloss
  fused   PGLossGRPOTrainer(fused=True): the loss from the last hidden states and the LM head
  liger   GRPOTrainer with use_liger_kernel=True (TRL 1.16 applies Liger's layer kernels, RMSNorm, RoPE
          and SwiGLU; its fused linear cross-entropy is refused by GRPOTrainer)

Completion lengths double from --start until a variant runs out of memory (that row says so and the
variant's ladder ends) or --max-completion. A row: the median time of the steps after --warmup, the
peak memory (CUDA: torch.cuda.max_memory_allocated, reset at the row's start; CPU: the process's
resident high-water mark), and the first step's loss and gradient norm (the trainer's, before clipping),
compared with trl's at the same length: bf16 numerics move the gradient norm by a few parts in a
thousand; a difference past the tolerance is printed as a finding. Each (shape, variant) runs in its own
process (Liger patches transformers' module functions); each row is printed and appended to the JSONL
file (--out; an existing file is kept, the run writes -2, -3, ...) the moment it is measured, and a
failed variant keeps its traceback's tail. --budget bounds the whole run: each process gets an even
share of what is left, stops its ladder cleanly when the next length will not fit, and is stopped at
the run's end.

    python benchmarks/grpo_step.py                                 # cuda: Qwen2-0.5B then Qwen2-1.5B shapes
    python benchmarks/grpo_step.py --device cpu --quick            # a 2-layer model: the command's own check
    python benchmarks/grpo_step.py --wheels .gpu-wheels            # first install what is missing, offline
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers
from device import cell, describe, resolve_device
from gpu import Clock, free_path, shown
from step_ladder import ROW, SHAPES, VARIANTS, child

HERE = Path(__file__).resolve().parent
LABELS = {
    "trl": "TRL GRPOTrainer",
    "pgloss": "pgloss adapter",
    "fused": "pgloss adapter fused",
    "liger": "TRL + Liger kernels",
}
STEP_PEERS = {  # what the step needs beyond a CUDA torch and transformers, installed by --wheels without
    "dill": peers.Peer("dill", "dill", no_deps=True),  # requirements (the rest of TRL's are in such an image)
    "multiprocess": peers.Peer("multiprocess", "multiprocess", no_deps=True),
    "datasets": peers.Peer("datasets", "datasets", no_deps=True),
    "trl": peers.Peer("trl", "trl", no_deps=True),
    "liger": peers.Peer("liger_kernel", "liger-kernel", needs_cuda=True, no_deps=True),
}
LOSS_RTOL = 1e-3
"""The loss on-policy is -Σ A·L / Σ L (ratio 1) in float32: the same in every variant to rounding."""
GRAD_RTOL = 0.03
"""The gradient norm: bfloat16 rounds to 2⁻⁸ ≈ 0.4% (the norm itself is a bf16 number), and the heads and
kernels order their sums differently; 3% is about eight bf16 steps."""


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the 'tiny' shape, completions 16 to 64, one warm-up and one timed step: the check",
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"comma-separated, of {', '.join(SHAPES)} (default qwen2-0.5b,qwen2-1.5b; --quick: tiny)",
    )
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, run in this order")
    parser.add_argument("--start", type=int, default=None, help="first completion length (default 1024; --quick 16)")
    parser.add_argument(
        "--max-completion", type=int, default=None, help="the ladder's last length (default 32768; --quick 64)"
    )
    parser.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 128; --quick 8)")
    parser.add_argument("--prompts", type=int, default=1, help="prompts per step")
    parser.add_argument("--generations", type=int, default=4, help="completions per prompt (num_generations)")
    parser.add_argument("--warmup", type=int, default=1, help="steps before the timed ones")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 4; --quick 1)")
    parser.add_argument(
        "--optimizer",
        default="adamw",
        choices=("adamw", "sgd"),
        help="adamw: TRL's default (adamw_torch_fused); sgd keeps no state (less memory)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="TRL's default is on; off here unless given (the backbone's activations are kept)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help="seconds for the whole run (default 330; --quick 300): what is past it is skipped",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=HERE / "results" / "grpo_step.jsonl",
        help="the JSONL file (a header line, then one line a row); an existing one is kept",
    )
    parser.add_argument(
        "--wheels",
        type=Path,
        default=None,
        help="a folder of wheels: trl, datasets, dill, multiprocess and liger-kernel are installed "
        "from it first where missing (offline, without their requirements)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)  # "shape:variant"
    parser.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)  # time.time() to stop by
    args = parser.parse_args(argv)
    for name, full, quick in (
        ("shapes", "qwen2-0.5b,qwen2-1.5b", "tiny"),
        ("start", 1024, 16),
        ("max_completion", 32768, 64),
        ("prompt", 128, 8),
        ("steps", 4, 1),
        ("budget", 330.0, 300.0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    for name, valid in (("shapes", SHAPES), ("variants", VARIANTS)):
        unknown = sorted(set(getattr(args, name).split(",")) - set(valid))
        if unknown:
            parser.error(f"--{name}: unknown {unknown}; valid: {', '.join(valid)}")
    if args.start < 1 or args.max_completion < args.start or args.steps < 1 or args.warmup < 0:
        parser.error(
            f"--start {args.start}, --max-completion {args.max_completion}, --steps {args.steps}, --warmup "
            f"{args.warmup}: need 1 <= start <= max-completion, steps >= 1 and warmup >= 0"
        )
    return args


# -- the parent: every (shape, variant) in its own process ----------------------------------------------------------


class Report:
    """The header line, then each row appended to the JSONL file and printed as a table line."""

    COLUMNS = (
        ("variant", 22, None),
        ("completion", 10, "d"),
        ("tokens", 7, "d"),
        ("status", 13, None),
        ("step (s)", 9, ".4f"),
        ("tok/s", 9, ".0f"),
        ("peak (GiB)", 10, ".2f"),
        ("loss", 11, ".6g"),
        ("grad norm", 10, ".5g"),
        ("Δloss", 8, ".1e"),
        ("Δgrad", 8, ".1e"),
    )
    KEYS = (
        "label",
        "completion",
        "tokens",
        "status",
        "step_s",
        "tokens_per_s",
        "peak_gib",
        "loss",
        "grad_norm",
        "loss_vs_trl",
        "grad_norm_vs_trl",
    )

    def __init__(self, path: Path, header: dict):
        self.path, self.rows = path, []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"header": header}) + "\n")

    def write(self, row: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    def section(self, shape: str) -> None:
        model_type, sizes = SHAPES[shape]
        shown_sizes = ", ".join(
            f"{k}={v}" for k, v in sizes.items() if not k.endswith(("token_id", "position_embeddings"))
        )
        print(f"\n## {shape}: {model_type}, {shown_sizes}; random bfloat16 weights", flush=True)
        print("| " + " | ".join(name.ljust(width) for name, width, _ in self.COLUMNS) + " | note", flush=True)

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.write(row)
        cells = [
            str(row.get(key, "")).ljust(width) if spec is None else cell(row.get(key), spec, width)
            for key, (_, width, spec) in zip(self.KEYS, self.COLUMNS, strict=True)
        ]
        print("| " + " | ".join(cells) + " | " + row.get("note", ""), flush=True)
        if row["status"] == "failed" and row.get("error"):  # the traceback's end, for a log cut short
            print("\n".join("    " + line for line in row["error"].rstrip().splitlines()[-12:]), flush=True)


def compare(row: dict, rows: list[dict]) -> None:
    """The row's first-step loss and gradient norm against trl's at the same shape and length (relative);
    past LOSS_RTOL / GRAD_RTOL, a finding in the row's note, printed with it."""
    base = next(
        (
            r
            for r in rows
            if r["variant"] == "trl"
            and r["shape"] == row["shape"]
            and r["completion"] == row["completion"]
            and r["status"] == "measured"
        ),
        None,
    )
    if row["variant"] == "trl" or base is None or row["status"] != "measured":
        return
    findings = []
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", GRAD_RTOL)):
        a, b = row[key], base[key]
        row[f"{key}_vs_trl"] = abs(a - b) / max(abs(b), 1e-12)
        if row[f"{key}_vs_trl"] > rtol:
            findings.append(f"{key} {a:.6g} differs from trl's {b:.6g} by {row[f'{key}_vs_trl']:.1e} (> {rtol:g})")
    if findings:
        row["note"] = "; ".join(["FINDING: " + ", ".join(findings), row.get("note", "")]).rstrip("; ")


def blocked(variant: str, device) -> tuple[str, str] | None:
    """(status, note) when the variant cannot run here: a package missing, or Liger's Triton kernels on a CPU."""
    for name in ("trl", "liger") if variant == "liger" else ("trl",):
        peer = STEP_PEERS[name]
        if not peers.installed(peer.module):
            return "not installed", f"{peer.distribution} is not installed (make gpu-step-wheels; then --wheels)"
        if peer.needs_cuda and device.type != "cuda":
            return "needs CUDA", f"{peer.distribution}'s kernels are Triton's, for CUDA"
    return None


def child_argv(args) -> list[str]:
    """The options a child process takes from this run."""
    argv = ["--device", args.device, "--optimizer", args.optimizer]
    for name in ("start", "max_completion", "prompt", "prompts", "generations", "warmup", "steps"):
        argv += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return argv + (["--gradient-checkpointing"] if args.gradient_checkpointing else [])


def stop(proc: subprocess.Popen) -> None:
    """Kill the process and what it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_child(argv: list[str], shape: str, variant: str, deadline: float, stop_at: float, report: Report):
    """The (shape, variant) process: its rows as they come; if it dies or is stopped, a row saying so."""
    command = [
        sys.executable,
        os.path.abspath(__file__),
        *argv,
        "--child",
        f"{shape}:{variant}",
        "--deadline",
        str(deadline),
    ]
    base = {"shape": shape, "variant": variant, "label": LABELS[variant]}
    started, ended = None, False
    with tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        watchdog = threading.Timer(max(stop_at - time.time(), 1), stop, (proc,))
        watchdog.start()
        try:
            for line in proc.stdout:
                if not line.startswith(ROW):
                    continue
                row = json.loads(line[len(ROW) :])
                if row.pop("event", None) == "start":
                    started = row["completion"]
                    continue
                started, ended = None, row["status"] != "measured"
                row = {**base, **row}
                compare(row, report.rows)
                report.add(row)
            proc.wait()
        finally:
            watchdog.cancel()
        if started is not None or (not ended and proc.returncode != 0):
            stderr.seek(0)
            text = stderr.read()
            killed = proc.returncode in (-9, 137) and time.time() >= stop_at - 1
            note = (
                "stopped at the end of the run's --budget"
                if killed
                else "the process died: " + ((text.strip().splitlines() or [f"exit code {proc.returncode}"])[-1])[:200]
            )
            report.add(
                {
                    **base,
                    "completion": started,
                    "status": "timed out" if killed else "failed",
                    "note": note,
                    "error": text[-4000:],
                }
            )


def longest(report: Report, shape: str, variant: str) -> dict:
    """The summary line of a (shape, variant): the longest completion measured and how its ladder ended."""
    rows = [r for r in report.rows if r.get("shape") == shape and r.get("variant") == variant]
    fits = [r["completion"] for r in rows if r["status"] == "measured"]
    end = next((r for r in rows if r["status"] != "measured"), None)
    summary = {
        "summary": "longest",
        "shape": shape,
        "variant": variant,
        "longest_completion": max(fits, default=None),
        "ended": "reached --max-completion"
        if end is None
        else end["status"] + ("" if end.get("completion") is None else f" at {end['completion']}"),
    }
    report.write(summary)
    return summary


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    device = resolve_device(args.device)
    if args.child:
        return child(args, device)
    installs = peers.install_missing(args.wheels, STEP_PEERS) if args.wheels else {}
    clock = Clock(args.budget)
    versions = {**peers.versions(), **{name: peers.version(name) for name in ("accelerate", "datasets")}}
    header = {
        "command": " ".join([shown(Path(__file__)), *argv]),
        "device": describe(device),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": versions,
        "installs": installs,
        "env": {name: os.environ.get(name) for name in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")},
        "options": {k: str(v) for k, v in vars(args).items() if k not in ("child", "deadline")},
    }
    report = Report(free_path(args.out), header)
    print(f"{header['date']}  {header['device']}  python {header['python']}", flush=True)
    print("versions: " + ", ".join(f"{k} {v or 'not installed'}" for k, v in versions.items()), flush=True)
    for name, outcome in installs.items():
        print(f"{name}: {outcome}", flush=True)
    print(
        f"rows -> {shown(report.path)} (budget {args.budget:.0f} s; {args.prompts} prompt(s) x {args.generations} "
        f"completions a step, prompt {args.prompt} tokens, {args.optimizer}, gradient checkpointing "
        f"{'on' if args.gradient_checkpointing else 'off'})",
        flush=True,
    )
    jobs = [(shape, variant) for shape in args.shapes.split(",") for variant in args.variants.split(",")]
    summaries = []
    for index, (shape, variant) in enumerate(jobs):
        if variant == args.variants.split(",")[0]:
            report.section(shape)
        reason = blocked(variant, device)
        left = clock.allow(float("inf"))
        if reason is None and left < 10:
            reason = ("skipped", "the run's --budget is spent")
        if reason is not None:
            report.add(
                {
                    "shape": shape,
                    "variant": variant,
                    "label": LABELS[variant],
                    "completion": None,
                    "status": reason[0],
                    "note": reason[1],
                }
            )
        else:
            share = left / (len(jobs) - index)
            run_child(
                child_argv(args), shape, variant, time.time() + share, time.time() + min(left, 1.5 * share + 30), report
            )
        summaries.append(longest(report, shape, variant))
    print("\nlongest completion that fits, per variant:", flush=True)
    for s in summaries:
        print(
            f"  {s['shape']:<11} {LABELS[s['variant']]:<22} {str(s['longest_completion']):>7}  ({s['ended']})",
            flush=True,
        )
    findings = [r for r in report.rows if "FINDING" in r.get("note", "")]
    for r in findings:
        print(f"FINDING {r['shape']} {r['variant']} at {r['completion']}: {r['note']}", flush=True)
    print(f"\n{len(report.rows)} rows, {len(findings)} finding(s), in {shown(report.path)}", flush=True)


if __name__ == "__main__":
    main()
