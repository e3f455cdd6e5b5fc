"""The exact full-vocabulary KL from hidden states (pgloss.full_kl_from_hidden) against the plain
computation on materialised logits: time of forward + backward and peak resident memory.

    python benchmarks/full_kl.py --tokens 2048 --vocab 32768 --hidden 256

Each variant runs in its own process, so that its peak memory is its own (CPU: resident memory above
the inputs; CUDA, `--device cuda`: the caching allocator's peak, time from CUDA events). Both compute
KL(π‖π_ref) per token and the gradients of Σ KL for the policy's hidden states and LM head.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import Memory, add_device_argument, describe, resolve_device, timed


def run(variant: str, tokens: int, vocab: int, hidden: int, chunk: int, threads: int, device: str) -> dict:
    torch.set_num_threads(threads)
    device = resolve_device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=gen).to(device).requires_grad_()
    w = (0.05 * torch.randn(vocab, hidden, generator=gen)).to(device).requires_grad_()
    x_ref = torch.randn(1, tokens, hidden, generator=gen).to(device)
    w_ref = (0.05 * torch.randn(vocab, hidden, generator=gen)).to(device)
    from pgloss.vocab.full_kl import full_kl_from_hidden

    memory = Memory(device)
    memory.set_baseline()
    out = {}

    def step():
        if variant == "fused":
            kl = full_kl_from_hidden(x, w, x_ref, w_ref, chunk_size=chunk)
        else:
            log_pi = torch.log_softmax(x @ w.t(), -1)
            log_rho = torch.log_softmax(x_ref @ w_ref.t(), -1)
            kl = (log_pi.exp() * (log_pi - log_rho)).sum(-1)
        kl.sum().backward()
        out["kl"] = kl.detach()

    seconds, _ = timed(step, device)
    return {
        "variant": variant,
        "seconds": round(seconds, 3),
        "growth_mib": round(memory.peak_above_baseline(), 1),
        "kl_mean": float(out["kl"].mean()),
        "grad_w_norm": float(w.grad.norm()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the fused path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variant", choices=["fused", "materialised"], help="run one variant in this process")
    add_device_argument(parser)
    args = parser.parse_args()
    shape = (args.tokens, args.vocab, args.hidden, args.chunk, args.threads, args.device)
    if args.variant:
        print(json.dumps(run(args.variant, *shape)))
        return
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    torch.set_num_threads(args.threads)
    print(describe(resolve_device(args.device)))
    print(
        f"N={args.tokens} tokens, V={args.vocab}, H={args.hidden}, chunk={args.chunk}, threads={args.threads}; "
        f"one float32 N x V logits tensor = {logits_mib:.0f} MiB"
    )
    results = []
    for variant in ("materialised", "fused"):
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--variant",
                variant,
                "--tokens",
                str(args.tokens),
                "--vocab",
                str(args.vocab),
                "--hidden",
                str(args.hidden),
                "--chunk",
                str(args.chunk),
                "--threads",
                str(args.threads),
                "--device",
                args.device,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        results.append(json.loads(out.stdout))
        print(results[-1])
    plain, fused = results
    print(
        f"KL agrees to {abs(plain['kl_mean'] - fused['kl_mean']):.2e}, grad norm to "
        f"{abs(plain['grad_w_norm'] - fused['grad_w_norm']) / plain['grad_w_norm']:.2e} (relative); "
        f"memory growth {plain['growth_mib'] / max(fused['growth_mib'], 1e-9):.1f}x lower, "
        f"time {fused['seconds'] / plain['seconds']:.2f}x"
    )


if __name__ == "__main__":
    main()
