"""The exact KL over the whole vocabulary, per position, from logits or from hidden states.

For policy logits z and reference logits z_ref at one position, tempered by τ,
π = softmax(z/τ), ρ = softmax(z_ref/τ):

    KL(π‖ρ) = Σᵥ πᵥ (log πᵥ - log ρᵥ)

and its gradient with respect to the policy logits (the reference is frozen):

    ∂KL/∂zᵥ = (1/τ) · πᵥ · (log πᵥ - log ρᵥ - KL)

The sampled-token estimators of `pgloss.kl.estimators` (k1, k2, k3) estimate this sum from one token;
here it is computed exactly, with no variance. verl's `kl_penalty="full"` raises
NotImplementedError; no other framework computes it.

Memory: both functions walk the positions in chunks and keep only two floats per position
(the two log-normalisers) besides the inputs; the backward pass recomputes each chunk's
softmaxes. `full_kl_from_hidden` never holds the N × V logits of either model: per chunk it
forms [chunk, V] logits of the policy and of the reference from hidden states and LM heads, each
with its bias, logit scale and soft-cap (`head.HeadOptions`), through `chunks.ChunkLoop` with two
sources and the `FullKL` statistic, so memory beyond the inputs and their gradients is two
[chunk, V] buffers (three in backward for a soft-capped policy: its slope). With `mask=` the hidden states at
masked positions are never read (NaN allowed) and the KL there is 0; without it every position counts.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels
from .backends import TRITON_TILES, TileOps
from .entropy import _blocks, online_max
from .head import HeadOptions, as_head, refuses_head_keywords
from .pair import pair_from_hidden, pair_from_logits
from .statistic import Statistic

__all__ = ["full_kl_from_logits", "full_kl_from_hidden"]


def chunk_full_kl(z: Tensor, z_ref: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(KL(π‖ρ), lse(z), lse(z_ref)) per row of tempered logits `z`, `z_ref` [n, V]; both unchanged."""
    n = z.shape[0]
    kl, lse, lse_ref = z.new_empty(n), z.new_empty(n), z.new_empty(n)
    for rows, (log_pi, log_rho) in _blocks(z, 2):
        torch.logsumexp(z[rows], dim=-1, out=lse[rows])
        torch.logsumexp(z_ref[rows], dim=-1, out=lse_ref[rows])
        torch.sub(z[rows], lse[rows].unsqueeze(-1), out=log_pi)
        torch.sub(z_ref[rows], lse_ref[rows].unsqueeze(-1), out=log_rho)
        log_rho.sub_(log_pi).neg_()  # log π - log ρ
        kl[rows] = (log_pi.exp_() * log_rho).sum(dim=-1)
    return kl, lse, lse_ref


def chunk_full_kl_grad(
    z: Tensor, z_ref: Tensor, lse: Tensor, lse_ref: Tensor, kl: Tensor, grad_kl: Tensor, temperature: float
) -> Tensor:
    """∂L/∂logits [n, V] = (g/τ)·π·(log π - log ρ - KL), written into `z` (and `z_ref` used as scratch)."""
    scale = (grad_kl / temperature).unsqueeze(-1)
    for rows, _ in _blocks(z, 0):
        log_pi = z[rows].sub_(lse[rows].unsqueeze(-1))
        diff = z_ref[rows].sub_(lse_ref[rows].unsqueeze(-1)).sub_(log_pi).neg_()  # log π - log ρ
        diff.sub_(kl[rows].unsqueeze(-1))
        log_pi.exp_().mul_(diff).mul_(scale[rows])
    return z


