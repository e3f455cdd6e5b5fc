"""The Triton kernels of the vocabulary loop: one pass over a tile of raw head outputs per launch.

A tile is r = x W[cols]ᵀ as the matmul wrote it (bfloat16, float16 or float32), [rows, width] with row
stride `stride`; a bias is read where it lies (`bias_stride`: any view, 0 for an expanded one), the targets
too (`target_stride`). Each kernel applies the head itself, in `head.HeadKind`'s order,

    z = c · tanh(s · (r + b) / c) / τ        (s · (r + b) / τ without a soft-cap c)

then z clamped from below at `banned.BANNED_LOGIT` (a −inf logit: a banned token), in float32 registers, one
program per row walking the tile in blocks of BLOCK columns, so that the [rows, width] logits are read once and
never written in float32. The forward kernels update a per-row
running state (online max, as in Milakov & Gimelshein 2018, https://arxiv.org/abs/1805.02867) in place;
the backward kernels write ∂L/∂r, the head's slope s (1 − tanh²) included, over the tile they read (the
buffer the two gradient matmuls then take). Each kernel is the twin of a torch statistic (entropy.py,
full_kl.py, divergence.py), which is its reference in the tests.

Only imported on the kernel route (`kernels.py`): importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .banned import BANNED_LOGIT

# The odd Taylor coefficients of tanh(u)/u in u²: 1, −1/3, 2/15, −17/315, 62/2835, −1382/155925, 21844/6081075.
_TANH_SERIES_BELOW = tl.constexpr(0.25)  # |u| below: the series (its next term is under 2⁻³² of the value)
_BANNED = tl.constexpr(BANNED_LOGIT)


@triton.jit
def _tanh_and_slope(u):
    """(tanh u, 1 − tanh² u) to a few float32 ulps relative for every u, ±inf included (±1, 0). With
    e = e^{−2|u|}: tanh|u| = (1 − e)/(1 + e) for |u| ≥ 1/4, the odd series below, where 1 − e would cancel (the
    absolute error of 1 − 2/(e^{2u} + 1), 1.4e-7 near 0, times a soft-cap c of 10⁴ was 1.4e-3 in a logit); and
    1 − tanh² = 4e/(1 + e)², which never cancels."""
    a = tl.abs(u)
    e = tl.exp(-2.0 * a)
    a2 = a * a
    series = 21844.0 / 6081075.0
    series = -1382.0 / 155925.0 + a2 * series
    series = 62.0 / 2835.0 + a2 * series
    series = -17.0 / 315.0 + a2 * series
    series = 2.0 / 15.0 + a2 * series
    series = -1.0 / 3.0 + a2 * series
    t = tl.where(a < _TANH_SERIES_BELOW, a + a * (a2 * series), (1.0 - e) / (1.0 + e))
    return tl.where(u < 0, -t, t), 4.0 * e / ((1.0 + e) * (1.0 + e))


@triton.jit
def _head(r, b, scale, softcap, inv_t, SOFTCAP: tl.constexpr):
    """(z, ∂z/∂r · τ) of raw outputs `r` with their bias `b` (0 without one): the logits before τ's
    division is folded in, clamped from below at `banned.BANNED_LOGIT` (−inf: a banned token), and the slope the
    gradient needs."""
    u = r + b
    if SOFTCAP:  # one return: Triton's compiler types every return of a function, a static branch's too
        t, one_minus_t2 = _tanh_and_slope(u * (scale / softcap))
        z, slope = softcap * t * inv_t, scale * one_minus_t2
    else:
        z, slope = u * (scale * inv_t), scale
    return tl.maximum(z, _BANNED), slope


@triton.jit
def _tile_logits(R, B, bias_stride, cols, inside, scale, softcap, inv_t, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """A head's tempered logits and slope on the columns `cols` of its tile row R; its bias read at
    B + cols · bias_stride, in 64 bits (a view of any stride, 0 for an expanded one)."""
    r = tl.load(R + cols, mask=inside, other=0.0).to(tl.float32)
    b = 0.0
    if HAS_BIAS:
        b = tl.load(B + cols.to(tl.int64) * bias_stride, mask=inside, other=0.0).to(tl.float32)
    return _head(r, b, scale, softcap, inv_t, SOFTCAP)


@triton.jit
def _pair_logits(
    R,
    B,
    bias_stride,
    scale,
    softcap,
    R2,
    B2,
    bias_stride2,
    scale2,
    softcap2,
    cols,
    inside,
    inv_t,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_BIAS2: tl.constexpr,
    SOFTCAP2: tl.constexpr,
):
    """Both heads' tempered logits on the block `cols` of their tiles, and the first head's slope."""
    z, slope = _tile_logits(R, B, bias_stride, cols, inside, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
    z2, _ = _tile_logits(R2, B2, bias_stride2, cols, inside, scale2, softcap2, inv_t, HAS_BIAS2, SOFTCAP2)
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
def _log_prob_entropy_grad(z, slope, is_target, shift, log_s, ent, g_lp, g_h):
    """∂L/∂r of log π(y) and H at the logits z (their slope ∂z/∂r · τ beside them): with log π = (z − c) − log s
    from the row's shift c and log s, and g_lp, g_H the loss's ∂L/∂log π(y), ∂L/∂H already divided by τ,

        slope · [g_lp (1[v = y] − π) − g_H π (log π + H)]

    (`entropy.chunk_grad_logits`); the row's values as scalars, or as columns broadcast over a block of rows."""
    log_p = (z - shift) - log_s
    p = tl.exp(log_p)
    return (tl.where(is_target, g_lp, 0.0) - g_lp * p - g_h * p * (log_p + ent)) * slope


