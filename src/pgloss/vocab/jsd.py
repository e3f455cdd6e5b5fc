"""GKD's generalised Jensen-Shannon divergence JSD(β) = β KL(p_T‖m) + (1 − β) KL(p_S‖m), m = β p_T + (1 − β) p_S,
0 < β < 1, as a statistic of the one chunk loop (`chunks.ChunkLoop`) with its Triton kernels: the formulas, the
sources and the two passes over vocabulary tiles are `divergence.py`'s module docstring; its public functions run it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from . import kernels
from .backends import TRITON_TILES, TileOps
from .entropy import _blocks
from .skewed import TwoPass

__all__ = ["GeneralisedJSD", "jsd_sums"]


def jsd_sums(z: Tensor, z_teacher: Tensor, lse: Tensor, lse_teacher: Tensor, beta: float) -> tuple[Tensor, Tensor]:
    """Per row of tempered logits (a whole row or a vocabulary tile), given both log-normalisers:
    Σᵥ p_T (log p_T − log m) and Σᵥ p_S (log p_S − log m), m = β p_T + (1 − β) p_S; inputs unchanged."""
    n = z.shape[0]
    kl_teacher, kl_student = z.new_empty(n), z.new_empty(n)
    log_keep, log_beta = math.log1p(-beta), math.log(beta)
    for rows, (log_p, log_q, log_m) in _blocks(z, 3):
        torch.sub(z[rows], lse[rows].unsqueeze(-1), out=log_p)
        torch.sub(z_teacher[rows], lse_teacher[rows].unsqueeze(-1), out=log_q)
        torch.logaddexp(log_p + log_keep, log_q + log_beta, out=log_m)
        kl_student[rows] = (log_p - log_m).mul_(log_p.exp()).sum(dim=-1)
        log_p.copy_(log_q).exp_()  # p_T (log p_S is spent)
        kl_teacher[rows] = log_q.sub_(log_m).mul_(log_p).sum(dim=-1)
    return kl_teacher, kl_student


class GeneralisedJSD(TwoPass):
    """Statistic of `chunks.ChunkLoop`: JSD(β) = β KL(p_T‖m) + (1 − β) KL(p_S‖m) per token, 0 < β < 1,
    the student the first source; its values: JSD, lse_S, lse_T and KL(p_S‖m) (the gradient's shift).

    Whole-vocabulary chunks compute both log-normalisers and the sums in one pass. Over vocabulary
    tiles, `normalisers` (lse_S, lse_T of every token, from a first run of the loop with `Normalisers`)
    must be given: each tile adds its terms of both sums."""

    def __init__(self, beta: float, normalisers: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(normalisers)
        self.beta = beta

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(4)]  # JSD, lse_S, lse_T, KL(p_S‖m)

    def _store(
        self,
        rows: slice,
        values: list[Tensor],
        lse: Tensor,
        lse_teacher: Tensor,
        kl_teacher: Tensor,
        kl_student: Tensor,
    ) -> None:
        jsd, lse_out, lse_teacher_out, kl_student_out = values
        jsd[rows] = self.beta * kl_teacher + (1.0 - self.beta) * kl_student
        lse_out[rows], lse_teacher_out[rows], kl_student_out[rows] = lse, lse_teacher, kl_student

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        z, z_teacher = zs
        lse, lse_teacher = torch.logsumexp(z, dim=-1), torch.logsumexp(z_teacher, dim=-1)
        self._store(rows, values, lse, lse_teacher, *jsd_sums(z, z_teacher, lse, lse_teacher, self.beta))

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        z, z_teacher = zs
        sums = jsd_sums(z, z_teacher, *self.given_normalisers(rows), self.beta)
        return sums if state is None else (state[0] + sums[0], state[1] + sums[1])

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        self._store(rows, values, *self.given_normalisers(rows), *state)

    def outputs(self, values: list[Tensor]) -> Tensor:
        return values[0]

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads, temperature: float) -> Tensor:
        """(g/τ)(1 − β) p_S (log p_S − log m − KL(p_S‖m)), written into the student's `z` (the teacher's
        tile is scratch)."""
        z, z_teacher = zs
        _, lse, lse_teacher, kl_student = (v[rows] for v in values)
        scale = (grads[0][rows] * ((1.0 - self.beta) / temperature)).unsqueeze(-1)
        log_keep, log_beta = math.log1p(-self.beta), math.log(self.beta)
        for block, (log_m,) in _blocks(z, 1):
            log_p = z[block].sub_(lse[block].unsqueeze(-1))
            log_q = z_teacher[block].sub_(lse_teacher[block].unsqueeze(-1)).add_(log_beta)
            torch.logaddexp(log_p + log_keep, log_q, out=log_m)
            shift = log_m.sub_(log_p).neg_().sub_(kl_student[block].unsqueeze(-1))  # log p_S − log m − KL(p_S‖m)
            log_p.exp_().mul_(shift).mul_(scale[block])
        return z

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        return self.grad(zs, rows, values, grads, temperature)  # elementwise given both lse and KL(p_S‖m)


# Its Triton kernels (`backends.TRITON_TILES`): the same values, each tile of the two heads' raw outputs one launch
# for the sums and one for the gradient. A whole-vocabulary chunk takes one more launch first, `FullKL`'s, for its
# two log-normalisers.


def _jsd_forward(statistic: GeneralisedJSD, zs: list, rows: slice, values: list[Tensor]) -> None:
    state = kernels.start_state(zs[0], maxima=2, sums=3)
    tile, teacher = zs
    kernels.pair_forward(tile, teacher, state)
    m, m_teacher, s, s_teacher, _ = state
    lse, lse_teacher = m + torch.log(s), m_teacher + torch.log(s_teacher)
    sums = kernels.start_state(zs[0], maxima=0, sums=2)
    kernels.jsd_forward(tile, teacher, lse, lse_teacher, sums, statistic.beta)
    statistic._store(rows, values, lse, lse_teacher, *sums)


def _jsd_tile_forward(statistic: GeneralisedJSD, zs: list, rows: slice, cols: slice, state):
    tile, teacher = zs
    state = kernels.start_state(tile, maxima=0, sums=2) if state is None else state
    kernels.jsd_forward(tile, teacher, *statistic.given_normalisers(rows), state, statistic.beta)
    return state


def _jsd_tile_grad(
    statistic: GeneralisedJSD, zs: list, rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
) -> Tensor:
    _, lse, lse_teacher, kl_student = (v[rows] for v in values)
    tile, teacher = zs
    return kernels.pair_backward(
        tile, teacher, lse, lse_teacher, kl_student, grads[0][rows], mode=kernels.JSD, beta=statistic.beta
    )


TRITON_TILES.add(GeneralisedJSD, TileOps(_jsd_tile_forward, _jsd_tile_grad, forward=_jsd_forward))