def tile_kl_sums(z: Tensor, z_ref: Tensor, m: Tensor, m_ref: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of a vocabulary tile: Σᵥ e^{zᵥ−m}, Σᵥ e^{z_refᵥ−m_ref} and
    Σᵥ e^{zᵥ−m} ((zᵥ − m) − (z_refᵥ − m_ref)), in cache-sized row blocks."""
    n = z.shape[0]
    s, s_ref, d = z.new_empty(n), z.new_empty(n), z.new_empty(n)
    for rows, (a, b) in _blocks(z, 2):
        torch.sub(z[rows], m[rows].unsqueeze(-1), out=a)
        torch.sub(z_ref[rows], m_ref[rows].unsqueeze(-1), out=b)
        b.sub_(a).neg_()  # (z − m) − (z_ref − m_ref)
        a.exp_()
        s[rows] = a.sum(dim=-1)
        d[rows] = b.mul_(a).sum(dim=-1)
        torch.sub(z_ref[rows], m_ref[rows].unsqueeze(-1), out=b)
        s_ref[rows] = b.exp_().sum(dim=-1)
    return s, s_ref, d


class FullKL(Statistic):
    """Statistic of `chunks.ChunkLoop`: KL(π‖ρ) per token between its two sources, saving both lse.

    Per tile of the vocabulary, with running maxima m, m_ref (online max), each row keeps
    s = Σᵥ e^{zᵥ−m}, s_ref = Σᵥ e^{z_refᵥ−m_ref} and D = Σᵥ e^{zᵥ−m} ((zᵥ − m) − (z_refᵥ − m_ref)); new maxima
    m', m_ref' rescale them (D ← e^{m−m'} (D + s ((m − m') + (m_ref' − m_ref)))). At the end

        KL = D / s − log s + log s_ref,   lse = m + log s,   lse_ref = m_ref + log s_ref."""

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(3)]  # KL, lse, lse_ref

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        kl, lse, lse_ref = values
        kl[rows], lse[rows], lse_ref[rows] = chunk_full_kl(*zs)

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        z, z_ref = zs
        if state is None:
            m, m_ref = z.amax(dim=-1), z_ref.amax(dim=-1)
            return (m, m_ref, *tile_kl_sums(z, z_ref, m, m_ref))
        m, m_ref, s, s_ref, d = state
        new, scale = online_max(m, z)
        new_ref, scale_ref = online_max(m_ref, z_ref)
        s_tile, s_ref_tile, d_tile = tile_kl_sums(z, z_ref, new, new_ref)
        d = scale * (d + s * ((m - new) + (new_ref - m_ref))) + d_tile
        return new, new_ref, scale * s + s_tile, scale_ref * s_ref + s_ref_tile, d

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        kl, lse, lse_ref = values
        m, m_ref, s, s_ref, d = state
        log_s, log_s_ref = torch.log(s), torch.log(s_ref)
        kl[rows] = d / s - log_s + log_s_ref
        lse[rows] = m + log_s
        lse_ref[rows] = m_ref + log_s_ref

    def outputs(self, values: list[Tensor]) -> Tensor | tuple[Tensor, ...]:
        return values[0]

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads, temperature: float) -> Tensor:
        kl, lse, lse_ref = values
        z, z_ref = zs
        return chunk_full_kl_grad(z, z_ref, lse[rows], lse_ref[rows], kl[rows], grads[0][rows], temperature)

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        return self.grad(zs, rows, values, grads, temperature)  # elementwise given lse, lse_ref and KL


# Its Triton kernels (`backends.TRITON_TILES`): the same running state (m, m_ref, s, s_ref, D) and values, each tile
# of the two heads' raw outputs (`kernels.RawTile`) one launch forward and one backward.


def kernel_tile_forward(statistic: FullKL, zs: list, rows: slice, cols: slice, state):
    state = kernels.start_state(zs[0], maxima=2, sums=3) if state is None else state
    tile, other = zs
    kernels.pair_forward(tile, other, state)
    return state


def _kernel_tile_grad(
    statistic: FullKL, zs: list, rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
) -> Tensor:
    kl, lse, lse_other = (v[rows] for v in values)
    tile, other = zs
    return kernels.pair_backward(tile, other, lse, lse_other, kl, grads[0][rows], mode=kernels.REVERSE_KL)


KERNEL_OPS = TileOps(kernel_tile_forward, _kernel_tile_grad)
TRITON_TILES.add(FullKL, KERNEL_OPS)


def full_kl_from_logits(
    logits: Tensor,
    ref_logits: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> Tensor:
    """KL(π‖π_ref) = Σᵥ πᵥ (log πᵥ - log π_ref,ᵥ) at every position, chunked; gradient to `logits` only.

    Args:
        logits: [..., V] policy logits (any float dtype; the math runs in float32, float64 stays).
        ref_logits: [..., V] reference logits of the same shape (never differentiated).
        temperature: τ > 0, dividing both logits.
        chunk_size: positions per chunk; None picks about 2²⁷ / V.
        vocab_block: vocabulary columns per tile (None: the whole vocabulary); below V the KL and
            both log-normalisers accumulate over tiles with online maxima.
        memory_budget: bytes for the loop's buffers, exclusive with chunk_size and vocab_block.

    Returns:
        [...] the exact KL per position, float32 (float64 for float64 logits).
    """
    return pair_from_logits(
        FullKL(),
        logits,
        ref_logits,
        "ref",
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        memory_budget=memory_budget,
    )


@refuses_head_keywords("", "ref_")
def full_kl_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    ref_hidden: Tensor,
    ref_weight: Tensor,
    *,
    temperature: float = 1.0,
    head: HeadOptions | None = None,
    ref_head: HeadOptions | None = None,
    mask: Tensor | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> Tensor:
    """KL(π‖π_ref) per position from the final hidden states and LM heads of both models, [B, T].

    Each model's logits before the temperature are those of its head (`head.HeadOptions`),

        logits = c · tanh(s · (x Wᵀ + b) / c)        (s · (x Wᵀ + b) without a soft-cap c)

    and π = softmax(logits / τ), π_ref = softmax(logits_ref / τ); the logits of either model are never
    materialised beyond one [chunk, V] buffer each. Gradients flow to `hidden`, `weight` and `bias`
    (whichever requires grad), through the soft-cap's slope s (1 − tanh²); the reference gets none.

    Args:
        hidden: [B, T, H] policy hidden states.
        weight: [V, H] policy output projection, same dtype and device.
        ref_hidden: [B, T, H'] reference hidden states (H' may differ from H).
        ref_weight: [V, H'] reference output projection, the dtype of `ref_hidden`.
        temperature: τ > 0.
        head: the policy head's bias b, logit scale s and soft-cap c, a `pgloss.HeadOptions` (None: the plain
            head); its bias has the dtype and device of `weight`.
        ref_head: the reference head's options, as `head`; its bias has the dtype and device of `ref_weight`.
        mask: [B, T] bool or 0/1, the positions that count (None: all). Elsewhere neither model's hidden states
            are read (NaN and inf allowed: `chunks.HeadRows`), and the KL is 0 with no gradient.
        chunk_size: positions per chunk; None picks about 2²⁷ / V.
        vocab_block: vocabulary columns per tile (None: the whole vocabulary).
        memory_budget: bytes for the loop's buffers, exclusive with chunk_size and vocab_block (a
            soft-capped policy adds one buffer, its slope).
    """
    return pair_from_hidden(
        FullKL(),
        hidden,
        weight,
        ref_hidden,
        ref_weight,
        "ref",
        head=as_head(head),
        other_head=as_head(ref_head, prefix="ref_"),
        temperature=temperature,
        mask=mask,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        memory_budget=memory_budget,
    )
