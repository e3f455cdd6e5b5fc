"""The Triton kernels of the head-kernel route: log π(y) and H straight from hidden states x [N, H] and an LM head
W [V, H], each block of logits formed inside the kernel and never written to memory.

A program takes a block of BLOCK_N rows and a range of columns, and forms each block of BLOCK_V columns of

    r = x W[cols]ᵀ        (a tl.dot over H in BLOCK_K steps, accumulated in float32)

then applies the head in float32 registers as the kernel route does (`triton_kernels._head`: bias of any stride,
logit scale, soft-cap, τ, the floor at `banned.BANNED_LOGIT`). float32 inputs are multiplied as IEEE float32 (the
tensor cores' TF32 keeps 10 bits of each factor, a relative error near 1e-3 in a logit); half-precision inputs in
the tensor cores' own precision, as cuBLAS does on the kernel route.

- forward (`head_log_prob_entropy_forward`): per row, the running m (max), s = Σ e^{z−m}, a = Σ e^{z−m} (z − m)
  and the target's z_y over the program's columns (online max, Milakov & Gimelshein 2018,
  https://arxiv.org/abs/1805.02867), written as one partial state per (row, column range), which
  `kernels.head_log_prob_entropy_forward` combines;
- backward (`head_log_prob_entropy_backward`): the block recomputed, ∂L/∂r formed as on the kernel route
  (`triton_kernels._log_prob_entropy_grad`), then ∂x += G W[cols], ∂W[cols] += Gᵀ x and ∂b[cols] += Σ_rows G
  added into float32 buffers by atomic adds: no [N, V] or [N, tile] tensor exists on either pass.

Every row offset (in x, the targets, the state, ∂x) and every column offset into W, ∂W and the bias is 64-bit,
so that no tensor past 2³¹ elements wraps (Cut Cross-Entropy #39). Rows whose `VALID` is false read x as zeros
and add nothing to any gradient. Only imported on the head-kernel route (`kernels.py`): importing this module
imports triton.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from .triton_kernels import _head, _log_prob_entropy_grad

# Triton's interpreter (3.9) multiplies bfloat16 operands of tl.dot as the integers their bits spell (it holds them
# as uint16): there they are widened to float32 first, whose products of bfloat16 values are exact, as on the GPU.
_INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def _dot(a, b, acc):
    """acc + a b in float32: IEEE products for float32 inputs, the tensor cores' default for half precision."""
    if a.dtype == tl.float32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    elif _INTERPRETED:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _rows(VALID, n_rows, HAS_VALID: tl.constexpr, BLOCK_N: tl.constexpr):
    """The program's rows (64-bit), which of them exist, and which are read (exist and are valid)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    exists = rows < n_rows
    read = exists
    if HAS_VALID:
        read = exists & (tl.load(VALID + rows, mask=exists, other=0) != 0)
    return rows, exists, read


@triton.jit
def _block(
    X,
    x_stride,
    W,
    w_stride,
    rows,
    read,
    cols,
    inside,
    hidden,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """r = x[rows] W[cols]ᵀ, float32 [BLOCK_N, BLOCK_V]: zero for rows not read and columns not inside."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    x_rows = rows[:, None] * x_stride
    w_rows = cols.to(tl.int64)[:, None] * w_stride
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_in = ks < hidden
        x = tl.load(X + (x_rows + ks[None, :]), mask=read[:, None] & k_in[None, :], other=0.0)
        w = tl.load(W + (w_rows + ks[None, :]), mask=inside[:, None] & k_in[None, :], other=0.0)
        acc = _dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def _logits(
    X,
    x_stride,
    W,
    w_stride,
    B,
    bias_stride,
    scale,
    softcap,
    inv_t,
    rows,
    read,
    cols,
    inside,
    hidden,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The block's tempered logits z and slope ∂z/∂r · τ (`triton_kernels._head`), bias read at
    B + cols · bias_stride (a view of any stride, 0 for an expanded one)."""
    r = _block(X, x_stride, W, w_stride, rows, read, cols, inside, hidden, BLOCK_N, BLOCK_V, BLOCK_K)
    b = tl.zeros((1, BLOCK_V), dtype=tl.float32)
    if HAS_BIAS:
        b = tl.load(B + cols.to(tl.int64) * bias_stride, mask=inside, other=0.0).to(tl.float32)[None, :]
    return _head(r, b, scale, softcap, inv_t, SOFTCAP)


@triton.jit
def head_log_prob_entropy_forward(
    X,
    x_stride,
    W,
    w_stride,
    B,
    bias_stride,
    scale,
    softcap,
    TARGETS,
    target_stride,
    VALID,
    M,
    S,
    A,
    ZY,
    n_rows,
    hidden,
    vocab,
    split_width,
    inv_t,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_VALID: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """`entropy.LogProbEntropy.tile_forward` over the columns [j w, (j + 1) w) of split j = program_id(1), for a
    block of rows: m, s, a and the target's logit z_y (−inf where the target is in another split), stored at
    [row, split] of M, S, A, ZY [N, splits]."""
    rows, exists, read = _rows(VALID, n_rows, HAS_VALID, BLOCK_N)
    split = tl.program_id(1)
    start = split * split_width
    end = tl.minimum(start + split_width, vocab)
    y = tl.load(TARGETS + rows * target_stride, mask=exists, other=-1)
    m = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    a = tl.zeros((BLOCK_N,), tl.float32)
    z_y = tl.full((BLOCK_N,), -float("inf"), tl.float32)
    for v0 in range(start, end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        inside = cols < end
        z, _ = _logits(
            X,
            x_stride,
            W,
            w_stride,
            B,
            bias_stride,
            scale,
            softcap,
            inv_t,
            rows,
            read,
            cols,
            inside,
            hidden,
            HAS_BIAS,
            SOFTCAP,
            BLOCK_N,
            BLOCK_V,
            BLOCK_K,
        )
        # the online max of `triton_kernels._online`, a row of the block at a time
        new = tl.maximum(m, tl.max(tl.where(inside[None, :], z, -float("inf")), 1))
        step = tl.where(s > 0, m, new) - new
        d = tl.where(inside[None, :], z - new[:, None], 0.0)
        e = tl.where(inside[None, :], tl.exp(d), 0.0)
        alpha = tl.exp(step)
        a = alpha * (a + step * s) + tl.sum(e * d, 1)
        s = alpha * s + tl.sum(e, 1)
        m = new
        hit = (cols[None, :] == y[:, None]) & inside[None, :]
        z_y = tl.maximum(z_y, tl.max(tl.where(hit, z, -float("inf")), 1))
    at = rows * tl.num_programs(1) + split
    tl.store(M + at, m, mask=exists)
    tl.store(S + at, s, mask=exists)
    tl.store(A + at, a, mask=exists)
    tl.store(ZY + at, z_y, mask=exists)


@triton.jit
def head_log_prob_entropy_backward(
    X,
    x_stride,
    W,
    w_stride,
    B,
    bias_stride,
    scale,
    softcap,
    TARGETS,
    target_stride,
    VALID,
    SHIFT,
    LOG_S,
    ENT,
    GLP,
    GENT,
    DX,
    dx_stride,
    DW,
    dw_stride,
    DB,
    n_rows,
    hidden,
    col0,
    width,
    inv_t,
    HAS_BIAS: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_VALID: tl.constexpr,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    NEEDS_X: tl.constexpr,
    NEEDS_W: tl.constexpr,
    NEEDS_B: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """For a block of rows and BLOCK_V columns of the slab [col0, col0 + width): G = ∂L/∂r
    (`triton_kernels._log_prob_entropy_grad`, from the rows' shift c, log s, H and the loss's ∂L/∂log π(y),
    ∂L/∂H), then DX[rows] += G W[cols] (DX float32 [N, H]), DW[cols − col0] += Gᵀ x (DW float32 [width, H], the
    slab's rows) and DB[cols] += Σ_rows G (DB float32 [V]), by atomic adds. G is rounded to the head's dtype
    before the two products, as the kernel route's ∂L/∂r tile is; ∂b sums it in float32."""
    rows, exists, read = _rows(VALID, n_rows, HAS_VALID, BLOCK_N)
    cols = col0 + tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    inside = cols < col0 + width
    z, slope = _logits(
        X,
        x_stride,
        W,
        w_stride,
        B,
        bias_stride,
        scale,
        softcap,
        inv_t,
        rows,
        read,
        cols,
        inside,
        hidden,
        HAS_BIAS,
        SOFTCAP,
        BLOCK_N,
        BLOCK_V,
        BLOCK_K,
    )
    shift = tl.load(SHIFT + rows, mask=exists, other=0.0)
    log_s = tl.load(LOG_S + rows, mask=exists, other=0.0)
    ent = tl.load(ENT + rows, mask=exists, other=0.0)
    g_lp = tl.zeros((BLOCK_N,), tl.float32)
    g_h = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_GLP:
        g_lp = tl.load(GLP + rows, mask=exists, other=0.0) * inv_t
    if HAS_GENT:
        g_h = tl.load(GENT + rows, mask=exists, other=0.0) * inv_t
    y = tl.load(TARGETS + rows * target_stride, mask=exists, other=-1)
    g = _log_prob_entropy_grad(
        z,
        slope,
        cols[None, :] == y[:, None],
        shift[:, None],
        log_s[:, None],
        ent[:, None],
        g_lp[:, None],
        g_h[:, None],
    )
    g = tl.where(read[:, None] & inside[None, :], g, 0.0)
    if NEEDS_B:
        tl.atomic_add(DB + cols.to(tl.int64), tl.sum(g, 0), mask=inside, sem="relaxed")
    g_in = g.to(X.dtype.element_ty)
    if NEEDS_X:
        w_rows = cols.to(tl.int64)[:, None] * w_stride
        dx_rows = rows[:, None] * dx_stride
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_in = ks < hidden
            w = tl.load(W + (w_rows + ks[None, :]), mask=inside[:, None] & k_in[None, :], other=0.0)
            dx = _dot(g_in, w, tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32))
            tl.atomic_add(DX + (dx_rows + ks[None, :]), dx, mask=read[:, None] & k_in[None, :], sem="relaxed")
    if NEEDS_W:
        x_rows = rows[:, None] * x_stride
        dw_rows = (cols - col0).to(tl.int64)[:, None] * dw_stride
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_in = ks < hidden
            x = tl.load(X + (x_rows + ks[None, :]), mask=read[:, None] & k_in[None, :], other=0.0)
            dw = _dot(tl.trans(g_in), x, tl.zeros((BLOCK_V, BLOCK_K), dtype=tl.float32))
            tl.atomic_add(DW + (dw_rows + ks[None, :]), dw, mask=inside[:, None] & k_in[None, :], sem="relaxed")
