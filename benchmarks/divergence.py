"""Peak memory and time of the student-teacher divergence (forward + backward to the student's hidden
states and LM head), from both models' hidden states and heads.

Each variant runs in its own process, so that its peak memory is its own: the baseline is the resident
memory (CPU) or the allocator's (CUDA) with the inputs and room for the student's two gradients; the peak
reported is the high-water mark above it. Ratios are against `materialised` in the same run.

Variants (the token-mean of D_β over the valid tokens, `--beta`):
  materialised  both models' N x V logits (the teacher's under no_grad), log_softmax of both, D_β in torch ops
  gkd           both logits materialised, TRL 1.16's GKDTrainer.generalized_jsd_loss (trl/experimental/gkd)
  fused         pgloss.divergence_from_hidden, token chunks of whole-vocabulary rows (--chunk-size)
  tiled         pgloss.divergence_from_hidden with --memory-budget bytes (token chunks x vocabulary tiles)
  trl           TRL 1.16's ChunkedDivergenceFunction (trl/kernels/chunked_divergence.py: 4096 tokens x 32768
                columns, torch ops off Triton), reduced as its DistillationTrainer does (Σ D / valid tokens)

    python benchmarks/divergence.py --tokens 1024 --hidden 896 --vocab 151936 --beta 0.5
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, cell, describe, measure_from_hidden, resolve_device, run_variants

VARIANTS = ("materialised", "gkd", "fused", "tiled", "trl")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="N, tokens in the batch")
    parser.add_argument("--seq-len", type=int, default=256, help="T, tokens per sequence (B = N / T)")
    parser.add_argument("--hidden", type=int, default=896, help="H, the student's hidden size")
    parser.add_argument("--teacher-hidden", type=int, default=None, help="H', the teacher's (default: H)")
    parser.add_argument("--vocab", type=int, default=151936, help="V, vocabulary size")
    parser.add_argument("--beta", type=float, default=0.5, help="0: forward KL, 1: reverse KL, between: JSD(β)")
    parser.add_argument("--temperature", type=float, default=1.0)
    add_device_argument(parser)
    parser.add_argument("--chunk-size", type=int, default=None, help="pgloss chunk (tokens); default ≈ 2²⁷ / V")
    parser.add_argument("--memory-budget", type=int, default=64 << 20, help="bytes for the tiled variant's buffers")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed to one variant's process")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens % args.seq_len:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq-len ({args.seq_len})")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; valid: {VARIANTS}")
    return args


def make_inputs(args, torch, device):
    gen = torch.Generator().manual_seed(0)
    batch, length, size = args.tokens // args.seq_len, args.seq_len, args.hidden
    teacher_size = args.teacher_hidden or size
    hidden = torch.randn(batch, length, size, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, size, generator=gen) / math.sqrt(size)).to(device).requires_grad_()
    teacher_hidden = torch.randn(batch, length, teacher_size, generator=gen).to(device)
    teacher_weight = (torch.randn(args.vocab, teacher_size, generator=gen) / math.sqrt(teacher_size)).to(device)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(device)
    return dict(hidden=hidden, weight=weight, teacher_hidden=teacher_hidden, teacher_weight=teacher_weight, mask=mask)


def build_variant(name, args):
    """A function inputs -> scalar loss (forward only), or raise RuntimeError with the reason."""
    import torch

    from pgloss.vocab.divergence import divergence_from_hidden

    beta, tau = args.beta, args.temperature

    def logits(inputs):
        student = inputs["hidden"] @ inputs["weight"].t()
        with torch.no_grad():
            teacher = inputs["teacher_hidden"] @ inputs["teacher_weight"].t()
        return student, teacher

    if name == "materialised":

        def run(inputs):
            student, teacher = logits(inputs)
            log_q, log_p = torch.log_softmax(student / tau, -1), torch.log_softmax(teacher / tau, -1)
            del student, teacher
            if beta == 0:
                d = (log_p.exp() * (log_p - log_q)).sum(-1)
            elif beta == 1:
                d = (log_q.exp() * (log_q - log_p)).sum(-1)
            else:
                log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
                d = beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(
                    -1
                )
            mask = inputs["mask"]
            return torch.where(mask, d, 0.0).sum() / mask.sum().clamp(min=1)

        return run

    if name == "gkd":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from trl.experimental.gkd import GKDTrainer
        except Exception as error:
            raise RuntimeError(f"trl.experimental.gkd does not import: {type(error).__name__}: {error}") from None

        def run(inputs):
            student, teacher = logits(inputs)
            labels = torch.where(inputs["mask"], 1, -100)
            return GKDTrainer.generalized_jsd_loss(student, teacher, labels=labels, beta=beta, temperature=tau)

        return run

    if name in ("fused", "tiled"):
        sizes = dict(chunk_size=args.chunk_size) if name == "fused" else dict(memory_budget=args.memory_budget)

        def run(inputs):
            return divergence_from_hidden(
                inputs["hidden"],
                inputs["weight"],
                inputs["teacher_hidden"],
                inputs["teacher_weight"],
                inputs["mask"],
                beta=beta,
                temperature=tau,
                **sizes,
            ).loss

        return run

    if name == "trl":
        try:
            from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
        except Exception as error:
            raise RuntimeError(
                f"trl.kernels.chunked_divergence does not import: {type(error).__name__}: {error}"
            ) from None

        def run(inputs):
            hidden, teacher_hidden, mask = inputs["hidden"], inputs["teacher_hidden"], inputs["mask"]
            d, _ = ChunkedDivergenceFunction.apply(
                hidden.reshape(-1, hidden.shape[-1]),
                inputs["weight"],
                None,
                teacher_hidden.reshape(-1, teacher_hidden.shape[-1]),
                inputs["teacher_weight"],
                None,
                beta,
                tau,
                1.0,
                None,
                1.0,
                None,
            )
            valid = mask.reshape(-1)
            return d.masked_fill(~valid, 0).sum() / valid.sum().clamp(min=1)

        return run

    raise ValueError(name)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(measure_from_hidden(args, make_inputs, build_variant)))
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(resolve_device(args.device)))
    print(
        f"N={args.tokens} (B={args.tokens // args.seq_len} x T={args.seq_len}) H={args.hidden} "
        f"H'={args.teacher_hidden or args.hidden} V={args.vocab} float32 on {args.device}, beta={args.beta}, "
        f"temperature={args.temperature}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results = run_variants(
        __file__, list(argv if argv is not None else sys.argv[1:]), args.variants.split(","), args.timeout
    )

    base = next((r for r in results if r["variant"] == "materialised"), {})

    def ratio(r, key):
        return base[key] / r[key] if r.get(key) and base.get(key) else None

    columns = [
        "variant",
        "peak above inputs (MiB)",
        "materialised / this (mem)",
        "wall (s)",
        "CPU (s)",
        "this / materialised (wall)",
        "loss",
        "|∂W|",
        "note",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(c) + 2) for c in columns) + "|")
    for r in results:
        time_ratio = r["time_s"] / base["time_s"] if r.get("time_s") and base.get("time_s") else None
        cells = [
            r["variant"].ljust(len(columns[0])),
            cell(r.get("peak_mib"), ".0f", len(columns[1])),
            cell(ratio(r, "peak_mib"), ".1f", len(columns[2])),
            cell(r.get("time_s"), ".2f", len(columns[3])),
            cell(r.get("cpu_s"), ".2f", len(columns[4])),
            cell(time_ratio, ".2f", len(columns[5])),
            cell(r.get("loss"), ".7f", len(columns[6])),
            cell(r.get("grad_w_norm"), ".6f", len(columns[7])),
            r.get("note", ""),
        ]
        print("| " + " | ".join(cells) + " |")
    print("peak above inputs: above the inputs and the room of hidden.grad and weight.grad, which every path holds")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
