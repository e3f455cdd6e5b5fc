"""The adaptive KL divergence (AKL) of Wu et al. over the whole vocabulary, per position, as a statistic of the one
chunk loop (`chunks.ChunkLoop`), with the exact search for the teacher's head over vocabulary tiles.

With the student's and the teacher's tempered distributions p_S = softmax(z_S), p_T = softmax(z_T), the teacher's
*head* at one position is the set of its most likely tokens whose cumulative mass first reaches μ, the *tail* the
rest; with the gaps g_head = Σ_{v ∈ head} |p_T,ᵥ − p_S,ᵥ| and g_tail = Σ_{v ∈ tail} |p_T,ᵥ − p_S,ᵥ|,

    AKL = g_head / (g_head + g_tail) · KL(p_T‖p_S) + g_tail / (g_head + g_tail) · KL(p_S‖p_T)

with the two weights taken as constants (no gradient flows through the gaps):

    ∂AKL/∂z_S,ᵥ = w_head (p_S,ᵥ − p_T,ᵥ) + w_tail p_S,ᵥ (log p_S,ᵥ − log p_T,ᵥ − KL(p_S‖p_T)).

The head, exactly: with G(t) = Σ_{u: z_T,ᵤ ≥ t} p_T,ᵤ the teacher's mass at or above the logit t, the head is
{v : z_T,ᵥ ≥ z*}, z* the largest teacher logit with G(z*) ≥ μ (every token when no G reaches μ, which only rounding
of a total mass of 1 can give). It is the shortest prefix of the tokens sorted by the teacher's logit whose mass
reaches μ, with one rule for ties: tokens tied with the last head token all join the head, whatever order a sort
gives them. Where the two distributions are equal (g_head + g_tail = 0) both weights are 0 and AKL = 0 (both KLs are
0 there; ROLL's division gives NaN). A token the student bans (`banned.py`) leaves out the teacher's p_T in the
forward KL's gradient, as `divergence.ForwardKL`.

Source: Wu et al., "Rethinking Kullback-Leibler Divergence in Knowledge Distillation for Large Language Models",
arXiv 2404.02657, Section 4 (AKL, μ = 0.5). ROLL (alibaba/ROLL, commit 8eb27cc2d) computes it in
roll/pipeline/distill/various_divergence.py, `VariousDivergence.compute_adaptive_kl_divergence`, with its
`adaptive_kl_alpha` α (default 0.5): teacher probabilities sorted ascending, the tail those whose ascending
cumulative mass is ≤ α, the gaps detached. A token's ascending cumulative mass is 1 minus the mass strictly before
it in descending order, so ROLL's tail is the tail here with μ = 1 − α (the same at the default 0.5), up to the
rounding of its float32 sums at the boundary and to the order its sort gives ties.

Finding z* (`search`): a radix select on the bits of the teacher's tempered logits, each mapped to an integer key of
the same order (`order_key`), 8 bits a level from the top: a level sums the teacher's mass of the tokens in each of
the 256 buckets of the next 8 bits below the prefix found so far (and the mass above that prefix), and keeps the
highest bucket whose mass at or above it reaches μ. 4 levels give the exact key of a float32 logit, 8 of a float64
one; the search reads the very logits the sums read, so z* is one of them and the head is exact, up to the rounding
of the mass sums compared with μ (a token whose mass before it lies within rounding of μ may fall either side). Over
whole-vocabulary rows the levels run on the rows in memory; over vocabulary tiles each level is one more run of the
loop over the teacher alone (without gradient; with the student too when the two compute dtypes differ), after the
run for both log-normalisers: from hidden states, 4 (8 in float64) more teacher matmul passes than JSD(β), each
holding one [chunk, vocab_block] tile and [chunk, 256] bucket sums, never N x V. Backward is elementwise given the
saved (lse_S, lse_T, KL(p_S‖p_T), w_head, w_tail), one pass as the other divergences. The Triton backends do not
hold it: the automatic choice takes torch, and `use("kernel")` refuses it by name.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from .banned import BANNED_LOGIT
from .entropy import _blocks
from .skewed import TwoPass
from .statistic import Statistic

__all__ = ["AdaptiveKL", "HeadSearch", "levels", "order_key", "logit_of_key"]

DIGIT = 8  # bits a level of the search
_FLIP = {torch.float64: 0x7FFFFFFFFFFFFFFF, torch.float32: 0x7FFFFFFF}
_INT = {torch.float64: torch.int64, torch.float32: torch.int32}


def order_key(z: Tensor) -> Tensor:
    """int64 keys of the float32 or float64 values `z`, in their order (−0 and +0 one key): the bits, the magnitude's
    flipped for negative values."""
    bits = (z + 0.0).view(_INT[z.dtype]).long()  # z + 0.0: −0 becomes +0
    return torch.where(bits < 0, bits ^ _FLIP[z.dtype], bits)


def logit_of_key(key: Tensor, dtype: torch.dtype) -> Tensor:
    """The values of `dtype` whose `order_key` is `key`."""
    return torch.where(key < 0, key ^ _FLIP[dtype], key).to(_INT[dtype]).view(dtype)


def levels(dtype: torch.dtype) -> list[int]:
    """The shifts of the search's levels for logits of `dtype`, from the top: [24, 16, 8, 0] for float32."""
    bits = torch.finfo(dtype).bits
    return list(range(bits - DIGIT, -1, -DIGIT))


