"""The skewed KL divergences of DistiLLM over the whole vocabulary, per position, as statistics of the one chunk loop
(`chunks.ChunkLoop`), and the base of the statistics that need both log-normalisers before their sums (`TwoPass`).

With the student's and the teacher's tempered distributions p_S = softmax(z_S), p_T = softmax(z_T) and the skew
λ ∈ (0, 1):

    skewed forward KL    SKL(λ)  = KL(p_T‖m),  m = λ p_T + (1 − λ) p_S  = Σᵥ p_T,ᵥ (log p_T,ᵥ − log mᵥ)
    skewed reverse KL    SRKL(λ) = KL(p_S‖m),  m = λ p_S + (1 − λ) p_T  = Σᵥ p_S,ᵥ (log p_S,ᵥ − log mᵥ)

so λ weights the first argument's side of the mixture: λ → 0 gives the plain forward / reverse KL, λ = 1 gives 0;
the mixture keeps log m finite where the second distribution has no mass, which the plain KL would make infinite.
With w the weight of p_S in m (1 − λ forward, λ reverse), the gradient with respect to the student's tempered logits
(the teacher frozen) is ∂D/∂z_S,ᵥ = p_S,ᵥ (gᵥ − c), c = Σᵤ p_S,ᵤ gᵤ, with ∂D/∂p_S,ᵥ up to a constant

    forward   gᵥ = −w p_T,ᵥ / mᵥ
    reverse   gᵥ = log p_S,ᵥ − log mᵥ − w p_S,ᵥ / mᵥ

Source: Ko et al., "DistiLLM: Towards Streamlined Distillation for Large Language Models", arXiv 2402.03898, Eq. (3)
and (4): SKL(α)(p, q_θ) = KL(p‖αp + (1 − α)q_θ), SRKL(α)(p, q_θ) = KL(q_θ‖(1 − α)p + αq_θ), p the teacher, α = 0.1
in its experiments. ROLL (alibaba/ROLL, commit 8eb27cc2d) computes the same in
roll/pipeline/distill/various_divergence.py, `VariousDivergence.compute_skewed_forward_kl_divergence` and
`compute_skewed_reverse_kl_divergence` (`skew_lambda`, default 0.1; no epsilon, no clamp), on materialised
float32 probabilities; its terms at tokens whose student logit is ±inf or whose teacher logit is masked are dropped,
where here a banned token (`banned.py`) has π = 0 and its term is what the formula gives (0 where p_T or p_S is 0 as
the first argument's; p log(1/λ) where the other model bans it).

`SkewedKL` needs both log-normalisers before any term of log m (as JSD(β)): whole-vocabulary chunks compute them
and the sums in one pass; over vocabulary tiles a first run of the loop gives them without gradient (`TwoPass`),
then each tile adds its terms of D and c. Backward is elementwise given lse_S, lse_T and c. The Triton backends do
not hold it: the automatic choice takes torch, and `use("kernel")` refuses it by name.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .entropy import _blocks
from .statistic import Statistic

__all__ = ["SkewedKL", "TwoPass"]


class TwoPass(Statistic):
    """A statistic whose sums need both log-normalisers first: over vocabulary tiles, `normalisers` (lse_S, lse_T of
    every token, from a first run of the loop with `divergence.Normalisers`, without gradient) must be given."""

    def __init__(self, normalisers: tuple[Tensor, Tensor] | None = None) -> None:
        self.normalisers = normalisers

    def given_normalisers(self, rows: slice) -> tuple[Tensor, Tensor]:
        """The first pass's (lse_S, lse_T) of `rows`: over vocabulary tiles they must be given."""
        if self.normalisers is None:
            raise RuntimeError(f"{type(self).__name__} over vocabulary tiles needs the log-normalisers of a first pass")
        lse, lse_teacher = self.normalisers
        return lse[rows], lse_teacher[rows]


