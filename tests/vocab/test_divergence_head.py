"""`divergence_from_hidden` with each model's LM-head bias, logit scale and soft-cap (head.HeadKind):
logits = c·tanh(s·(x Wᵀ + b)/c), then τ, against the float64 loop from the formula (loops/divergence.py),
gradcheck, TRL 1.16's `ChunkedDivergenceFunction` with the same options, and the plain head bit for bit.

Parity with TRL 1.16 (its CPU path; B, T, V = 3, 5, 37; H = 8, teacher H' = 6; β ∈ {0, 0.1, 0.5, 0.9, 1},
τ ∈ {1, 0.7}; whole-vocabulary and tiled, TRL's tiles shrunk to 4 tokens x 10 columns too; the option sets
of `TRL_OPTIONS`), measured worst cases: float32 inputs: per-token value max abs 2.86e-6 (max rel 1.03e-6),
∂/∂hidden 6.90e-6, ∂/∂weight 8.26e-6, ∂/∂bias 1.46e-6; float64 inputs (ours in float64, TRL's in float32):
value 2.67e-6 (rel 1.18e-6), ∂/∂hidden 5.93e-6, ∂/∂weight 5.58e-6, ∂/∂bias 1.67e-6. With Triton installed (the
test environment has it for pgloss's kernels) TRL's CPU path folds its float32 tiles in another order: per-token
value max abs 4.77e-6 (rel 8.2e-7), the gradients within the bounds above.
"""

import math

import loops
import pytest
import torch
from vocab.head_checks import assert_compiles_like_eager, assert_refuses_bad_head, records, with_biases

import pgloss
from pgloss.vocab.divergence import divergence_from_hidden

B, T, H, H_T, V = 3, 5, 8, 6, 37
TAU = 0.7
# (tokens per chunk, vocabulary columns per tile): neither divides N = 15 nor V = 37; None is the whole vocabulary.
TILES = [(4, None), (4, 10), (7, 13)]
MASK = torch.arange(T)[None, :] < torch.tensor([5, 3, 1])[:, None]


def make(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    return dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.7),
        bias=r(V, scale=0.5),
        teacher_hidden=r(B, T, H_T),
        teacher_weight=r(V, H_T, scale=0.7),
        teacher_bias=r(V, scale=0.5),
        upstream=r(B, T),
    )


# Each model's options (the logits' spread is about 2: soft-caps of 1.5 to 3 bend them).
OPTIONS = {
    "none": {},
    "bias": dict(bias=True, teacher_bias=True),
    "scale": dict(logit_scale=1.7, teacher_logit_scale=0.6),
    "softcap": dict(softcap=2.5, teacher_softcap=1.5),
    "teacher": dict(teacher_bias=True, teacher_logit_scale=1.3, teacher_softcap=1.5),
    "all": dict(
        bias=True, teacher_bias=True, logit_scale=0.8, teacher_logit_scale=1.25, softcap=3.0, teacher_softcap=2.0
    ),
}


def options(name, x, bias=None):
    """The options of set `name`, biases filled in (the student's by `bias` when given), written flat (`records`
    turns them into the call's `head=` and `teacher_head=`)."""
    return with_biases(OPTIONS[name], x, bias)


def leaves(x):
    return [x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]


