"""The divergence of a student from a teacher over the whole vocabulary, per position: the forward KL,
the reverse KL and the generalised Jensen-Shannon divergence between them, from logits or from both
models' hidden states and LM heads, without materialising either model's N × V logits.

With the student's and the teacher's tempered distributions p_S = softmax(z_S/τ), p_T = softmax(z_T/τ)
at one position and β ∈ [0, 1] (GKD, Agarwal et al. 2024, arXiv 2306.13649; TRL 1.16
`GKDTrainer.generalized_jsd_loss` and trl/kernels/chunked_divergence.py, whose convention this is):

    β = 0:       KL(p_T‖p_S) = Σᵥ p_T,ᵥ (log p_T,ᵥ − log p_S,ᵥ)                 (forward KL)
    β = 1:       KL(p_S‖p_T) = Σᵥ p_S,ᵥ (log p_S,ᵥ − log p_T,ᵥ)                 (reverse KL)
    0 < β < 1:   JSD_β = β·KL(p_T‖m) + (1 − β)·KL(p_S‖m),   m = (1 − β)·p_S + β·p_T

and the gradients with respect to the student's logits (the teacher is frozen):

    β = 0:       (1/τ)·(p_S − p_T)
    β = 1:       (1/τ)·p_S·(log p_S − log p_T − KL(p_S‖p_T))
    0 < β < 1:   (1/τ)·(1 − β)·p_S·(log p_S − log m − KL(p_S‖m))

(the mixture's own dependence on p_S cancels: ∂JSD_β/∂p_S,ᵥ = (1 − β)(log p_S,ᵥ − log m_ᵥ)). JSD_β
tends to 0, not to either KL, as β tends to 0 or 1: the two ends are the KLs by definition, as in TRL.
The reverse KL is `full_kl.FullKL` between the student and the teacher (one implementation); the
forward KL accumulates over vocabulary tiles with online maxima like it; JSD_β needs both
normalisers before its mixture, so it runs whole-vocabulary rows (one [chunk, V] buffer per model).
Masked positions are the caller's to drop (`torch.where(mask, d, 0)` or `pgloss.aggregate`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .entropy import _blocks
from .full_kl import FullKL, pair_from_hidden, pair_from_logits

__all__ = ["divergence_from_logits", "divergence_from_hidden"]


class ForwardKL(FullKL):
    """Statistic of `chunks.ChunkLoop`: KL(p_T‖p_S), the first source the student. `FullKL`'s sums with
    the two sources' roles swapped (values: KL, lse_T, lse_S), and the gradient (1/τ)(p_S − p_T)."""

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        super().forward(zs[::-1], rows, values)

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        return super().tile_forward(zs[::-1], rows, cols, state)

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads, temperature: float) -> Tensor:
        z, z_teacher = zs
        _, lse_teacher, lse = (v[rows] for v in values)
        scale = (grads[0][rows] / temperature).unsqueeze(-1)
        for block, _ in _blocks(z, 0):
            p = z[block].sub_(lse[block].unsqueeze(-1)).exp_()
            p.sub_(z_teacher[block].sub_(lse_teacher[block].unsqueeze(-1)).exp_()).mul_(scale[block])
        return z