def level_sums(z: Tensor, lse: Tensor, prefix: Tensor | None, shift: int) -> tuple[Tensor, Tensor, Tensor]:
    """Over rows of the teacher's tempered logits `z` (a whole row or a tile) with their log-normaliser `lse`: the
    mass and the count of tokens in each bucket of the next 8 bits below `prefix` (the keys' bits above `shift` + 8
    found so far; None at the top level), [n, 256], and the mass above the prefix, [n]."""
    n = z.shape[0]
    mass = z.new_zeros(n, 1 << DIGIT)
    count = z.new_zeros(n, 1 << DIGIT)
    above = z.new_zeros(n)
    for rows, _ in _blocks(z, 0):
        key = order_key(z[rows])
        p = torch.exp(z[rows] - lse[rows].unsqueeze(-1))
        if prefix is None:  # the top level: every token, its digit the key's top bits made non-negative
            digit, inside = (key >> shift) + (1 << (DIGIT - 1)), torch.ones_like(key, dtype=torch.bool)
        else:
            high = key >> (shift + DIGIT)
            digit, inside = (key >> shift) & ((1 << DIGIT) - 1), high == prefix[rows].unsqueeze(-1)
            above[rows] = torch.where(high > prefix[rows].unsqueeze(-1), p, 0.0).sum(dim=-1)
        mass[rows].scatter_add_(-1, digit, torch.where(inside, p, 0.0))
        count[rows].scatter_add_(-1, digit, inside.to(z.dtype))
    return mass, count, above


def next_prefix(sums: tuple[Tensor, Tensor, Tensor], prefix: Tensor | None, mu: float) -> Tensor:
    """The prefix one level down: the highest bucket whose mass at or above it (the buckets above it and the mass
    above the prefix included) reaches μ; where none does (rounding only), the lowest non-empty bucket."""
    mass, count, above = sums
    at_or_above = mass.flip(-1).cumsum(dim=-1).flip(-1) + above.unsqueeze(-1)
    chosen = (at_or_above >= mu).sum(dim=-1) - 1  # the set is a prefix of the buckets: its last one
    lowest = (count > 0).to(torch.int64).argmax(dim=-1)
    chosen = torch.where(chosen >= 0, chosen, lowest)
    if prefix is None:
        return chosen - (1 << (DIGIT - 1))
    return prefix * (1 << DIGIT) + chosen


def threshold(z: Tensor, lse: Tensor, mu: float) -> Tensor:
    """z* per row of whole-vocabulary teacher logits `z` in memory: every level of the search on them."""
    prefix: Tensor | None = None
    for shift in levels(z.dtype):
        prefix = next_prefix(level_sums(z, lse, prefix, shift), prefix, mu)
    return logit_of_key(cast(Tensor, prefix), z.dtype)