def loop_reference(x, opts, beta):
    """Per position, in float64 Python floats: both heads' logits (bias, scale, soft-cap), the divergence at τ,
    and the upstream-weighted gradients to the student's hidden states, weight and bias by the chain rule
    ∂D/∂(Wx + b)_v = ∂D/∂logits_v · s (1 − tanh²)."""
    weight, teacher_weight = x["weight"].tolist(), x["teacher_weight"].tolist()
    student_head = dict(
        bias=x["bias"].tolist() if opts.get("bias") is not None else None,
        scale=opts.get("logit_scale", 1.0),
        softcap=opts.get("softcap"),
    )
    teacher_head = dict(
        bias=x["teacher_bias"].tolist() if opts.get("teacher_bias") is not None else None,
        scale=opts.get("teacher_logit_scale", 1.0),
        softcap=opts.get("teacher_softcap"),
    )
    values = torch.zeros(B, T, dtype=torch.float64)
    g_hidden, g_weight, g_bias = torch.zeros(B, T, H, dtype=torch.float64), [[0.0] * H for _ in range(V)], [0.0] * V
    for i in range(B):
        for t in range(T):
            if not MASK[i, t]:
                continue
            h_row = x["hidden"][i, t].tolist()
            student = loops.head_logits(h_row, weight, **student_head)
            teacher = loops.head_logits(x["teacher_hidden"][i, t].tolist(), teacher_weight, **teacher_head)
            values[i, t] = loops.divergence(student, teacher, beta, TAU)
            slope = loops.head_slope(h_row, weight, **student_head)
            up = float(x["upstream"][i, t])
            g_raw = [up * g * s for g, s in zip(loops.divergence_grad(student, teacher, beta, TAU), slope, strict=True)]
            g_hidden[i, t] = torch.tensor(
                [sum(g_raw[v] * weight[v][k] for v in range(V)) for k in range(H)], dtype=torch.float64
            )
            for v in range(V):
                g_bias[v] += g_raw[v]
                for k in range(H):
                    g_weight[v][k] += g_raw[v] * h_row[k]
    return values, g_hidden, torch.tensor(g_weight, dtype=torch.float64), torch.tensor(g_bias, dtype=torch.float64)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_matches_the_loop(beta, name, tiles):
    x = make(seed=1)
    hidden, weight, bias = leaves(x)
    opts = options(name, x, bias)
    out = divergence_from_hidden(
        hidden,
        weight,
        x["teacher_hidden"],
        x["teacher_weight"],
        MASK,
        beta=beta,
        temperature=TAU,
        chunk_size=tiles[0],
        vocab_block=tiles[1],
        **records(opts),
    )
    (out.per_token * x["upstream"]).sum().backward()
    values, g_hidden, g_weight, g_bias = loop_reference(x, opts, beta)
    # measured worst cases: values 7.6e-15, ∂/∂hidden 1.9e-14, ∂/∂weight 3.5e-14, ∂/∂bias 4.4e-15
    torch.testing.assert_close(out.per_token.detach(), values, rtol=0, atol=1e-13)
    torch.testing.assert_close(hidden.grad, g_hidden, rtol=0, atol=1e-13)
    torch.testing.assert_close(weight.grad, g_weight, rtol=0, atol=1e-13)
    if opts.get("bias") is None:
        assert bias.grad is None
    else:
        torch.testing.assert_close(bias.grad, g_bias, rtol=0, atol=1e-13)
    assert (out.per_token[MASK] > 0).all()


def test_options_change_the_divergence():
    """Each option moves the value (so the loop test above is not comparing one path with itself)."""
    x = make(seed=2)
    args = (x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], MASK)
    plain = divergence_from_hidden(*args, beta=0.3, temperature=TAU).per_token
    for name in OPTIONS:
        if name != "none":
            moved = divergence_from_hidden(*args, beta=0.3, temperature=TAU, **records(options(name, x))).per_token
            assert (moved - plain)[MASK].abs().min() > 1e-4, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_defaults_leave_the_plain_head_bit_for_bit(beta, tiles, dtype):
    """Options at their defaults, and a zero bias (x + 0 = x), give the plain call's values and hidden-state
    and head gradients exactly (torch.equal); the zero bias's gradient is Σ_rows ∂L/∂logits."""
    x = make(seed=3, dtype=dtype)
    args = (x["teacher_hidden"], x["teacher_weight"], MASK)
    sizes = dict(beta=beta, temperature=TAU, chunk_size=tiles[0], vocab_block=tiles[1])
    results = []
    for extra in (
        {},
        dict(head=pgloss.HeadOptions(None, 1.0, None), teacher_head=pgloss.HeadOptions(None, 1.0, None)),
        "zero bias",
    ):
        hidden, weight, _ = leaves(x)
        if extra == "zero bias":
            zero = torch.zeros(V, dtype=dtype, requires_grad=True)
            extra = dict(head=pgloss.HeadOptions(zero), teacher_head=pgloss.HeadOptions(torch.zeros(V, dtype=dtype)))
        out = divergence_from_hidden(hidden, weight, *args, **sizes, **extra)
        (out.per_token * x["upstream"].float()).sum().backward()
        results.append((out.per_token, out.loss, hidden.grad, weight.grad))
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], result, strict=True))
    assert zero.grad.dtype == dtype and torch.isfinite(zero.grad.float()).all() and zero.grad.abs().max() > 0


