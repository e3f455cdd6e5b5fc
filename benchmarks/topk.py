"""Peak memory and time of top-k distillation (forward + backward to the student's hidden states and LM head),
given the teacher's top-k ids and log-probs per position, beside the full-vocabulary divergence and the plain
log π(y) call.

Each variant runs in its own process, so that its peak memory is its own: the baseline is the resident memory
(CPU) or the allocator's (CUDA) with the inputs and room for the student's two gradients; the peak reported is the
high-water mark above it (on CPU with MALLOC_MMAP_THRESHOLD_=1 MiB unless set: large buffers returned at free).
Ratios are against `materialised` in the same run.

Variants (the token-mean over the valid tokens):
  materialised  the student's N x V logits, log_softmax, gathered at the teacher's ids, verl's forward KL over the
                top-k in torch ops (log-probs clamped at -10, D clamped to [0, 10])
  verl          verl 0.9.1's compute_forward_kl_topk (verl/trainer/distillation/fsdp/losses.py) on the student's
                N x V logits (its default path: log_softmax + gather), then its two clamps
  trl           TRL 1.16's async distillation loss from hidden states (trl/experimental/async_distillation:
                _chunked_jsd_loss, 256 tokens per checkpointed chunk; forward KL over the teacher's top-k, tail
                bucket)
  plain         pgloss.log_prob_and_entropy_from_hidden, -log π(y) (the plain call; --chunk-size)
  full          pgloss.divergence_from_hidden, beta=0: the full-vocabulary forward KL from both models' hidden
                states (--chunk-size)
  topk          pgloss.topk_divergence_from_hidden with verl's options (--chunk-size)
  topk_tiled    the same with --memory-budget bytes (token chunks x vocabulary tiles)

    python benchmarks/topk.py --tokens 1024 --hidden 896 --vocab 151936 --k 128
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import add_device_argument, cell, describe, measure_from_hidden, resolve_device, run_variants

VARIANTS = ("materialised", "verl", "trl", "plain", "full", "topk", "topk_tiled")
VERL = dict(beta=0.0, log_prob_min=-10.0, value_range=(0.0, 10.0))


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="N, tokens in the batch")
    parser.add_argument("--seq-len", type=int, default=256, help="T, tokens per sequence (B = N / T)")
    parser.add_argument("--hidden", type=int, default=896, help="H, the student's hidden size")
    parser.add_argument("--vocab", type=int, default=151936, help="V, vocabulary size")
    parser.add_argument("--k", type=int, default=128, help="the teacher's top-k per position (verl: 128)")
    add_device_argument(parser)
    parser.add_argument("--chunk-size", type=int, default=None, help="pgloss chunk (tokens); default ≈ 2²⁷ / V")
    parser.add_argument("--memory-budget", type=int, default=64 << 20, help="bytes for topk_tiled's buffers")
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    parser.add_argument("--timeout", type=int, default=600, help="seconds allowed to one variant's process")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens % args.seq_len:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq-len ({args.seq_len})")
    if not 1 <= args.k <= args.vocab:
        parser.error(f"--k must be in [1, --vocab], got {args.k}")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; valid: {VARIANTS}")
    return args


def make_inputs(args, torch, device):
    gen = torch.Generator().manual_seed(0)
    batch, length, size = args.tokens // args.seq_len, args.seq_len, args.hidden
    hidden = torch.randn(batch, length, size, generator=gen).to(device).requires_grad_()
    weight = (torch.randn(args.vocab, size, generator=gen) / math.sqrt(size)).to(device).requires_grad_()
    teacher_hidden = torch.randn(batch, length, size, generator=gen).to(device)
    teacher_weight = (torch.randn(args.vocab, size, generator=gen) / math.sqrt(size)).to(device)
    with torch.no_grad():  # the teacher's top-k, as an inference server returns them (computed in slices)
        lps, ids = [], []
        for row in teacher_hidden.reshape(-1, size).split(16):  # small slices: the peak stays the loss's
            lp, i = torch.log_softmax(row @ teacher_weight.t(), -1).topk(args.k, dim=-1)
            lps.append(lp), ids.append(i)
        teacher_lp = torch.cat(lps).view(batch, length, args.k)
        teacher_ids = torch.cat(ids).view(batch, length, args.k)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(device)
    targets = torch.randint(0, args.vocab, (batch, length), generator=gen).to(device)
    return dict(
        hidden=hidden,
        weight=weight,
        teacher_hidden=teacher_hidden,
        teacher_weight=teacher_weight,
        teacher_ids=teacher_ids,
        teacher_lp=teacher_lp,
        mask=mask,
        targets=targets,
    )


def _mean(torch, d, mask):
    return torch.where(mask, d, 0.0).sum() / mask.sum().clamp(min=1)


def build_variant(name, args):
    """A function inputs -> scalar loss (forward only), or raise RuntimeError with the reason."""
    from types import SimpleNamespace

    import torch

    import pgloss

    sizes = dict(chunk_size=args.chunk_size)
    if name == "materialised":

        def run(inputs):
            log_q = torch.log_softmax(inputs["hidden"] @ inputs["weight"].t(), -1)
            s = log_q.gather(-1, inputs["teacher_ids"]).clamp(min=-10.0)
            t = inputs["teacher_lp"].clamp(min=-10.0)
            d = (t.exp() * (t - s)).sum(-1).clamp(0.0, 10.0)
            return _mean(torch, d, inputs["mask"])

        return run
    if name == "verl":
        try:
            from verl.trainer.distillation.fsdp.losses import compute_forward_kl_topk
        except Exception as error:
            raise RuntimeError(f"verl does not import: {type(error).__name__}: {error}") from None
        config = SimpleNamespace(distillation_loss=SimpleNamespace(log_prob_min_clamp=-10.0, use_chunked_topk=False))

        def run(inputs):
            mask = inputs["mask"]
            nested = lambda x: torch.nested.as_nested_tensor([x[mask]], layout=torch.jagged)  # noqa: E731
            logits = (inputs["hidden"][mask] @ inputs["weight"].t()).unsqueeze(0)
            out = compute_forward_kl_topk(
                logits, nested(inputs["teacher_lp"]), nested(inputs["teacher_ids"]), config, "thd"
            )
            return out["distillation_losses"].clamp_min(0.0).clamp(-10.0, 10.0).mean()

        return run
    if name == "trl":
        try:
            from trl.experimental.async_distillation.async_distillation_trainer import _chunked_jsd_loss
        except Exception as error:
            raise RuntimeError(f"trl async distillation does not import: {type(error).__name__}: {error}") from None

        def run(inputs):
            mask = inputs["mask"]
            ids = inputs["teacher_ids"][mask]
            loss, *_ = _chunked_jsd_loss(
                inputs["hidden"][mask], inputs["weight"], None, 1.0, None, ids, inputs["teacher_lp"][mask],
                ids != -1, 0.0, 1.0, True, None, 1, 256,
            )  # fmt: skip
            return loss / mask.sum().clamp(min=1)

        return run
    if name == "plain":

        def run(inputs):
            log_prob, _ = pgloss.log_prob_and_entropy_from_hidden(
                inputs["hidden"], inputs["weight"], inputs["targets"], mask=inputs["mask"], **sizes
            )
            return _mean(torch, -log_prob, inputs["mask"])

        return run
    if name == "full":

        def run(inputs):
            return pgloss.divergence_from_hidden(
                inputs["hidden"], inputs["weight"], inputs["teacher_hidden"], inputs["teacher_weight"],
                inputs["mask"], beta=0.0, **sizes,
            ).loss  # fmt: skip

        return run
    if name in ("topk", "topk_tiled"):
        tiles = sizes if name == "topk" else dict(memory_budget=args.memory_budget)

        def run(inputs):
            return pgloss.topk_divergence_from_hidden(
                inputs["hidden"], inputs["weight"], inputs["teacher_ids"], inputs["teacher_lp"], inputs["mask"],
                **VERL, **tiles,
            ).loss  # fmt: skip

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
        f"N={args.tokens} (B={args.tokens // args.seq_len} x T={args.seq_len}) H={args.hidden} V={args.vocab} "
        f"k={args.k} float32 on {args.device}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    # glibc hands buffers of 1 MiB and more out of mmap and back at free, so that a child's RSS high-water mark is its
    # live peak (with its default, a freed [chunk, V] buffer can stay resident and the figures vary by 2x run to run)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    results = run_variants(
        __file__, list(argv if argv is not None else sys.argv[1:]), args.variants.split(","), args.timeout
    )
    base = next((r for r in results if r["variant"] == "materialised"), {})

    def ratio(r, key):
        return base[key] / r[key] if r.get(key) and base.get(key) else None

    columns = ["variant", "peak above inputs (MiB)", "materialised / this (mem)", "wall (s)", "CPU (s)"]
    columns += ["this / materialised (wall)", "loss", "|∂W|", "note"]
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
    print("plain and full do not compute the top-k divergence: their loss is another quantity (memory and time only)")
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