class HeadSearch(Statistic):
    """Statistic of `chunks.ChunkLoop`, run without gradient: one level of the search (module docstring) over the
    tiles of the teacher, its last source, given the teacher's `lse` [N] and the `prefix` [N] of the level above
    (None at the top); its output is the prefix one level down."""

    def __init__(self, lse: Tensor, mu: float, shift: int, prefix: Tensor | None) -> None:
        self.lse, self.mu, self.shift, self.prefix = lse, mu, shift, prefix

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=torch.int64, device=device)]

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        sums = level_sums(zs[-1], self.lse[rows], None if self.prefix is None else self.prefix[rows], self.shift)
        return sums if state is None else tuple(a + b for a, b in zip(state, sums, strict=True))

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        values[0][rows] = next_prefix(state, None if self.prefix is None else self.prefix[rows], self.mu)

    def outputs(self, values: list[Tensor]) -> Tensor:
        return values[0]


class AdaptiveKL(TwoPass):
    """Statistic of `chunks.ChunkLoop`: AKL with head mass `mu` per token (module docstring), the student the first
    source; its values: AKL, lse_S, lse_T, KL(p_S‖p_T), w_head, w_tail. Over vocabulary tiles both log-normalisers
    (`TwoPass`) and the teacher's `threshold` z* per token (`search`) must be given."""

    def __init__(
        self, mu: float, normalisers: tuple[Tensor, Tensor] | None = None, threshold: Tensor | None = None
    ) -> None:
        super().__init__(normalisers)
        self.mu, self.threshold = mu, threshold

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(6)]

    @staticmethod
    def sums(z: Tensor, z_teacher: Tensor, lse: Tensor, lse_teacher: Tensor, cut: Tensor) -> tuple[Tensor, ...]:
        """Per row (a whole row or a tile) given both lse and z*: KL(p_T‖p_S), KL(p_S‖p_T), g_head and the total gap."""
        n = z.shape[0]
        out = tuple(z.new_empty(n) for _ in range(4))
        for rows, (log_p, log_q) in _blocks(z, 2):
            torch.sub(z[rows], lse[rows].unsqueeze(-1), out=log_p)
            torch.sub(z_teacher[rows], lse_teacher[rows].unsqueeze(-1), out=log_q)
            p, q = log_p.exp(), log_q.exp()
            gap = (q - p).abs_()
            out[2][rows] = torch.where(z_teacher[rows] >= cut[rows].unsqueeze(-1), gap, 0.0).sum(dim=-1)
            out[3][rows] = gap.sum(dim=-1)
            log_p.sub_(log_q)  # log p_S − log p_T
            out[0][rows] = (q * log_p).sum(dim=-1).neg_()
            out[1][rows] = (p * log_p).sum(dim=-1)
        return out

    def _store(self, rows: slice, values: list[Tensor], lse: Tensor, lse_teacher: Tensor, sums) -> None:
        akl, lse_out, lse_teacher_out, reverse, w_head, w_tail = values
        forward_kl, reverse_kl, g_head, g_total = sums
        some = g_total > 0
        total = torch.where(some, g_total, 1.0)
        w_head[rows] = torch.where(some, g_head / total, 0.0)
        w_tail[rows] = torch.where(some, (g_total - g_head) / total, 0.0)
        akl[rows] = w_head[rows] * forward_kl + w_tail[rows] * reverse_kl
        reverse[rows], lse_out[rows], lse_teacher_out[rows] = reverse_kl, lse, lse_teacher

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        z, z_teacher = zs
        lse, lse_teacher = torch.logsumexp(z, dim=-1), torch.logsumexp(z_teacher, dim=-1)
        cut = threshold(z_teacher, lse_teacher, self.mu)
        self._store(rows, values, lse, lse_teacher, self.sums(z, z_teacher, lse, lse_teacher, cut))

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        if self.threshold is None:
            raise RuntimeError("AdaptiveKL over vocabulary tiles needs the teacher's head threshold of a search")
        lse, lse_teacher = self.given_normalisers(rows)
        sums = self.sums(zs[0], zs[1], lse, lse_teacher, self.threshold[rows])
        return sums if state is None else tuple(a + b for a, b in zip(state, sums, strict=True))

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        self._store(rows, values, *self.given_normalisers(rows), state)

    def outputs(self, values: list[Tensor]) -> Tensor:
        return values[0]

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        """(G/τ) (w_head (p_S − p_T) + w_tail p_S (log p_S − log p_T − KL(p_S‖p_T))), written into the student's
        `z` (the teacher's tile is scratch; elementwise given the values)."""
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
