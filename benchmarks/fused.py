"""Peak memory and time of a policy-gradient loss from hidden states, fused against unfused.

Each variant runs in its own process, so that its peak memory is its own. Inside the process the
baseline is the resident memory with the inputs and buffers the size of their gradients
allocated; the peak reported is the high-water mark above that baseline.

Variants (forward + backward to hidden and weight, the loss of `--algorithm`):
  naive    logits = hidden @ weightᵀ materialised, log_softmax + gather, then the algorithm
  fused    pgloss.from_hidden.loss_from_hidden on the route the library picks (Triton kernels on CUDA):
           its tiles, or --chunk-size
  fused-torch  the same on the torch route (`pgloss.vocab.kernels.use("torch")`), the kernels' reference
  fused-head-kernel  the same on the head-kernel route (`kernels.use("head-kernel")`: the logits formed inside
           Triton kernels, ∂x and ∂W added by them; CUDA, or Triton's interpreter with TRITON_INTERPRET=1)
  tiled    pgloss.from_hidden.loss_from_hidden, token chunks and vocabulary tiles chosen from
           --memory-budget (bytes), each tile's logits recomputed in backward
  trl      TRL 1.16's ChunkedLogProbFunction (trl/kernels/chunked_logprob.py: token chunks of 4096 and
           vocabulary tiles of --trl-chunk columns, torch ops off Triton) for log π and H, then the algorithm
  liger    Liger-Kernel's LigerFusedLinearGRPOLoss on the same inputs (its own GRPO/DAPO loss), compiled by
           torch.compile, warmed up on one sequence as every variant is: the timed batch's shape is new to
           it, as a trainer's next batch is
  liger-static  the same warmed up on the timed batch itself, so that torch.compile never meets a new shape:
           where liger fails and liger-static runs, the failure is the recompilation for a new shape
  lce      torch.nn.functional.linear_cross_entropy (chunked, pgloss's chunk size) for log π, then
           the algorithm (no entropy: that metric is missing)
  cce      Cut Cross-Entropy's linear_cross_entropy (package cut-cross-entropy; Triton, CUDA only; its
           default gradient filter) with reduction="none" for log π, then the algorithm (no entropy)
  floor    the three matmuls no loss can avoid: x Wᵀ, G W and Gᵀ x (6·N·H·V flops)
  reference  the loss on float64 logits of the same inputs, materialised a token chunk at a time,
           forward only: the value every variant's loss is compared with (its time is not a route's)

    python benchmarks/fused.py --tokens 4096 --hidden 1024 --vocab 151936
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import Memory, add_device_argument, cell, describe, resolve_device, run_variants, timed

VARIANTS = (
    "naive",
    "fused",
    "fused-torch",
    "fused-head-kernel",
    "tiled",
    "trl",
    "liger",
    "liger-static",
    "lce",
    "cce",
    "floor",
    "reference",
)
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float64": "float64"}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="N, tokens in the batch")
    parser.add_argument("--seq-len", type=int, default=256, help="T, tokens per sequence (B = N / T)")
    parser.add_argument("--hidden", type=int, default=1024, help="H, hidden size")
    parser.add_argument("--vocab", type=int, default=151936, help="V, vocabulary size")
    add_device_argument(parser)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per variant (the median is reported)")
    parser.add_argument("--algorithm", default="grpo", help="a name from pgloss.names()")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--chunk-size", type=int, default=None, help="pgloss chunk (tokens); default ≈ 2²⁵ / V")
    parser.add_argument(
        "--memory-budget",
        type=int,
        default=64 << 20,
        help="bytes for the tiled variant's buffers (pgloss memory_budget=)",
    )
    parser.add_argument("--trl-chunk", type=int, default=4096, help="vocabulary columns per tile of the trl variant")
    parser.add_argument(
        "--fused-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a keyword of pgloss.from_hidden.loss_from_hidden for the fused variant (repeatable; "
        "the value is read as a Python literal, else kept as a string)",
    )
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help="comma-separated subset of " + ",".join(VARIANTS)
    )
    parser.add_argument(
        "--head-blocks",
        default=None,
        metavar="N,V,K,WARPS",
        help="the fused-head-kernel row's blocks on a GPU (rows, columns, hidden units, warps) in place of "
        "pgloss.vocab.head_tile.gpu_blocks', to try others before the library's are chosen",
    )
    parser.add_argument("--timeout", type=int, default=300, help="seconds allowed to one variant's process")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens % args.seq_len:
        parser.error(f"--tokens ({args.tokens}) must be a multiple of --seq-len ({args.seq_len})")
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; valid: {VARIANTS}")
    if args.head_blocks is not None:
        try:
            blocks = tuple(int(n) for n in args.head_blocks.split(","))
        except ValueError:
            blocks = ()
        if len(blocks) != 4 or any(n < 1 or n & (n - 1) for n in blocks):
            parser.error(f"--head-blocks takes four powers of two N,V,K,WARPS, got {args.head_blocks!r}")
        args.head_blocks = blocks
    return args


# ------------------------------------------------------------------------------------------
# Child: one variant, one process.
# ------------------------------------------------------------------------------------------


def make_inputs(args, torch):
    device, dtype = torch.device(args.device), getattr(torch, DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(0)
    batch, length = args.tokens // args.seq_len, args.seq_len
    hidden = torch.randn(batch, length, args.hidden, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=gen) / math.sqrt(args.hidden)).to(device, dtype)
    weight.requires_grad_()
    targets = torch.randint(0, args.vocab, (batch, length), generator=gen).to(device)
    lengths = torch.randint(length // 2, length + 1, (batch,), generator=gen)
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(device)
    # Old and reference log-probs near the current ones, as after a few optimizer steps.
    from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

    with torch.no_grad():
        current, _ = log_prob_and_entropy_from_hidden(hidden, weight, targets, temperature=args.temperature)
    current = current.cpu()
    old_log_prob = (current + 0.1 * torch.randn(batch, length, generator=gen)).clamp(max=0.0).to(device)
    ref_log_prob = (current + 0.05 * torch.randn(batch, length, generator=gen)).to(device)
    advantages = torch.randn(batch, generator=gen).to(device)
    return dict(
        hidden=hidden,
        weight=weight,
        targets=targets,
        mask=mask,
        old_log_prob=old_log_prob,
        ref_log_prob=ref_log_prob,
        advantages=advantages,
    )


def _head(inputs, rows):
    """The first `rows` sequences of every tensor (a small warm-up batch)."""
    out = {}
    for key, value in inputs.items():
        if key == "weight":
            out[key] = value
        else:
            head = value[:rows].detach()
            out[key] = head.requires_grad_() if key == "hidden" else head
    return out


def build_variant(name, args, algorithm):
    """A function inputs -> scalar loss (forward only), or raise RuntimeError with the reason."""
    import torch
    import torch.nn.functional as F

    from pgloss.from_hidden import loss_from_hidden

    tau = args.temperature

    def common(inputs):
        return dict(
            old_log_prob=inputs["old_log_prob"],
            advantages=inputs["advantages"],
            mask=inputs["mask"],
            ref_log_prob=inputs["ref_log_prob"] if algorithm.uses_reference else None,
        )

    if name == "naive":

        def run(inputs):
            logits = inputs["hidden"] @ inputs["weight"].t()
            log_softmax = torch.log_softmax(logits.float() / tau, dim=-1)
            del logits
            targets = torch.where(inputs["mask"], inputs["targets"], 0)
            log_prob = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
            grad_entropy = torch.enable_grad() if algorithm.entropy_coef != 0 else torch.no_grad()
            with grad_entropy:
                entropy = -(log_softmax.exp() * log_softmax).sum(-1)
            return algorithm(log_prob=log_prob, entropy=entropy, **common(inputs)).loss

        return run

    if name in ("fused", "fused-torch", "fused-head-kernel"):
        from pgloss.vocab import kernels

        options = {"chunk_size": args.chunk_size, **fused_options(args.fused_option)}
        route = {"fused-torch": "torch", "fused-head-kernel": "head-kernel"}.get(name, "auto")
        if name == "fused-head-kernel" and args.head_blocks is not None:
            from pgloss.vocab import head_tile

            head_tile.gpu_blocks = lambda dtype: args.head_blocks  # this process only: a trial of other blocks

        def run(inputs):
            with kernels.use(route):
                return loss_from_hidden(
                    algorithm,
                    inputs["hidden"],
                    inputs["weight"],
                    inputs["targets"],
                    temperature=tau,
                    **options,
                    **common(inputs),
                ).loss

        return run

    if name == "tiled":

        def run(inputs):
            return loss_from_hidden(
                algorithm,
                inputs["hidden"],
                inputs["weight"],
                inputs["targets"],
                temperature=tau,
                memory_budget=args.memory_budget,
                **common(inputs),
            ).loss

        return run

    if name == "trl":
        try:
            from trl.kernels.chunked_logprob import ChunkedLogProbFunction
        except Exception as error:
            raise RuntimeError(
                f"trl.kernels.chunked_logprob does not import: {type(error).__name__}: {error}"
            ) from None

        def run(inputs):
            hidden = inputs["hidden"]
            batch, length, size = hidden.shape
            targets = torch.where(inputs["mask"], inputs["targets"], 0).reshape(-1)
            log_prob, entropy, *_ = ChunkedLogProbFunction.apply(
                hidden.reshape(-1, size), inputs["weight"], None, targets, tau, args.trl_chunk, None, 1.0, ("entropy",)
            )
            if algorithm.entropy_coef == 0:
                entropy = entropy.detach()
            return algorithm(
                log_prob=log_prob.view(batch, length), entropy=entropy.view(batch, length), **common(inputs)
            ).loss

        return run

    if name == "lce":
        if not hasattr(F, "linear_cross_entropy"):
            raise RuntimeError(f"torch {torch.__version__} has no torch.nn.functional.linear_cross_entropy")
        options = None
        if hasattr(torch.nn, "LinearCrossEntropyOptions"):  # chunked, with pgloss's chunk size
            from pgloss.vocab.entropy import default_chunk_size

            chunk = args.chunk_size or default_chunk_size(args.vocab)
            options = torch.nn.LinearCrossEntropyOptions(chunking_method=None, batch_chunk_size=chunk)

        def run(inputs):
            hidden = inputs["hidden"]
            batch, length, size = hidden.shape
            targets = torch.where(inputs["mask"], inputs["targets"], -100)
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a silent fallback to the unchunked path would mislead
                nll = F.linear_cross_entropy(
                    (hidden / tau).reshape(-1, size),
                    inputs["weight"],
                    targets.reshape(-1),
                    reduction="none",
                    options=options,
                )
            log_prob = -nll.view(batch, length).float()
            return algorithm(log_prob=log_prob, **common(inputs)).loss  # no entropy: no entropy metric

        return run

    if name == "cce":
        try:
            from cut_cross_entropy import linear_cross_entropy
        except Exception as error:
            raise RuntimeError(f"cut_cross_entropy does not import: {type(error).__name__}: {error}") from None
        if args.device != "cuda":
            raise RuntimeError("Cut Cross-Entropy's kernels are Triton's: they need --device cuda")

        def run(inputs):
            hidden = inputs["hidden"]
            batch, length, size = hidden.shape
            targets = torch.where(inputs["mask"], inputs["targets"], -100)
            nll = linear_cross_entropy(
                (hidden / tau).reshape(-1, size), inputs["weight"], targets.reshape(-1), reduction="none"
            )
            log_prob = -nll.view(batch, length).float()
            return algorithm(log_prob=log_prob, **common(inputs)).loss  # no entropy: no entropy metric

        return run

    if name in ("liger", "liger-static"):
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        except Exception as error:
            raise RuntimeError(f"liger-kernel does not import: {type(error).__name__}: {error}") from None
        modes = {"seq-mean-token-mean": "grpo", "token-mean": "bnpo"}
        family = type(algorithm).__name__
        if (
            family != "ClippedPolicy"
            or getattr(algorithm, "ratio_level", "token") != "token"
            or algorithm.loss_agg_mode not in modes
            or getattr(algorithm, "dual_clip", None)
        ):
            raise RuntimeError(f"{algorithm.name} has no LigerFusedLinearGRPOLoss counterpart")
        if algorithm.kl_coef and algorithm.kl_estimator != "k3":
            raise RuntimeError("Liger's KL term is k3 only")
        loss_fn = LigerFusedLinearGRPOLoss(
            beta=algorithm.kl_coef,
            use_ref_model=algorithm.kl_coef != 0,
            loss_type=modes[algorithm.loss_agg_mode],
            epsilon_low=algorithm.clip_low,
            epsilon_high=algorithm.clip_high,
            temperature=tau,
            chunk_size=1,
            compiled=True,
        )

        def run(inputs):
            loss, _ = loss_fn(
                inputs["hidden"],
                inputs["weight"],
                inputs["targets"].masked_fill(~inputs["mask"], 0),
                inputs["mask"].long(),
                inputs["advantages"],
                ref_per_token_logps=inputs["ref_log_prob"] if algorithm.kl_coef else None,
                old_per_token_logps=inputs["old_log_prob"],
            )
            return loss

        return run

    raise ValueError(name)


def fused_options(pairs: list[str]) -> dict:
    """--fused-option NAME=VALUE pairs as keywords of loss_from_hidden; a name it does not take is refused."""
    import ast
    import inspect

    from pgloss.from_hidden import loss_from_hidden

    accepted = inspect.signature(loss_from_hidden).parameters
    options = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or name not in accepted:
            raise RuntimeError(f"--fused-option {pair!r}: loss_from_hidden takes no keyword {name!r} in this pgloss")
        try:
            options[name] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            options[name] = value
    return options


def reference_loss(inputs, args, algorithm, torch) -> float:
    """The loss on the float64 logits of the same (rounded) inputs, one token chunk of logits at a time,
    forward only; log π and H from log_softmax in float64."""
    from pgloss.vocab.entropy import default_chunk_size

    with torch.no_grad():
        hidden = inputs["hidden"].detach().reshape(-1, args.hidden)
        weight = inputs["weight"].detach().double()
        targets = torch.where(inputs["mask"], inputs["targets"], 0).reshape(-1, 1)
        chunk = max(1, default_chunk_size(args.vocab) // 2)  # float64 rows are twice float32's
        log_prob, entropy = [], []
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            log_softmax = torch.log_softmax(hidden[rows].double() @ weight.t() / args.temperature, dim=-1)
            log_prob.append(log_softmax.gather(-1, targets[rows]).squeeze(-1))
            entropy.append(-(log_softmax.exp() * log_softmax).sum(-1))
        shape = inputs["mask"].shape
        loss = algorithm(
            log_prob=torch.cat(log_prob).view(shape),
            entropy=torch.cat(entropy).view(shape),
            old_log_prob=inputs["old_log_prob"].double(),
            advantages=inputs["advantages"].double(),
            mask=inputs["mask"],
            ref_log_prob=inputs["ref_log_prob"].double() if algorithm.uses_reference else None,
        ).loss
    return float(loss)


def floor_step(inputs, args, torch):
    """logits = x Wᵀ, grad_x = G W, grad_W = Gᵀ x with G the size of the logits: 6·N·H·V flops."""
    x = inputs["hidden"].detach().reshape(-1, args.hidden)
    w = inputs["weight"].detach()

    def step():
        logits = torch.mm(x, w.t())
        torch.mm(logits, w)
        torch.mm(logits.t(), x)

    return step


def child(args) -> dict:
    import torch

    import pgloss

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = resolve_device(args.device)
    algorithm = pgloss.get(args.algorithm, generation_budget=args.seq_len)
    result = {"variant": args.child, "time_s": None, "cpu_s": None, "peak_mib": None, "loss": None, "note": ""}

    inputs = make_inputs(args, torch)
    memory = Memory(device)
    placeholders = [torch.ones_like(inputs["hidden"]), torch.ones_like(inputs["weight"])]  # the gradients' room
    memory.set_baseline()
    del placeholders

    if args.child == "reference":
        times = [timed(lambda: result.update(loss=reference_loss(inputs, args, algorithm, torch)), device)]
        result.update(time_s=times[0][0], cpu_s=times[0][1], note="float64 logits, forward only: the loss's reference")
        return result
    if args.child == "floor":
        times = [timed(floor_step(inputs, args, torch), device) for _ in range(args.repeats)]
        result.update(
            time_s=statistics.median(t[0] for t in times),
            cpu_s=statistics.median(t[1] for t in times),
            note="three matmuls, logits-sized G: time only",
        )
        return result
    try:
        run = build_variant(args.child, args, algorithm)
        # warm-up on one sequence (thread pools, compilation); liger-static's on the timed batch
        warm = inputs if args.child == "liger-static" else _head(inputs, 1)
        run(warm).backward()
        del warm
    except Exception as error:
        result["note"] = f"skipped: {str(error).splitlines()[0][:150]}"
        return result

    times, losses = [], []

    def step():
        inputs["hidden"].grad = inputs["weight"].grad = None
        loss = run(inputs)
        loss.backward()
        losses.append(float(loss.detach()))

    for _ in range(args.repeats):
        times.append(timed(step, device))
    result.update(
        time_s=statistics.median(t[0] for t in times),
        cpu_s=statistics.median(t[1] for t in times),
        peak_mib=memory.peak_above_baseline(),
        loss=losses[-1],
    )
    return result


# ------------------------------------------------------------------------------------------
# Parent: one subprocess per variant, then the table.
# ------------------------------------------------------------------------------------------


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe(resolve_device(args.device)))
    threads = torch.get_num_threads()
    print(
        f"N={args.tokens} (B={args.tokens // args.seq_len} x T={args.seq_len}) H={args.hidden} V={args.vocab} "
        f"{args.dtype} on {args.device}, algorithm={args.algorithm}, temperature={args.temperature}, "
        f"repeats={args.repeats}, torch {torch.__version__}, {threads} threads, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    results = run_variants(
        __file__, list(argv if argv is not None else sys.argv[1:]), args.variants.split(","), args.timeout
    )

    by_name = {r["variant"]: r for r in results}
    naive, floor = by_name.get("naive", {}), by_name.get("floor", {})

    def ratio(r, key, base):
        return r.get(key) / base[key] if r.get(key) and base.get(key) else None

    grads_mib = (
        (args.tokens * args.hidden + args.vocab * args.hidden)
        * (2 if args.dtype == "bfloat16" else 8 if args.dtype == "float64" else 4)
        / 2**20
    )
    columns = [
        "variant",
        "peak above floor (MiB)",
        "naive / this (mem)",
        "above inputs (MiB)",
        "ratio above inputs",
        "wall (s)",
        "CPU (s)",
        "vs naive (wall / CPU)",
        "vs floor (wall / CPU)",
        "loss",
        "note",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + "|".join("-" * (len(c) + 2) for c in columns) + "|")
    for r in results:
        peak = r.get("peak_mib")
        mem = naive["peak_mib"] / peak if peak and naive.get("peak_mib") else None
        cells = [
            r["variant"].ljust(len(columns[0])),
            cell(peak, ".0f", len(columns[1])),
            cell(mem, ".1f", len(columns[2])),
            cell(None if peak is None else peak + grads_mib, ".0f", len(columns[3])),
            cell(
                (naive["peak_mib"] + grads_mib) / (peak + grads_mib) if peak and naive.get("peak_mib") else None,
                ".1f",
                len(columns[4]),
            ),
            cell(r.get("time_s"), ".2f", len(columns[5])),
            cell(r.get("cpu_s"), ".2f", len(columns[6])),
            (cell(ratio(r, "time_s", naive), ".2f", 0) + " / " + cell(ratio(r, "cpu_s", naive), ".2f", 0)).rjust(
                len(columns[7])
            ),
            (cell(ratio(r, "time_s", floor), ".2f", 0) + " / " + cell(ratio(r, "cpu_s", floor), ".2f", 0)).rjust(
                len(columns[8])
            ),
            cell(r.get("loss"), ".6f", len(columns[9])),
            r.get("note", ""),
        ]
        print("| " + " | ".join(cells) + " |")
    print(
        f"peak above floor: above the inputs and the room of hidden.grad and weight.grad (measured); above inputs: "
        f"that plus the gradients' {grads_mib:.0f} MiB, which every path holds"
    )
    print(f"load average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
