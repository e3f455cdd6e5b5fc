"""The one-pass route of `loss.loss_from_hidden`: the loss's gradients formed while its logits are at hand.

When whole sequences fit in a chunk (T ≤ chunk_size), chunks of whole rows are walked once. Every aggregation
weight depends only on the mask and the step's global counts, and every sequence-level coupling (GSPO's ratio,
FIPO's future KL) stays inside a row, so a row chunk's loss under the step's `Normalizer` is its exact share of
the batch loss (the split invariance of `pgloss.core.aggregate`). Its ∂L/∂log π and ∂L/∂H are therefore known as
soon as its logits are, and with G = ∂L/∂(W x + b) of the chunk

    ∂L/∂x = G W,        ∂L/∂W = Σ_chunks Gᵀ x,        ∂L/∂b = Σ_chunks Σ_rows G

are formed in the forward pass: three N·H·V matmuls, the 6NHV floor (8NHV with vocabulary tiles, each tile
recomputed for the gradient). `AttachGradients` hands them to autograd when the caller's `loss.backward()` runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.batch import compute_dtype
from ..core.normalizer import Normalizer
from ..core.output import LossOutput
from ..core.sequence_parallel import SequenceParallel
from ..vocab.backends import Plan
from ..vocab.chunks import HeadRows, backward_rows, forward_rows
from ..vocab.entropy import LogProbEntropy
from ..vocab.head import HeadKind

__all__ = ["FusedAlgorithm", "AttachGradients", "OnePass", "loss_one_pass"]


class FusedAlgorithm(Protocol):
    """What the driver reads of a `pgloss.Algorithm` (base.py calls the driver and hands itself in: a module on
    base.py's floor that imported it back would close a circle)."""

    @property
    def name(self) -> str: ...

    @property
    def kl_coef(self) -> float: ...

    @property
    def kl_estimator(self) -> str: ...

    @property
    def entropy_coef(self) -> float: ...

    @property
    def couples_rows(self) -> bool: ...

    def count_step(
        self,
        mask: Tensor | Sequence[Tensor],
        *,
        count_rejected: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
        **inputs: Tensor | Sequence[Tensor] | None,
    ) -> Normalizer: ...

    def __call__(
        self,
        log_prob: Tensor,
        old_log_prob: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        normalizer: Normalizer | None = None,
        **inputs: Tensor | None,
    ) -> LossOutput: ...


class AttachGradients(torch.autograd.Function):
    """The loss value, with ∂L/∂hidden, ∂L/∂weight and ∂L/∂bias already computed in the forward pass."""

    @staticmethod
    def forward(ctx, loss, hidden, weight, bias, grad_hidden, grad_weight, grad_bias):
        ctx.grads = [grad_hidden, grad_weight, grad_bias]
        return loss.detach().clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.grads is None:
            raise RuntimeError("the fused loss's gradients were already handed out; backward runs once")
        grads, ctx.grads = ctx.grads, None  # handed to autograd without a copy, scaled in place by ∂(caller)/∂loss
        scale = grad_loss.to(next(g for g in grads if g is not None).dtype)
        return (None, *(None if g is None else g.mul_(scale) for g in grads), None, None, None)


def _rows(value: Tensor | None, rows: slice) -> Tensor | None:
    """`value[rows]` (the sequences of one chunk), or None."""
    return None if value is None else value[rows]


class OnePass(NamedTuple):
    """What the one pass gives: the [B, T] log π and H (detached), the gradients of hidden, weight and bias (or
    None), and the loss's output when one row chunk held the batch (its call was the batch's call: per_token
    detached), else None."""

    log_prob: Tensor
    entropy: Tensor
    grads: tuple[Tensor | None, Tensor | None, Tensor | None]
    output: LossOutput | None


def loss_one_pass(
    algorithm: FusedAlgorithm,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    kind: HeadKind,
    targets: Tensor,
    temperature: float,
    tiles: Plan,
    normalizer: Normalizer,
    batch: dict[str, Any],
) -> OnePass:
    """`algorithm`'s loss over row chunks of whole sequences (as many as the plan's chunk holds, on its backend),
    each chunk's call given the step's
    `normalizer` and its rows of `batch` (the call's other inputs; `old_log_prob` None: on-policy, each chunk's
    log π_old its own detached log π). With vocabulary tiles (`vocab_block` < V) no chunk's logits outlive
    their tile, and each tile is recomputed for the gradient (8NHV).

    The loss is called once per row chunk. With one chunk (the kernel route takes every token at once, up to 2¹⁵)
    that call is the batch's and its output is returned; with several, a sum of their losses would round otherwise
    than the batch's call, so the caller makes that call for the value and the metrics (`OnePass`).
    """
    n_rows, length, size = hidden.shape
    chunk_rows, vocab_block, backend = tiles.chunk_size // length, tiles.vocab_block, tiles.backend
    dtype = compute_dtype(weight.dtype)
    x_all, y_all = hidden.detach().reshape(-1, size), targets.reshape(-1)
    statistic = LogProbEntropy(y_all)
    source = HeadRows(
        x_all,
        weight.detach(),
        None if bias is None else bias.detach(),
        chunk_rows * length,
        dtype,
        vocab_block,
        kind,
        backend.raw_tiles,
        valid=batch["mask"].reshape(-1),
    )
    source.begin_backward((hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad))
    values = statistic.allocate(x_all.shape[0], dtype, x_all.device)
    with_entropy = algorithm.entropy_coef != 0
    grad_log_prob, grad_entropy = torch.empty_like(values[0]), torch.empty_like(values[1]) if with_entropy else None
    output = None
    for start in range(0, n_rows, chunk_rows):
        rows = slice(start, start + chunk_rows)
        tokens = slice(start * length, (start + chunk_rows) * length)
        zs = forward_rows(backend, statistic, [source], tokens, temperature, vocab_block, values)
        shape = (min(n_rows, start + chunk_rows) - start, length)
        with torch.enable_grad():
            lp_leaf = values[0][tokens].view(shape).detach().requires_grad_()
            ent_leaf = values[1][tokens].view(shape).detach().requires_grad_(with_entropy)
            chunk: dict[str, Any] = {key: _rows(value, rows) for key, value in batch.items()}
            out = algorithm(log_prob=lp_leaf, entropy=ent_leaf, normalizer=normalizer, **chunk)
            chunk_grads = torch.autograd.grad(out.loss, [lp_leaf, ent_leaf] if with_entropy else [lp_leaf])
        if chunk_rows >= n_rows:  # the only chunk: its call is the batch's
            output = dataclasses.replace(out, loss=out.loss.detach(), per_token=out.per_token.detach())
        grad_log_prob[tokens] = chunk_grads[0].reshape(-1)
        if grad_entropy is not None:  # no entropy gradient without the bonus
            grad_entropy[tokens] = chunk_grads[1].reshape(-1)
        grads = (grad_log_prob, grad_entropy)
        backward_rows(
            backend, statistic, [source], tokens, temperature, vocab_block, values, grads, first=start == 0, zs=zs
        )
    grad_hidden, grad_weight, grad_bias = source.gradients()
    grad_hidden = None if grad_hidden is None else grad_hidden.view(hidden.shape)
    params = (grad_hidden, grad_weight, grad_bias)
    return OnePass(values[0].view(n_rows, length), values[1].view(n_rows, length), params, output)
