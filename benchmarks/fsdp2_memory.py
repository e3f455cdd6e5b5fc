"""Peak memory per rank of one FSDP2 training step: the loss from hidden states (`from_hidden`)
against the materialised logits, on gloo ranks (CPU).

    torchrun --nproc_per_node 2 benchmarks/fsdp2_memory.py --path fused
    torchrun --nproc_per_node 2 benchmarks/fsdp2_memory.py --path materialised

One path per launch, so that each rank's peak is its own. The model is an embedding, one tanh
layer and an LM head of V × H, each rank's parameters sharded by `fully_shard` (the layer and the
root); every rank holds N tokens. The step: forward, DAPO's loss (no KL term) under the step's all-reduced
counts, backward (FSDP2's reduce-scatter included). The baseline is the rank's resident memory
once the sharded model and its inputs exist; the peak is its high-water mark above that
(`Memory` of benchmarks/device.py). The fused path gathers the head (`pgloss.vocab.fused.full_head`
when it is sharded on its own; here it is in the root's group, unsharded during the step) and
never holds the N × V logits; the materialised path holds the logits, their log-softmax and
their gradient.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device import Memory, add_device_argument, describe, resolve_device, timed

import pgloss


class Model(torch.nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.block = torch.nn.Linear(hidden, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        return torch.tanh(self.block(self.embed(ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", choices=("fused", "materialised"), required=True)
    parser.add_argument("--tokens", type=int, default=4096, help="N, tokens per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="tokens per chunk of the fused path (None: pgloss's default, about 2**27 / V)",
    )
    parser.add_argument("--threads", type=int, default=1)
    add_device_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    device = resolve_device(args.device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    if rank == 0:
        print(describe(device), flush=True)
    torch.manual_seed(0)
    model = Model(args.vocab, args.hidden).to(device)
    mesh = init_device_mesh(device.type, (world,))
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    gen = torch.Generator().manual_seed(1 + rank)
    rows, length = args.tokens // args.seq_len, args.seq_len
    ids = torch.randint(0, args.vocab, (rows, length), generator=gen)
    targets = torch.randint(0, args.vocab, (rows, length), generator=gen)
    mask = torch.arange(length)[None, :] < torch.randint(length // 2, length + 1, (rows,), generator=gen)[:, None]
    old = -5 - torch.rand(rows, length, generator=gen)
    advantages = torch.randn(rows, generator=gen)
    ids, targets, mask, old, advantages = (t.to(device) for t in (ids, targets, mask, old, advantages))
    algorithm = pgloss.get("dapo")
    memory = Memory(device)
    dist.barrier()
    memory.set_baseline()
    out = {}

    def step():
        normalizer = algorithm.step_normalizer(mask)
        hidden = model(ids)
        if args.path == "fused":
            loss = algorithm.from_hidden(
                hidden,
                model.lm_head.weight,
                targets,
                old_log_prob=old,
                advantages=advantages,
                mask=mask,
                normalizer=normalizer,
                chunk_size=args.chunk_size,
            ).loss
        else:
            log_prob = model.lm_head(hidden).log_softmax(-1).gather(-1, targets[..., None])[..., 0]
            loss = algorithm(log_prob, old, advantages, mask, normalizer=normalizer).loss
        loss.backward()
        out["loss"] = loss.detach()

    seconds, _ = timed(step, device)
    loss = out["loss"]
    peak = memory.peak_above_baseline()
    norm = sum(float(p.grad.full_tensor().norm() ** 2) for p in model.parameters()) ** 0.5
    row = dict(
        path=args.path,
        chunk_size=args.chunk_size,
        rank=rank,
        world=world,
        N=args.tokens,
        V=args.vocab,
        H=args.hidden,
        logits_mib=round(args.tokens * args.vocab * 4 / 2**20, 1),
        peak_mib=round(peak, 1),
        seconds=round(seconds, 2),
        loss=round(float(loss), 6),
        grad_norm=round(norm, 6),
    )
    for r in range(world):
        if r == rank:
            print(json.dumps(row), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