@triton.jit
def log_prob_entropy_forward(
    R,
    stride,
    B,
    bias_stride,
    scale,
    softcap,
    TARGETS,
    target_stride,
    M,
    S,
    A,
    ZY,
    width,
    col0,
    inv_t,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`entropy.LogProbEntropy.tile_forward`: per row, m (max), s = Σ e^{z−m}, a = Σ e^{z−m} (z − m) and the
    target's logit z_y (kept from an earlier tile when the target is outside this one)."""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    m, s, a = tl.load(M + row), tl.load(S + row), tl.load(A + row)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, _ = _tile_logits(R, B, bias_stride, cols, inside, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
        new, step, alpha, d, e = _online(m, s, z, inside)
        a = alpha * (a + step * s) + tl.sum(e * d, 0)
        s = alpha * s + tl.sum(e, 0)
        m = new
    y = tl.load(TARGETS + row * target_stride) - col0
    hit = (y >= 0) & (y < width)
    y = tl.minimum(tl.maximum(y, 0), width - 1)
    z_y, _ = _tile_logits(R, B, bias_stride, y, y >= 0, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
    tl.store(ZY + row, tl.where(hit, z_y, tl.load(ZY + row)))
    tl.store(M + row, m)
    tl.store(S + row, s)
    tl.store(A + row, a)


@triton.jit
def log_prob_entropy_backward(
    R,
    stride,
    B,
    bias_stride,
    scale,
    softcap,
    TARGETS,
    target_stride,
    SHIFT,
    LOG_S,
    ENT,
    GLP,
    GENT,
    width,
    col0,
    inv_t,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`entropy.chunk_grad_logits` times the head's slope, over R: ∂L/∂r =
    slope · (1/τ) [g_lp (1[v = y] − π) − g_H π (log π + H)], log π = (z − c) − log s from the row's shift c (the
    max m) and log s, never summed into lse (`entropy.LogProbEntropy`)."""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    shift, log_s, ent = tl.load(SHIFT + row), tl.load(LOG_S + row), tl.load(ENT + row)
    g_lp, g_h = 0.0, 0.0
    if HAS_GLP:
        g_lp = tl.load(GLP + row) * inv_t
    if HAS_GENT:
        g_h = tl.load(GENT + row) * inv_t
    y = tl.load(TARGETS + row * target_stride) - col0
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, slope = _tile_logits(R, B, bias_stride, cols, inside, scale, softcap, inv_t, HAS_BIAS, SOFTCAP)
        g = _log_prob_entropy_grad(z, slope, cols == y, shift, log_s, ent, g_lp, g_h)
        tl.store(R + cols, g.to(R.dtype.element_ty), mask=inside)


@triton.jit
def pair_forward(
    R,
    stride,
    B,
    bias_stride,
    scale,
    softcap,
    R2,
    stride2,
    B2,
    bias_stride2,
    scale2,
    softcap2,
    M,
    M2,
    S,
    S2,
    D,
    width,
    inv_t,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_BIAS2: tl.constexpr,
    SOFTCAP2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """`full_kl.FullKL.tile_forward` for two heads' tiles (π from R, ρ from R2): per row the maxima m, m₂,
    s = Σ e^{z−m}, s₂ = Σ e^{z₂−m₂} and D = Σ e^{z−m} ((z − m) − (z₂ − m₂))."""
    row = tl.program_id(0).to(tl.int64)
    R += row * stride
    R2 += row * stride2
    m, m2, s, s2, dsum = tl.load(M + row), tl.load(M2 + row), tl.load(S + row), tl.load(S2 + row), tl.load(D + row)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < width
        z, _, z2 = _pair_logits(
            R,
            B,
            bias_stride,
            scale,
            softcap,
            R2,
            B2,
            bias_stride2,
            scale2,
            softcap2,
            cols,
            inside,
            inv_t,
            HAS_BIAS,
            SOFTCAP,
            HAS_BIAS2,
            SOFTCAP2,
        )
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
def jsd_forward(
    R,
    stride,
    B,
    bias_stride,
    scale,
    softcap,
    R2,
    stride2,
    B2,
    bias_stride2,
    scale2,
    softcap2,
    LSE,
    LSE2,
    KL_T,
    KL_S,
    width,
    inv_t,
    log_keep,
    log_beta,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_BIAS2: tl.constexpr,
    SOFTCAP2: tl.constexpr,
    BLOCK: tl.constexpr,
):
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
        z, _, z2 = _pair_logits(
            R,
            B,
            bias_stride,
            scale,
            softcap,
            R2,
            B2,
            bias_stride2,
            scale2,
            softcap2,
            cols,
            inside,
            inv_t,
            HAS_BIAS,
            SOFTCAP,
            HAS_BIAS2,
            SOFTCAP2,
        )
        log_p, log_q = z - lse, z2 - lse2
        log_m = _log_mixture(log_p, log_q, log_keep, log_beta)
        kl_s += tl.sum(tl.where(inside, tl.exp(log_p) * (log_p - log_m), 0.0), 0)
        kl_t += tl.sum(tl.where(inside, tl.exp(log_q) * (log_q - log_m), 0.0), 0)
    tl.store(KL_T + row, kl_t)
    tl.store(KL_S + row, kl_s)


@triton.jit
def pair_backward(
    R,
    stride,
    B,
    bias_stride,
    scale,
    softcap,
    R2,
    stride2,
    B2,
    bias_stride2,
    scale2,
    softcap2,
    LSE,
    LSE2,
    SHIFT,
    G,
    width,
    inv_t,
    log_keep,
    log_beta,
    keep,
    MODE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_BIAS2: tl.constexpr,
    SOFTCAP2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """∂L/∂r of the first head (π, from R) against the second (ρ, from R2) over R, times the head's slope:

    MODE 0, KL(π‖ρ):   (g/τ) π (log π − log ρ − KL)                  SHIFT = KL (`full_kl.chunk_full_kl_grad`)
    MODE 1, KL(ρ‖π):   (g/τ) (π − ρ), ρ left out where π bans a token   (`divergence.ForwardKL.grad`)
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
        z, slope, z2 = _pair_logits(
            R,
            B,
            bias_stride,
            scale,
            softcap,
            R2,
            B2,
            bias_stride2,
            scale2,
            softcap2,
            cols,
            inside,
            inv_t,
            HAS_BIAS,
            SOFTCAP,
            HAS_BIAS2,
            SOFTCAP2,
        )
        log_p, log_q = z - lse, z2 - lse2
        if MODE == 1:  # the teacher's π_T left out where the student bans the token (`banned.py`)
            grad = g * (tl.exp(log_p) - tl.where(z > _BANNED, tl.exp(log_q), 0.0))
        else:
            if MODE == 2:
                log_q = _log_mixture(log_p, log_q, log_keep, log_beta)
            grad = g * tl.exp(log_p) * (log_p - log_q - shift)
        tl.store(R + cols, (grad * slope).to(R.dtype.element_ty), mask=inside)
