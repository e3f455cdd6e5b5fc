"""A divergence between two models over the whole vocabulary from their hidden states: the exact
KL(π‖π_ref) (pgloss.full_kl_from_hidden), or with `--beta` a student's divergence from a teacher
(pgloss.divergence_from_hidden: 0 forward KL, 1 reverse KL, between JSD_β), against the plain
computation on materialised logits and, with `--beta`, TRL 1.16's ChunkedDivergenceFunction: time of
forward + backward and peak resident memory.

    python benchmarks/full_kl.py --tokens 2048 --vocab 32768 --hidden 256
    python benchmarks/full_kl.py --tokens 2048 --vocab 32768 --hidden 256 --beta 0.5

Each variant runs in its own process, so that its peak memory is its own (CPU: resident memory above
the inputs; CUDA, `--device cuda`: the caching allocator's peak, time from CUDA events). Each computes
the per-token divergence and the gradients of its sum for the first model's hidden states and LM head.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import Memory, add_device_argument, describe, resolve_device, timed  # noqa: E402


def plain(log_pi, log_rho, beta):
    """The divergence on materialised log-probabilities: KL(π‖ρ) (beta None or 1), KL(ρ‖π) (0), JSD_β."""
    if beta is None or beta == 1.0:
        return (log_pi.exp() * (log_pi - log_rho)).sum(-1)
    if beta == 0.0:
        return (log_rho.exp() * (log_rho - log_pi)).sum(-1)
    log_m = torch.logaddexp(log_pi + math.log1p(-beta), log_rho + math.log(beta))
    return beta * (log_rho.exp() * (log_rho - log_m)).sum(-1) + (1 - beta) * (log_pi.exp() * (log_pi - log_m)).sum(-1)


def run(variant: str, tokens: int, vocab: int, hidden: int, chunk: int, threads: int, device: str,
        beta: float | None) -> dict:
    torch.set_num_threads(threads)
    device = resolve_device(device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, tokens, hidden, generator=gen).to(device).requires_grad_()
    w = (0.05 * torch.randn(vocab, hidden, generator=gen)).to(device).requires_grad_()
    x_ref = torch.randn(1, tokens, hidden, generator=gen).to(device)
    w_ref = (0.05 * torch.randn(vocab, hidden, generator=gen)).to(device)
    from pgloss.vocab.divergence import divergence_from_hidden
    from pgloss.vocab.full_kl import full_kl_from_hidden

    memory = Memory(device)
    memory.set_baseline()
    out = {}

    def step():
        if variant == "fused" and beta is None:
            kl = full_kl_from_hidden(x, w, x_ref, w_ref, chunk_size=chunk)
        elif variant == "fused":
            kl = divergence_from_hidden(x, w, x_ref, w_ref, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device),
                                        beta=beta, chunk_size=chunk).per_token
        elif variant == "trl":
            from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

            kl, _ = ChunkedDivergenceFunction.apply(x[0], w, None, x_ref[0], w_ref, None, beta, 1.0)
        else:
            kl = plain(torch.log_softmax(x @ w.t(), -1), torch.log_softmax(x_ref @ w_ref.t(), -1), beta)
        kl.sum().backward()
        out["kl"] = kl.detach()

    seconds, _ = timed(step, device)
    return {"variant": variant, "seconds": round(seconds, 3), "growth_mib": round(memory.peak_above_baseline(), 1),
            "kl_mean": float(out["kl"].mean()), "grad_w_norm": float(w.grad.norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=256, help="tokens per chunk of the fused path")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--beta", type=float, help="a student's divergence from a teacher (0 forward KL, 1 reverse "
                        "KL, between JSD_β), with TRL's ChunkedDivergenceFunction beside it; default the exact KL")
    parser.add_argument("--variant", choices=["fused", "materialised", "trl"], help="run one variant in this process")
    add_device_argument(parser)
    args = parser.parse_args()
    shape = (args.tokens, args.vocab, args.hidden, args.chunk, args.threads, args.device, args.beta)
    if args.variant:
        print(json.dumps(run(args.variant, *shape)))
        return
    logits_mib = args.tokens * args.vocab * 4 / 2**20
    torch.set_num_threads(args.threads)
    print(describe(resolve_device(args.device)))
    print(f"{'KL(π‖π_ref)' if args.beta is None else f'divergence beta={args.beta}'}: "
          f"N={args.tokens} tokens, V={args.vocab}, H={args.hidden}, chunk={args.chunk}, threads={args.threads}; "
          f"one float32 N x V logits tensor = {logits_mib:.0f} MiB")
    results = []
    beta = [] if args.beta is None else ["--beta", str(args.beta)]
    for variant in ("materialised", "fused") + (() if args.beta is None else ("trl",)):
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--tokens", str(args.tokens),
                              "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--chunk", str(args.chunk),
                              "--threads", str(args.threads), "--device", args.device, *beta],
                             check=True, capture_output=True, text=True)
        results.append(json.loads(out.stdout))
        print(results[-1])
    naive = results[0]
    for other in results[1:]:
        print(f"{other['variant']}: the divergence agrees to {abs(naive['kl_mean'] - other['kl_mean']):.2e}, grad norm "
              f"to {abs(naive['grad_w_norm'] - other['grad_w_norm']) / naive['grad_w_norm']:.2e} (relative); "
              f"memory growth {naive['growth_mib'] / max(other['growth_mib'], 1e-9):.1f}x lower, "
              f"time {other['seconds'] / naive['seconds']:.2f}x the materialised path's")


if __name__ == "__main__":
    main()
