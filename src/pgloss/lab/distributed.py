"""Data parallelism for the lab with torch.distributed: gloo on CPU, nccl on GPU.

Launch with ``torchrun --nproc_per_node 2 -m pgloss.cli train ...``. Every rank samples its
share of the step's prompts; the loss is normalised by `pgloss.Normalizer`, whose counts are
all-reduced over ranks, so averaging gradients over ranks gives the whole batch's gradient.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def init(device: str) -> tuple[int, int]:
    """Join the process group when launched by torchrun; returns (rank, world size)."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
        if device.startswith("cuda"):
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    return rank(), world_size()


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def average_gradients(model: torch.nn.Module) -> None:
    """Average every parameter's gradient over ranks (a missing gradient counts as zero)."""
    if not active():
        return
    world = dist.get_world_size()
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad)
        p.grad.div_(world)


def broadcast_parameters(model: torch.nn.Module) -> None:
    """Copy rank 0's parameters to every rank."""
    if active():
        for p in model.parameters():
            dist.broadcast(p.data, 0)


def mean(values: torch.Tensor) -> torch.Tensor:
    """Average a tensor over ranks, elementwise, skipping NaN (a rank without data); identity on one process."""
    if active():
        device = values.device
        present = ~values.isnan()
        both = torch.stack([torch.where(present, values, 0.0), present.to(values.dtype)])
        if dist.get_backend() == "nccl":
            both = both.cuda()
        dist.all_reduce(both)
        values = (both[0] / both[1]).to(device)  # NaN where no rank had a value
    return values


def cleanup() -> None:
    if active():
        dist.destroy_process_group()


def total(values: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks, elementwise; identity on one process."""
    if active():
        device = values.device
        values = values.cuda() if dist.get_backend() == "nccl" else values.clone()
        dist.all_reduce(values)
        values = values.to(device)
    return values