class SkewedKL(TwoPass):
    """Statistic of `chunks.ChunkLoop`: the skewed forward (`forward`) or reverse KL with skew λ per token (module
    docstring), the student the first source; its values: D, lse_S, lse_T and c = Σᵥ p_S,ᵥ gᵥ (the gradient's
    shift)."""

    def __init__(self, forward: bool, skew: float, normalisers: tuple[Tensor, Tensor] | None = None) -> None:
        super().__init__(normalisers)
        self.forward_kl, self.skew = forward, skew
        self.student_weight = 1.0 - skew if forward else skew  # w, the weight of p_S in m

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(4)]  # D, lse_S, lse_T, c

    def _terms(self, z: Tensor, z_teacher: Tensor, lse: Tensor, lse_teacher: Tensor, work: list[Tensor]):
        """(p_S, D's terms, g) of rows of tempered logits given both lse, in the three buffers `work`."""
        log_p, log_q, log_m = work
        w = self.student_weight
        torch.sub(z, lse.unsqueeze(-1), out=log_p)
        torch.sub(z_teacher, lse_teacher.unsqueeze(-1), out=log_q)
        torch.logaddexp(log_p + math.log(w), log_q + math.log1p(-w), out=log_m)
        if self.forward_kl:
            p_teacher = log_q.exp()
            ratio = log_q.sub_(log_m)  # log p_T − log m
            terms = p_teacher.mul_(ratio)  # p_T (log p_T − log m)
            g = ratio.exp_().mul_(-w)  # −w p_T / m
            return log_p.exp_(), terms, g
        ratio = log_m.sub_(log_p).neg_()  # log p_S − log m
        p = log_p.exp_()
        terms = torch.mul(p, ratio, out=log_q)
        g = ratio.sub_(ratio.exp().mul_(w))  # log p_S − log m − w p_S / m
        return p, terms, g

    def sums(self, z: Tensor, z_teacher: Tensor, lse: Tensor, lse_teacher: Tensor) -> tuple[Tensor, Tensor]:
        """(D, c) per row of tempered logits (a whole row or a vocabulary tile) given both lse; inputs unchanged."""
        n = z.shape[0]
        d, c = z.new_empty(n), z.new_empty(n)
        for rows, work in _blocks(z, 3):
            p, terms, g = self._terms(z[rows], z_teacher[rows], lse[rows], lse_teacher[rows], work)
            d[rows] = terms.sum(dim=-1)
            c[rows] = g.mul_(p).sum(dim=-1)
        return d, c

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        z, z_teacher = zs
        lse, lse_teacher = torch.logsumexp(z, dim=-1), torch.logsumexp(z_teacher, dim=-1)
        self._store(rows, values, lse, lse_teacher, self.sums(z, z_teacher, lse, lse_teacher))

    def _store(self, rows: slice, values: list[Tensor], lse: Tensor, lse_teacher: Tensor, sums) -> None:
        d, lse_out, lse_teacher_out, c = values
        d[rows], c[rows] = sums
        lse_out[rows], lse_teacher_out[rows] = lse, lse_teacher

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        lse, lse_teacher = self.given_normalisers(rows)
        sums = self.sums(zs[0], zs[1], lse, lse_teacher)
        return sums if state is None else (state[0] + sums[0], state[1] + sums[1])

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        self._store(rows, values, *self.given_normalisers(rows), state)

    def outputs(self, values: list[Tensor]) -> Tensor:
        return values[0]

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        """(G/τ) p_S (g − c), written into the student's `z` (elementwise given lse_S, lse_T and c)."""
        z, z_teacher = zs
        _, lse, lse_teacher, c = (v[rows] for v in values)
        scale = (grads[0][rows] / temperature).unsqueeze(-1)
        for block, work in _blocks(z, 3):
            p, _, g = self._terms(z[block], z_teacher[block], lse[block], lse_teacher[block], work)
            z[block] = g.sub_(c[block].unsqueeze(-1)).mul_(p).mul_(scale[block])
        return z
