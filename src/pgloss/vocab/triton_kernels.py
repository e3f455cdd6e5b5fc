"""The Triton kernels of the vocabulary loop: one pass over a tile of raw head outputs per launch.

A tile is r = x W[cols]ᵀ as the matmul wrote it (bfloat16, float16 or float32), [rows, width] with row
stride `stride`. Each kernel applies the head itself, in `chunks.HeadKind`'s order,

    z = c · tanh(s · (r + b) / c) / τ        (s · (r + b) / τ without a soft-cap c)

in float32 registers, one program per row walking the tile in blocks of BLOCK columns, so that the
[rows, width] logits are read once and never written in float32. The forward kernels update a per-row
running state (online max, as in Milakov & Gimelshein 2018, https://arxiv.org/abs/1805.02867) in place;
the backward kernels write ∂L/∂r, the head's slope s (1 − tanh²) included, over the tile they read (the
buffer the two gradient matmuls then take). Each kernel is the twin of a torch statistic (entropy.py,
full_kl.py, divergence.py), which is its reference in the tests.

Only imported on the kernel route (`kernels.py`): importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _head(r, b, scale, softcap, inv_t, SOFTCAP: tl.constexpr):
    """(z, ∂z/∂r · τ) of raw outputs `r` with their bias `b` (0 without one): the logits before τ's
    division is folded in, and the slope the gradient needs. tanh(u) = 1 − 2 / (e^{2u} + 1) (exact at ±∞)."""
    u = r + b
    if SOFTCAP:  # one return: Triton's compiler types every return of a function, a static branch's too
        t = 1.0 - 2.0 / (tl.exp(2.0 * (u * (scale / softcap))) + 1.0)
        z, slope = softcap * t * inv_t, scale * (1.0 - t * t)
    else:
        z, slope = u * (scale * inv_t), scale
    return z, slope


@triton.jit
def _tile_logits(R, B, cols, inside, scale, softcap, inv_t, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    r = tl.load(R + cols, mask=inside, other=0.0).to(tl.float32)
    b = 0.0
    if HAS_BIAS:
        b = tl.load(B + cols, mask=inside, other=0.0).to(tl.float32)
    return _head(r, b, scale, softcap, inv_t, SOFTCAP)


@triton.jit
def _pair_logits(R, B, scale, softcap, R2, B2, scale2, softcap2, cols, inside, inv_t, HAS_BIAS: tl.constexpr,
                 SOFTCAP: tl.constexpr, HAS_BIAS2: tl.constexpr, SOFTCAP2: tl.constexpr):
    """Both heads' tempered logits on the block `cols` of their tiles, and the first head's slope."""
    z, slope = _tile_logits(R, B, cols, inside, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
    z2, _ = _tile_logits(R2, B2, cols, inside, scale2, softcap2, inv_t, HAS_BIAS2, SOFTCAP2)
    return z, slope, z2


@triton.jit
def _online(m, s, z, inside):
    """The running max m' after the block `z`, the step m − m' ≤ 0 (0 before the first block, whose sum s
    is 0), the factor e^{m − m'} rescaling the sums, and the block's z − m' and e^{z − m'} (0 outside)."""
    new = tl.maximum(m, tl.max(tl.where(inside, z, -float("inf")), 0))
    step = tl.where(s > 0, m, new) - new
    d = tl.where(inside, z - new, 0.0)
    e = tl.where(inside, tl.exp(d), 0.0)
    return new, step, tl.exp(step), d, e


@triton.jit
def log_prob_entropy_forward(R, stride, B, TARGETS, M, S, A, ZY, width, col0, scale, softcap, inv_t,
                             HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """`entropy.LogProbEntropy.tile_forward`: per row, m (max), s = Σ e^{z−m}, a = Σ e^{z−m} (z − m) and the
    target's logit z_y (kept from an earlier tile when the target is outside this one)."""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    m, s, a = tl.load(M + row), tl.load(S + row), tl.load(A + row)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, _ = _tile_logits(R, B, cols, inside, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
        new, step, alpha, d, e = _online(m, s, z, inside)
        a = alpha * (a + step * s) + tl.sum(e * d, 0)
        s = alpha * s + tl.sum(e, 0)
        m = new
    y = tl.load(TARGETS + row) - col0
    hit = (y >= 0) & (y < width)
    y = tl.minimum(tl.maximum(y, 0), width - 1)
    z_y, _ = _tile_logits(R, B, y, y >= 0, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
    tl.store(ZY + row, tl.where(hit, z_y, tl.load(ZY + row)))
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(A + row, a)


@triton.jit
def log_prob_entropy_backward(R, stride, B, TARGETS, LSE, ENT, GLP, GENT, width, col0, scale, softcap, inv_t,
                              HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_GLP: tl.constexpr,
                              HAS_GENT: tl.constexpr, BLOCK: tl.constexpr):
    """`entropy.chunk_grad_logits` times the head's slope, over R: ∂L/∂r =
    slope · (1/τ) [g_lp (1[v = y] − π) − g_H π (log π + H)]."""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    lse, ent = tl.load(LSE + row), tl.load(ENT + row)
    g_lp, g_h = 0.0, 0.0
    if HAS_GLP:
        g_lp = tl.load(GLP + row) * inv_t
    if HAS_GENT:
        g_h = tl.load(GENT + row) * inv_t
    y = tl.load(TARGETS + row) - col0
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, slope = _tile_logits(R, B, cols, inside, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
        log_p = z - lse
        p = tl.exp(log_p)
        g = tl.where(cols == y, g_lp, 0.0) - g_lp * p - g_h * p * (log_p + ent)
        tl.store(R + cols, (g * slope).to(R.dtype.element_ty), mask=inside)


@triton.jit
def pair_forward(R, stride, B, scale, softcap, R2, stride2, B2, scale2, softcap2, M, M2, S, S2, D, width, inv_t,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS2: tl.constexpr, SOFTCAP2: tl.constexpr,
                 BLOCK: tl.constexpr):
    """`full_kl.FullKL.tile_forward` for two heads' tiles (π from R, ρ from R2): per row the maxima m, m₂,
    s = Σ e^{z−m}, s₂ = Σ e^{z₂−m₂} and D = Σ e^{z−m} ((z − m) − (z₂ − m₂))."""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    R2 += row * stride2
    m, m2, s, s2, dsum = tl.load(M + row), tl.load(M2 + row), tl.load(S + row), tl.load(S2 + row), tl.load(D + row)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, _, z2 = _pair_logits(R, B, scale, softcap, R2, B2, scale2, softcap2, cols, inside, inv_t, HAS_BIAS, SOFTCAP,
                                HAS_BIAS2, SOFTCAP2)
        new, step, alpha, d, e = _online(m, s, z, inside)
        new2, step2, alpha2, d2, e2 = _online(m2, s2, z2, inside)
        dsum = alpha * (dsum + s * (step - step2)) + tl.sum(e * (d - d2), 0)
        s = alpha * s + tl.sum(e, 0)
        s2 = alpha2 * s2 + tl.sum(e2, 0)
        m, m2 = new, new2
    tl.store(M + row, m)
    tl.store(M2 + row, m2)
    tl.store(S + row, s)
    tl.store(S2 + row, s2)
    tl.store(D + row, dsum)


@triton.jit
def _log_mixture(log_p, log_q, log_keep, log_beta):
    """log m = log((1 − β) p + β q), as a log-add-exp of log p + log(1 − β) and log q + log β."""
    a, b = log_p + log_keep, log_q + log_beta
    top = tl.maximum(a, b)
    return top + tl.log(1.0 + tl.exp(-tl.abs(a - b)))


@triton.jit
def jsd_forward(R, stride, B, scale, softcap, R2, stride2, B2, scale2, softcap2, LSE, LSE2, KL_T, KL_S, width,
                inv_t, log_keep, log_beta, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, HAS_BIAS2: tl.constexpr,
                SOFTCAP2: tl.constexpr, BLOCK: tl.constexpr):
    """`divergence.jsd_sums` given both log-normalisers, added to the running sums: per row
    Σ p_T (log p_T − log m) into KL_T and Σ p_S (log p_S − log m) into KL_S (the student from R)."""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    R2 += row * stride2
    lse, lse2 = tl.load(LSE + row), tl.load(LSE2 + row)
    kl_t, kl_s = tl.load(KL_T + row), tl.load(KL_S + row)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, _, z2 = _pair_logits(R, B, scale, softcap, R2, B2, scale2, softcap2, cols, inside, inv_t, HAS_BIAS, SOFTCAP,
                                HAS_BIAS2, SOFTCAP2)
        log_p, log_q = z - lse, z2 - lse2
        log_m = _log_mixture(log_p, log_q, log_keep, log_beta)
        kl_s += tl.sum(tl.where(inside, tl.exp(log_p) * (log_p - log_m), 0.0), 0)
        kl_t += tl.sum(tl.where(inside, tl.exp(log_q) * (log_q - log_m), 0.0), 0)
    tl.store(KL_T + row, kl_t)
    tl.store(KL_S + row, kl_s)


@triton.jit
def pair_backward(R, stride, B, scale, softcap, R2, stride2, B2, scale2, softcap2, LSE, LSE2, SHIFT, G, width, inv_t,
                  log_keep, log_beta, keep, MODE: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                  HAS_BIAS2: tl.constexpr, SOFTCAP2: tl.constexpr, BLOCK: tl.constexpr):
    """∂L/∂r of the first head (π, from R) against the second (ρ, from R2) over R, times the head's slope:

        MODE 0, KL(π‖ρ):   (g/τ) π (log π − log ρ − KL)                  SHIFT = KL (`full_kl.chunk_full_kl_grad`)
        MODE 1, KL(ρ‖π):   (g/τ) (π − ρ)                                 (`divergence.ForwardKL.grad`)
        MODE 2, JSD(β):    (g/τ)(1 − β) π (log π − log m − KL(π‖m))      SHIFT = KL(π‖m), `keep` = 1 − β
                           (`divergence.GeneralisedJSD.grad`)"""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    R2 += row * stride2
    lse, lse2, shift = tl.load(LSE + row), tl.load(LSE2 + row), tl.load(SHIFT + row)
    g = tl.load(G + row) * inv_t * keep
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, slope, z2 = _pair_logits(R, B, scale, softcap, R2, B2, scale2, softcap2, cols, inside, inv_t, HAS_BIAS,
                                    SOFTCAP, HAS_BIAS2, SOFTCAP2)
        log_p, log_q = z - lse, z2 - lse2
        if MODE == 1:
            grad = g * (tl.exp(log_p) - tl.exp(log_q))
        else:
            if MODE == 2:
                log_q = _log_mixture(log_p, log_q, log_keep, log_beta)
            grad = g * tl.exp(log_p) * (log_p - log_q - shift)
        tl.store(R + cols, (grad * slope).to(R.dtype.element_ty), mask=inside)