def small(seed):
    """A problem small enough for gradcheck's finite differences: N = 6 tokens, V = 11, H = 4, H' = 3."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return r(2, 3, 4), r(11, 4), r(11), r(2, 3, 3), r(11, 3), r(11), torch.tensor([[True, True, False], [True] * 3])


STUDENT_ON, TEACHER_ON = dict(logit_scale=1.3, softcap=1.5), dict(logit_scale=0.7, softcap=2.0)


def all_on(bias, teacher_bias):
    """Every option of both heads, with these biases."""
    return dict(
        head=pgloss.HeadOptions(bias, **STUDENT_ON), teacher_head=pgloss.HeadOptions(teacher_bias, **TEACHER_ON)
    )


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("vocab_block", [None, 4])
def test_gradcheck_with_every_option(beta, vocab_block):
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask = small(4)

    def fn(h, w, b):
        return divergence_from_hidden(
            h,
            w,
            teacher_hidden,
            teacher_weight,
            mask,
            beta=beta,
            temperature=TAU,
            chunk_size=4,
            vocab_block=vocab_block,
            **all_on(b, teacher_bias),
        ).per_token

    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()))


def test_the_teacher_gets_no_gradient():
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask = small(5)
    teacher = [t.requires_grad_() for t in (teacher_hidden, teacher_weight, teacher_bias)]
    bias.requires_grad_()
    out = divergence_from_hidden(
        hidden, weight, *teacher[:2], mask, beta=0.3, vocab_block=4, **all_on(bias, teacher[2])
    )
    out.loss.backward()
    assert all(t.grad is None for t in teacher) and bias.grad.abs().max() > 0


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_memory_budget_and_no_n_by_v_tensor_saved(beta):
    """A budget that forces vocabulary tiles (the soft-capped student's slope counted as one more buffer) gives
    the whole-vocabulary values and gradients; nothing of N x V is saved for backward."""
    x = make(seed=6)
    results, saved = [], []
    for sizes in (dict(), dict(memory_budget=5 * 8 * 6 * 5)):
        hidden, weight, bias = leaves(x)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            out = divergence_from_hidden(
                hidden,
                weight,
                x["teacher_hidden"],
                x["teacher_weight"],
                MASK,
                beta=beta,
                **records(options("all", x, bias)),
                **sizes,
            )
        out.loss.backward()
        results.append((out.per_token, hidden.grad, weight.grad, bias.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    assert saved and all(math.prod(s) < B * T * V for s in saved), saved


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("vocab_block", [None, 10])
def test_meta_tensors(beta, vocab_block):
    """The call with every option, forward and backward, on meta tensors: nothing reads a value on the host."""
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    hidden, weight, bias = meta(B, T, H).requires_grad_(), meta(V, H).requires_grad_(), meta(V).requires_grad_()
    out = divergence_from_hidden(
        hidden,
        weight,
        meta(B, T, H_T),
        meta(V, H_T),
        MASK.to("meta"),
        beta=beta,
        chunk_size=4,
        vocab_block=vocab_block,
        **all_on(bias, meta(V)),
    )
    assert out.per_token.shape == (B, T) and out.per_token.device.type == "meta" and out.loss.shape == ()
    out.loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape and bias.grad.shape == bias.shape


@pytest.mark.compile
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_compiles_whole_forward_and_backward(beta):
    """torch.compile(fullgraph=True) with every option over vocabulary tiles, with the eager loss and gradients."""
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask = (t.float() for t in small(7))

    def call(h, w, b):
        return divergence_from_hidden(
            h,
            w,
            teacher_hidden,
            teacher_weight,
            mask,
            beta=beta,
            chunk_size=4,
            vocab_block=4,
            **all_on(b, teacher_bias),
        ).loss

    assert_compiles_like_eager(call, [hidden, weight, bias])


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bfloat16_heads_with_a_bias(beta):
    """bfloat16 hidden states, heads and biases: the matmuls in bfloat16, the bias, scale, soft-cap and divergence
    in float32, equal to the float64 divergence of the same bfloat16 parameters to bfloat16 matmul rounding; the
    bias's gradient comes back in bfloat16."""
    x = {k: v.to(torch.bfloat16) for k, v in make(seed=8).items()}
    hidden, weight, bias = leaves(x)
    opts = options("all", x, bias)
    out = divergence_from_hidden(
        hidden,
        weight,
        x["teacher_hidden"],
        x["teacher_weight"],
        MASK,
        beta=beta,
        temperature=TAU,
        chunk_size=4,
        vocab_block=10,
        **records(opts),
    )
    out.loss.backward()
    assert out.per_token.dtype == torch.float32 and bias.grad.dtype == weight.grad.dtype == torch.bfloat16
    exact = {k: v.detach().double() for k, v in x.items()}
    h, w, b = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    expected = divergence_from_hidden(
        h,
        w,
        exact["teacher_hidden"],
        exact["teacher_weight"],
        MASK,
        beta=beta,
        temperature=TAU,
        **records(options("all", exact, b)),
    )
    expected.loss.backward()
    # measured: values within 0.135% relative, the bias's gradient within 0.29% of its largest entry
    torch.testing.assert_close(out.per_token.double(), expected.per_token.detach(), rtol=2e-3, atol=1e-6)
    torch.testing.assert_close(bias.grad.double(), b.grad, rtol=0, atol=4e-3 * float(b.grad.abs().max()))


def test_bad_options_name_the_argument():
    x = make()
    args = (x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], MASK)
    for prefix in ("", "teacher_"):
        assert_refuses_bad_head(lambda **kw: divergence_from_hidden(*args, beta=0.5, **kw), x[f"{prefix}bias"], prefix)