class GeneralizedJSD:
    """Statistic of `chunks.ChunkLoop`: JSD_β for 0 < β < 1, whole-vocabulary rows (values: JSD_β, lse_S,
    lse_T and KL(p_S‖m), which the gradient reads)."""

    def __init__(self, beta: float) -> None:
        self.beta, self.log_beta, self.log_rest = beta, math.log(beta), math.log1p(-beta)

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(4)]

    def _mixture(self, log_p: Tensor, log_q: Tensor, out: Tensor) -> Tensor:
        """log m = log((1 − β)·p_S + β·p_T) from log p_S and log p_T, into `out`."""
        torch.add(log_q, self.log_beta - self.log_rest, out=out)
        return torch.logaddexp(log_p, out, out=out).add_(self.log_rest)

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        z, z_teacher = zs
        jsd, lse, lse_teacher, kl_student = (v[rows] for v in values)
        torch.logsumexp(z, dim=-1, out=lse)
        torch.logsumexp(z_teacher, dim=-1, out=lse_teacher)
        for block, (log_p, log_q, log_m, work) in _blocks(z, 4):
            torch.sub(z[block], lse[block].unsqueeze(-1), out=log_p)
            torch.sub(z_teacher[block], lse_teacher[block].unsqueeze(-1), out=log_q)
            self._mixture(log_p, log_q, log_m)
            kl_student[block] = torch.sub(log_p, log_m, out=work).mul_(log_p.exp_()).sum(dim=-1)
            kl_teacher = torch.sub(log_q, log_m, out=work).mul_(log_q.exp_()).sum(dim=-1)
            jsd[block] = self.beta * kl_teacher + (1.0 - self.beta) * kl_student[block]

    def outputs(self, values: list[Tensor]) -> Tensor:
        return values[0]

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads, temperature: float) -> Tensor:
        z, z_teacher = zs
        _, lse, lse_teacher, kl_student = (v[rows] for v in values)
        scale = (grads[0][rows] * ((1.0 - self.beta) / temperature)).unsqueeze(-1)
        for block, (log_m,) in _blocks(z, 1):
            log_p = z[block].sub_(lse[block].unsqueeze(-1))
            log_q = z_teacher[block].sub_(lse_teacher[block].unsqueeze(-1))
            diff = self._mixture(log_p, log_q, log_m).neg_().add_(log_p).sub_(kl_student[block].unsqueeze(-1))
            log_p.exp_().mul_(diff).mul_(scale[block])
        return z


def _statistic(beta: float):
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a number in [0, 1] (0: forward KL, 1: reverse KL, between: JSD), got {beta!r}")
    if beta == 0.0:
        return ForwardKL()
    if beta == 1.0:
        return FullKL()
    return GeneralizedJSD(float(beta))


def divergence_from_logits(
    logits: Tensor, teacher_logits: Tensor, *, beta: float = 0.5, temperature: float = 1.0,
    chunk_size: int | None = None, vocab_block: int | None = None, memory_budget: int | None = None,
) -> Tensor:
    """The student's divergence from the teacher per position (module docstring), chunked; gradient to
    `logits` only.

    Args:
        logits: [..., V] student logits (any float dtype; the math runs in float32, float64 stays).
        teacher_logits: [..., V] teacher logits of the same shape (never differentiated).
        beta: 0 forward KL(p_T‖p_S), 1 reverse KL(p_S‖p_T), between the generalised JSD (TRL's `beta`).
        temperature: τ > 0, dividing both logits.
        chunk_size, vocab_block, memory_budget: as for `full_kl_from_logits` (tiles for β ∈ {0, 1}).

    Returns:
        [...] the divergence per position, float32 (float64 for float64 logits).
    """
    return pair_from_logits(_statistic(beta), logits, teacher_logits, "teacher", temperature=temperature,
                            chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)


def divergence_from_hidden(
    hidden: Tensor, weight: Tensor, teacher_hidden: Tensor, teacher_weight: Tensor, *, beta: float = 0.5,
    temperature: float = 1.0, chunk_size: int | None = None, vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> Tensor:
    """The student's divergence from the teacher per position, [B, T], from both models' final hidden
    states and LM heads, never more than one [chunk, V] (or [chunk, vocab_block]) buffer per model.

    Args:
        hidden: [B, T, H] student hidden states; weight: [V, H] its LM head (gradients to both).
        teacher_hidden: [B, T, H'] teacher hidden states (H' may differ); teacher_weight: [V, H'].
        beta, temperature, chunk_size, vocab_block, memory_budget: as for `divergence_from_logits`.
    """
    return pair_from_hidden(_statistic(beta), hidden, weight, teacher_hidden, teacher_weight, "teacher",
                            temperature=temperature, chunk_size=chunk_size, vocab_block=vocab_block,
                            memory_budget=memory_budget)
