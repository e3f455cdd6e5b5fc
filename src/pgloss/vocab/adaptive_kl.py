"""The adaptive KL divergence (AKL) of Wu et al. over the whole vocabulary, per position, a computation of the one
chunk loop (`chunks.ChunkLoop`) over whole-vocabulary rows.

With the student's and the teacher's tempered distributions p_S = softmax(z_S), p_T = softmax(z_T), the teacher's
*head* at one position is the set of its most likely tokens whose cumulative mass first reaches μ, the *tail* the
rest; with the gaps g_head = Σ_{v ∈ head} |p_T,ᵥ − p_S,ᵥ| and g_tail = Σ_{v ∈ tail} |p_T,ᵥ − p_S,ᵥ|,

    AKL = g_head / (g_head + g_tail) · KL(p_T‖p_S) + g_tail / (g_head + g_tail) · KL(p_S‖p_T)

with the two weights taken as constants (no gradient flows through the gaps):

    ∂AKL/∂z_S,ᵥ = w_head (p_S,ᵥ − p_T,ᵥ) + w_tail p_S,ᵥ (log p_S,ᵥ − log p_T,ᵥ − KL(p_S‖p_T)).

The head, exactly: the tokens sorted by the teacher's tempered logit, descending, a token is in the head when the
teacher's mass of the tokens strictly before it is below μ; the first token always is. Ties: the head is
{v : z_T,ᵥ ≥ z*}, z* the teacher logit of the last head token in that order, so tokens tied with it are all in the
head, whatever order a sort gives them. Where the two distributions are equal (g_head + g_tail = 0) both weights
are 0 and AKL = 0 (both KLs are 0 there; ROLL's division gives NaN). A token the student bans (`banned.py`) leaves
out the teacher's p_T in the forward KL's gradient, as `divergence.ForwardKL`.

Source: Wu et al., "Rethinking Kullback-Leibler Divergence in Knowledge Distillation for Large Language Models",
arXiv 2404.02657, Section 4 (AKL, μ = 0.5). ROLL (alibaba/ROLL, commit 8eb27cc2d) computes it in
roll/pipeline/distill/various_divergence.py, `VariousDivergence.compute_adaptive_kl_divergence`, with its
`adaptive_kl_alpha` α (default 0.5): teacher probabilities sorted ascending, the tail those whose ascending
cumulative mass is ≤ α, the gaps detached. The ascending cumulative mass of a token is 1 minus the mass strictly
before it in descending order, so ROLL's tail is the tail here with μ = 1 − α (the same at the default 0.5),
up to float32 rounding of the sums at the boundary and to the order a sort gives ties.

Memory and tiles: the head needs the teacher's cumulative mass in sorted order, so `AdaptiveKL` is not a
`statistic.Statistic`: the loop runs it over whole-vocabulary rows (`plan.plan` takes whole rows for it, and a
`vocab_block` below V is refused), never over vocabulary tiles. Beyond one [chunk, V] buffer per model, each
cache block of rows (about 2²² values, `entropy._blocks`) sorts the teacher's logits: its sorted values, their
int64 indices and a few float temporaries of that block's size. Backward is elementwise given the saved
(lse_S, lse_T, KL(p_S‖p_T), w_head, w_tail). The Triton backends do not hold it: the automatic choice takes torch,
and `use("kernel")` refuses it by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .banned import BANNED_LOGIT
from .entropy import _blocks

__all__ = ["AdaptiveKL", "head_mask"]


def head_mask(z_teacher: Tensor, p_teacher: Tensor, mu: float) -> Tensor:
    """The teacher's head (module docstring), a bool mask of the rows of tempered teacher logits `z_teacher` [n, V]
    with their probabilities `p_teacher`."""
    ordered, order = z_teacher.sort(dim=-1, descending=True)
    mass = p_teacher.gather(-1, order)
    before = torch.zeros_like(mass)
    before[:, 1:] = mass[:, :-1].cumsum(dim=-1)  # the teacher's mass strictly before each token
    last = (before < mu).sum(dim=-1, keepdim=True) - 1  # >= 0: the first token's is 0 < μ
    return z_teacher >= ordered.gather(-1, last)


class AdaptiveKL:
    """The loop's computation of AKL with head mass `mu` per token over whole-vocabulary rows (module docstring),
    the student the first source; its values: AKL, lse_S, lse_T, KL(p_S‖p_T), w_head, w_tail."""

    def __init__(self, mu: float) -> None:
        self.mu = mu

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(6)]

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        z, z_teacher = zs
        akl, lse, lse_teacher, reverse, w_head, w_tail = (v[rows] for v in values)
        for block, (log_p, log_q) in _blocks(z, 2):
            torch.logsumexp(z[block], dim=-1, out=lse[block])
            torch.logsumexp(z_teacher[block], dim=-1, out=lse_teacher[block])
            torch.sub(z[block], lse[block].unsqueeze(-1), out=log_p)
            torch.sub(z_teacher[block], lse_teacher[block].unsqueeze(-1), out=log_q)
            p, q = log_p.exp(), log_q.exp()
            head = head_mask(z_teacher[block], q, self.mu)
            gap = (q - p).abs_()
            g_head = torch.where(head, gap, 0.0).sum(dim=-1)
            g_total = gap.sum(dim=-1)
            some = g_total > 0
            w_head[block] = torch.where(some, g_head / torch.where(some, g_total, 1.0), 0.0)
            w_tail[block] = torch.where(some, (g_total - g_head) / torch.where(some, g_total, 1.0), 0.0)
            log_p.sub_(log_q)  # log p_S − log p_T
            reverse[block] = (p * log_p).sum(dim=-1)
            forward = (q * log_p).sum(dim=-1).neg_()
            akl[block] = w_head[block] * forward + w_tail[block] * reverse[block]

    def outputs(self, values: list[Tensor]) -> Tensor:
        return values[0]

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads, temperature: float) -> Tensor:
        """(G/τ) (w_head (p_S − p_T) + w_tail p_S (log p_S − log p_T − KL(p_S‖p_T))), written into the student's
        `z` (the teacher's rows are scratch)."""
        z, z_teacher = zs
        _, lse, lse_teacher, reverse, w_head, w_tail = (v[rows] for v in values)
        scale = (grads[0][rows] / temperature).unsqueeze(-1)
        for block, (q,) in _blocks(z, 1):
            banned = z[block] <= BANNED_LOGIT
            log_p = z[block].sub_(lse[block].unsqueeze(-1))
            log_q = z_teacher[block].sub_(lse_teacher[block].unsqueeze(-1))
            torch.exp(log_q, out=q).masked_fill_(banned, 0.0)
            diff = log_q.sub_(log_p).neg_().sub_(reverse[block].unsqueeze(-1))  # log p_S − log p_T − KL(p_S‖p_T)
            p = log_p.exp_()
            diff.mul_(p).mul_(w_tail[block].unsqueeze(-1))
            p.sub_(q).mul_(w_head[block].unsqueeze(-1)).add_(diff).mul_(scale[block])
        return z