# --- TRL 1.16 on the same inputs --------------------------------------------------------------------------

TRL_OPTIONS = ["none", "bias", "scale", "softcap", "all"]


@pytest.mark.parametrize("small_tiles", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("name", TRL_OPTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parity_with_trl_chunked_divergence(dtype, name, beta, temperature, small_tiles, monkeypatch):
    """TRL's ChunkedDivergenceFunction (its CPU path) with the same biases, scales and soft-caps: per-token values
    and the student's hidden-state, head and bias gradients. TRL projects and accumulates in float32 whatever the
    inputs' dtype, hence float32 tolerances in both dtypes, just above the worst cases measured (module docstring)."""
    cd = pytest.importorskip("trl.kernels.chunked_divergence")
    if cd._use_triton(torch.device("cpu")):
        pytest.skip("TRL runs its Triton kernels here")
    if small_tiles:
        monkeypatch.setattr(cd, "TOKEN_CHUNK_SIZE", 4)
        monkeypatch.setattr(cd, "VOCAB_CHUNK_SIZE", 10)
    x = make(seed=12, dtype=dtype)
    ones = torch.ones(B, T, dtype=torch.bool)
    (h1, w1, b1), (h2, w2, b2) = leaves(x), leaves(x)
    opts = options(name, x, b1)
    ours = divergence_from_hidden(
        h1,
        w1,
        x["teacher_hidden"],
        x["teacher_weight"],
        ones,
        beta=beta,
        temperature=temperature,
        chunk_size=4,
        vocab_block=10 if small_tiles else None,
        **records(opts),
    ).per_token
    (ours * x["upstream"]).sum().backward()
    theirs, _ = cd.ChunkedDivergenceFunction.apply(
        h2.reshape(-1, H),
        w2,
        b2 if "bias" in opts else None,
        x["teacher_hidden"].reshape(-1, H_T),
        x["teacher_weight"],
        opts.get("teacher_bias"),
        beta,
        temperature,
        opts.get("logit_scale", 1.0),
        opts.get("softcap"),
        opts.get("teacher_logit_scale", 1.0),
        opts.get("teacher_softcap"),
    )
    (theirs.view(B, T) * x["upstream"].to(theirs.dtype)).sum().backward()
    assert ours.dtype == dtype and theirs.dtype == torch.float32
    torch.testing.assert_close(ours.double(), theirs.view(B, T).double(), rtol=0, atol=5e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=8e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-5)
    if "bias" in opts:
        torch.testing.assert_close(b1.grad, b2.grad, rtol=0, atol=2e-6)
    assert ours.min() > 0
