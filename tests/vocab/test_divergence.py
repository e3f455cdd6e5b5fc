"""The student-teacher divergence (vocab/divergence.py): forward KL (β = 0), reverse KL (β = 1) and GKD's
JSD(β), from logits and fused from hidden states, against the float64 loop from the formula
(loops/divergence.py), gradcheck, the materialised logits, full_kl, and TRL 1.16's own functions.

Parity with TRL 1.16 on the same inputs (B, T, V = 3, 5, 37; H = 8, teacher H' = 6; β ∈ {0, 0.1, 0.5, 0.9, 1},
τ ∈ {1, 0.7}; whole-vocabulary and tiled, TRL's tiles shrunk to 4 tokens x 10 columns too), measured worst cases:

- `ChunkedDivergenceFunction` (trl/kernels/chunked_divergence.py, its CPU path `_stats_tile`/`_jsd_tile`/
  `_backward_tile`), against `divergence_from_hidden` (`make(seed=12)`; the test is in test_divergence_head.py,
  the plain head beside biased, scaled and soft-capped ones): it projects and accumulates in float32
  whatever the inputs' dtype. float32 inputs: per-token value max abs 2.9e-6 (max rel 5.7e-7), ∂/∂hidden 2.6e-6,
  ∂/∂weight 3.6e-6. float64 inputs (ours in float64, TRL's in float32): value 2.5e-6 (rel 6.2e-7),
  ∂/∂hidden 1.9e-6, ∂/∂weight 2.9e-6.
- `GKDTrainer.generalized_jsd_loss` (trl/experimental/gkd/gkd_trainer.py), materialised, in the logits' dtype,
  against `divergence_from_logits` (`make(seed=13)`, tiles of 4 tokens x 10 columns): float64 per-token value
  max abs 2.7e-15 (rel 7.9e-16), its "batchmean" with labels (= our token-mean) 4.4e-16, ∂loss/∂logits
  1.5e-16; float32 9.5e-7 (rel 6.5e-7), 2.4e-7 and 6.0e-8.
"""

import math
import warnings

import loops
import pytest
import torch
from properties.micro_batches import cut, micro_batches

import pgloss
import pgloss.vocab.entropy
from pgloss.core.aggregate import aggregate
from pgloss.core.normalizer import Normalizer
from pgloss.vocab.divergence import divergence_from_hidden, divergence_from_logits
from pgloss.vocab.full_kl import full_kl_from_hidden, full_kl_from_logits

B, T, H, H_T, V = 3, 5, 8, 6, 37
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]
# (tokens per chunk, vocabulary columns per tile): neither divides N = 15 nor V = 37; None is the whole vocabulary.
TILES = [(4, None), (4, 10), (7, 13), (15, 1), (2, 36)]
LENGTHS = torch.tensor([5, 3, 1])
MASK = torch.arange(T)[None, :] < LENGTHS[:, None]


def make(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    return dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.7),
        teacher_hidden=r(B, T, H_T),
        teacher_weight=r(V, H_T, scale=0.7),
        upstream=r(B, T),
    )


def logits_of(x):
    return x["hidden"] @ x["weight"].t(), x["teacher_hidden"] @ x["teacher_weight"].t()


def plain(student, teacher, beta, temperature=1.0):
    """The materialised divergence in float64 torch ops, per position."""
    log_q = torch.log_softmax(student.double() / temperature, -1)
    log_p = torch.log_softmax(teacher.double() / temperature, -1)
    if beta == 0:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    if beta == 1:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))
    return beta * (log_p.exp() * (log_p - log_m)).sum(-1) + (1 - beta) * (log_q.exp() * (log_q - log_m)).sum(-1)


@pytest.fixture
def small_blocks(monkeypatch):
    """Cache blocks of 3 rows, so that a chunk spans several blocks."""
    monkeypatch.setattr(pgloss.vocab.entropy, "_BLOCK_ELEMENTS", 3 * V)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("beta", BETAS)
def test_from_logits_matches_the_loop(beta, tiles, temperature, small_blocks):
    student, teacher = logits_of(make(seed=1))
    student = (2.0 * student).requires_grad_()  # sharper distributions: the terms differ more
    out = divergence_from_logits(
        student,
        teacher,
        torch.ones(B, T, dtype=torch.bool),
        beta=beta,
        temperature=temperature,
        chunk_size=tiles[0],
        vocab_block=tiles[1],
    )
    (grad,) = torch.autograd.grad(out.per_token.sum(), student)
    for i in range(B):
        for t in range(T):
            s_row, t_row = student[i, t].tolist(), teacher[i, t].tolist()
            assert abs(float(out.per_token[i, t]) - loops.divergence(s_row, t_row, beta, temperature)) < 1e-12
            expected = torch.tensor(loops.divergence_grad(s_row, t_row, beta, temperature), dtype=torch.float64)
            torch.testing.assert_close(grad[i, t], expected, rtol=0, atol=1e-13)
    assert (out.per_token > 0).all()


def small(seed):
    """A problem small enough for gradcheck's finite differences: N = 6 tokens, V = 11, H = 4, H' = 3."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return r(2, 3, 4), r(11, 4), r(2, 3, 3), r(11, 3), torch.tensor([[True, True, False], [True, True, True]])


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("vocab_block", [None, 4])
def test_gradcheck_from_logits(beta, vocab_block):
    hidden, weight, teacher_hidden, teacher_weight, mask = small(2)
    teacher = teacher_hidden @ teacher_weight.t()

    def fn(s):
        return divergence_from_logits(
            s,
            teacher,
            mask,
            beta=beta,
            temperature=0.7,
            chunk_size=4,
            vocab_block=vocab_block,
        ).per_token

    assert torch.autograd.gradcheck(fn, ((hidden @ weight.t()).requires_grad_(),))


@pytest.mark.parametrize("beta", [0.0, 0.6, 1.0])
@pytest.mark.parametrize("vocab_block", [None, 4])
def test_gradcheck_from_hidden(beta, vocab_block):
    hidden, weight, teacher_hidden, teacher_weight, mask = small(3)

    def fn(h, w):
        return divergence_from_hidden(
            h,
            w,
            teacher_hidden,
            teacher_weight,
            mask,
            beta=beta,
            chunk_size=4,
            vocab_block=vocab_block,
        ).loss

    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_()))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("beta", BETAS)
def test_fused_equals_materialised(beta, tiles, temperature, small_blocks):
    """From hidden states and heads, chunked and tiled: the values and the student's hidden-state and head
    gradients of the materialised logits, to float64 rounding; the teacher gets no gradient."""
    x = make(seed=4)
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    teacher_hidden = x["teacher_hidden"].clone().requires_grad_()
    fused = divergence_from_hidden(
        hidden,
        weight,
        teacher_hidden,
        x["teacher_weight"],
        MASK,
        beta=beta,
        temperature=temperature,
        chunk_size=tiles[0],
        vocab_block=tiles[1],
    )
    (fused.per_token * x["upstream"]).sum().backward()
    h2, w2 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    materialised = divergence_from_logits(
        h2 @ w2.t(), x["teacher_hidden"] @ x["teacher_weight"].t(), MASK, beta=beta, temperature=temperature
    )
    (materialised.per_token * x["upstream"]).sum().backward()
    expected = torch.where(
        MASK, plain(h2 @ w2.t(), x["teacher_hidden"] @ x["teacher_weight"].t(), beta, temperature), 0.0
    )
    torch.testing.assert_close(fused.per_token, expected.detach(), rtol=0, atol=1e-13)
    torch.testing.assert_close(materialised.per_token, expected.detach(), rtol=0, atol=1e-13)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=0, atol=1e-13)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=0, atol=1e-13)
    torch.testing.assert_close(fused.loss, materialised.loss, rtol=0, atol=1e-14)
    assert teacher_hidden.grad is None
    assert hidden.grad[~MASK].abs().max() == 0 and hidden.grad[MASK].abs().max() > 0


@pytest.mark.parametrize("tiles", TILES)
def test_reverse_kl_is_full_kl(tiles):
    """β = 1 runs full_kl's statistic: the same numbers, bit for bit, from logits and from hidden states."""
    x = make(seed=5)
    student, teacher = logits_of(x)
    ones = torch.ones(B, T, dtype=torch.bool)
    ours = divergence_from_logits(
        student, teacher, ones, beta=1.0, temperature=0.7, chunk_size=tiles[0], vocab_block=tiles[1]
    ).per_token
    theirs = full_kl_from_logits(student, teacher, temperature=0.7, chunk_size=tiles[0], vocab_block=tiles[1])
    assert torch.equal(ours, theirs)
    ours = divergence_from_hidden(
        x["hidden"],
        x["weight"],
        x["teacher_hidden"],
        x["teacher_weight"],
        ones,
        beta=1.0,
        chunk_size=tiles[0],
        vocab_block=tiles[1],
    ).per_token
    theirs = full_kl_from_hidden(
        x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], chunk_size=tiles[0], vocab_block=tiles[1]
    )
    assert torch.equal(ours, theirs)
    # and β = 0 is full_kl with the roles swapped (the gradient then goes to the other argument)
    forward = divergence_from_logits(student, teacher, ones, beta=0.0, chunk_size=tiles[0], vocab_block=tiles[1])
    torch.testing.assert_close(forward.per_token, full_kl_from_logits(teacher, student), rtol=0, atol=1e-14)


def test_the_ends_are_the_limits_of_jsd():
    """GKD: JSD(β)/β → KL(p_T‖p_S) as β → 0 and JSD(β)/(1 − β) → KL(p_S‖p_T) as β → 1; JSD(½) is symmetric;
    JSD(β) is at most the binary entropy H(β), reached by disjoint supports; every divergence is 0 for equal
    distributions."""
    student, teacher = logits_of(make(seed=6))
    ones = torch.ones(B, T, dtype=torch.bool)
    d = lambda s, t, beta: divergence_from_logits(s, t, ones, beta=beta, chunk_size=4).per_token  # noqa: E731
    eps = 1e-9  # the gap is O(β χ²(p_T‖p_S)): about 3e-4 relative at β = 1e-6 here
    torch.testing.assert_close(d(student, teacher, eps) / eps, d(student, teacher, 0.0), rtol=1e-5, atol=0)
    torch.testing.assert_close(d(student, teacher, 1 - eps) / eps, d(student, teacher, 1.0), rtol=1e-5, atol=0)
    torch.testing.assert_close(d(student, teacher, 0.5), d(teacher, student, 0.5), rtol=0, atol=1e-15)
    for beta in (0.1, 0.5, 0.9):  # bounded by the binary entropy H(β) (log 2 at ½), approached as the supports part
        bound = -beta * math.log(beta) - (1 - beta) * math.log1p(-beta)
        assert (d(student, teacher, beta) <= bound).all()
        apart = torch.full((1, 1, V), -1e3, dtype=torch.float64)
        there = apart.clone()
        apart[..., 0], there[..., 1] = 0.0, 0.0
        parted = divergence_from_logits(apart, there, torch.ones(1, 1, dtype=torch.bool), beta=beta).per_token
        assert abs(float(parted[0, 0]) - bound) < 1e-12
    for beta in BETAS:
        assert d(student, student, beta).abs().max() < 1e-14


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("vocab_block", [None, 10])
def test_masked_positions_give_zero_value_and_gradient(beta, vocab_block):
    """Padding with huge (finite) logits: 0 there, in the value and in the gradient; the loss is the
    token-mean over the valid positions; a batch with no valid token has loss 0 and zero gradient."""
    student, teacher = logits_of(make(seed=7))
    student, teacher = student.clone(), teacher.clone()
    student[~MASK] = 1e4 * torch.linspace(-1, 1, V, dtype=torch.float64)
    teacher[~MASK] = -3e3
    student.requires_grad_()
    out = divergence_from_logits(student, teacher, MASK.long(), beta=beta, chunk_size=4, vocab_block=vocab_block)
    (grad,) = torch.autograd.grad(out.loss, student)
    assert (out.per_token[~MASK] == 0).all() and (grad[~MASK] == 0).all()
    valid = plain(student.detach(), teacher, beta)[MASK]
    torch.testing.assert_close(out.loss, valid.mean(), rtol=0, atol=1e-14)
    torch.testing.assert_close(out.metrics["divergence"], valid.mean(), rtol=0, atol=1e-14)
    assert out.metrics["divergence"].grad_fn is None
    empty = divergence_from_logits(student, teacher, torch.zeros(B, T, dtype=torch.bool), beta=beta, chunk_size=4)
    (grad,) = torch.autograd.grad(empty.loss, student)
    assert float(empty.loss) == 0.0 and (grad == 0).all() and float(empty.metrics["divergence"]) == 0.0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_is_aggregate_and_micro_batches_sum_to_the_step(mode):
    """`loss` is `pgloss.aggregate` of `per_token` (TRL's reduction is token-mean: Σ D / valid tokens, and
    sum / num_items_in_batch over a step); micro-batches counted by one Normalizer add up to the whole call."""
    x = make(seed=8)
    hidden = x["hidden"].clone().requires_grad_()
    args = (x["weight"], x["teacher_hidden"], x["teacher_weight"])
    whole = divergence_from_hidden(hidden, *args, MASK, beta=0.4, loss_agg_mode=mode, chunk_size=4)
    torch.testing.assert_close(whole.loss, aggregate(whole.per_token, MASK, mode), rtol=0, atol=0)
    (g_whole,) = torch.autograd.grad(whole.loss, hidden)
    parts = [slice(0, 2), slice(2, 3)]
    normalizer = Normalizer.count(cut(MASK, parts))
    leaf = hidden.detach().clone().requires_grad_()
    total = micro_batches(
        lambda rows: divergence_from_hidden(
            leaf[rows],
            x["weight"],
            x["teacher_hidden"][rows],
            x["teacher_weight"],
            MASK[rows],
            beta=0.4,
            loss_agg_mode=mode,
            normalizer=normalizer,
            chunk_size=4,
        ),
        parts,
    )
    torch.testing.assert_close(total, whole.loss.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(leaf.grad, g_whole, rtol=0, atol=1e-14)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("vocab_block", [None, 10])
def test_meta_tensors(beta, vocab_block):
    """The whole call, forward and backward, on meta tensors: nothing reads a value on the host."""
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    hidden, weight = meta(B, T, H).requires_grad_(), meta(V, H).requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool, device="meta")
    out = divergence_from_hidden(
        hidden, weight, meta(B, T, H_T), meta(V, H_T), mask, beta=beta, chunk_size=4, vocab_block=vocab_block
    )
    assert out.per_token.shape == (B, T) and out.per_token.device.type == "meta" and out.loss.shape == ()
    out.loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    student = meta(B, T, V).requires_grad_()
    out = divergence_from_logits(student, meta(B, T, V), mask, beta=beta, chunk_size=4, vocab_block=vocab_block)
    out.loss.backward()
    assert out.per_token.shape == (B, T) and student.grad.shape == student.shape


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_no_n_by_v_tensor_is_saved_for_backward(beta):
    x = make(seed=9)
    saved = []
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = divergence_from_hidden(
            hidden, weight, x["teacher_hidden"], x["teacher_weight"], MASK, beta=beta, chunk_size=4, vocab_block=10
        )
    assert saved and all(math.prod(s) < B * T * V for s in saved), saved
    out.loss.backward()
    assert torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_memory_budget_and_float32(beta):
    """A memory budget that forces vocabulary tiles gives the whole-vocabulary values; float32 inputs
    compute in float32 within its rounding of the float64 values."""
    x = make(seed=10)
    args = (x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], MASK)
    whole = divergence_from_hidden(*args, beta=beta).per_token
    budget = divergence_from_hidden(*args, beta=beta, memory_budget=4 * 8 * 6 * 5).per_token  # a few columns a tile
    torch.testing.assert_close(budget, whole, rtol=0, atol=1e-13)
    single = divergence_from_hidden(*(a.float() for a in args[:4]), MASK, beta=beta, chunk_size=4).per_token
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), whole, rtol=1e-5, atol=1e-6)


def test_banned_tokens_of_both_models_contribute_zero():
    student, teacher = logits_of(make(seed=11))
    banned_s, banned_t = student.clone(), teacher.clone()
    banned_s[..., :3] = -torch.inf
    banned_t[..., :3] = -torch.inf
    for beta in BETAS:
        for vocab_block in (None, 10):
            out = divergence_from_logits(banned_s, banned_t, MASK, beta=beta, vocab_block=vocab_block).per_token
            expected = torch.where(MASK, plain(student[..., 3:], teacher[..., 3:], beta), 0.0)
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-13)


def test_bad_input_names_the_argument():
    x = make()
    student, teacher = logits_of(x)
    args = (x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], MASK)
    for beta in (-0.1, 1.5, math.nan):
        with pytest.raises(ValueError, match="beta must"):
            divergence_from_logits(student, teacher, MASK, beta=beta)
    for beta in ("0.5", True, None):
        with pytest.raises(TypeError, match="beta must be a real number"):
            divergence_from_hidden(*args, beta=beta)
    for temperature in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="temperature must be"):
            divergence_from_logits(student, teacher, MASK, beta=0.5, temperature=temperature)
    with pytest.raises(ValueError, match="teacher_logits must have the shape of student_logits"):
        divergence_from_logits(student, teacher[..., :-1], MASK, beta=0.5)
    with pytest.raises(ValueError, match=r"student_logits must have shape \[B, T, V\]"):
        divergence_from_logits(student[0], teacher[0], MASK, beta=0.5)
    with pytest.raises(TypeError, match="teacher_logits must be a Tensor"):
        divergence_from_logits(student, teacher.tolist(), MASK, beta=0.5)
    with pytest.raises(ValueError, match="mask must have shape"):
        divergence_from_logits(student, teacher, MASK[:, :-1], beta=0.5)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        divergence_from_logits(student, teacher, MASK.long() * 2, beta=0.5)
    with pytest.raises(ValueError, match="weight and teacher_weight must share a vocabulary"):
        divergence_from_hidden(*args[:3], x["teacher_weight"][:-1], MASK, beta=0.5)
    with pytest.raises(ValueError, match="teacher_weight must have shape"):
        divergence_from_hidden(*args[:3], x["weight"], MASK, beta=0.5)
    with pytest.raises(ValueError, match="teacher_hidden must have shape"):
        divergence_from_hidden(
            x["hidden"], x["weight"], x["teacher_hidden"][:, :-1], x["teacher_weight"], MASK, beta=0.5
        )
    with pytest.raises(ValueError, match="loss_agg_mode"):
        divergence_from_hidden(*args, beta=0.5, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="memory_budget and chunk_size are exclusive"):
        divergence_from_hidden(*args, beta=0.5, chunk_size=4, memory_budget=1 << 20)


# --- TRL 1.16 on the same inputs --------------------------------------------------------------------------


def trl_generalized_jsd_loss():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's experimental-module warning
        gkd = pytest.importorskip("trl.experimental.gkd")
    return gkd.GKDTrainer.generalized_jsd_loss


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_parity_with_trl_generalized_jsd_loss(dtype, beta, temperature):
    """TRL's GKDTrainer.generalized_jsd_loss on materialised logits with labels (-100 at padding): its
    elementwise terms summed over the vocabulary are our per-token values at the valid positions, and its
    "batchmean" (Σ / valid tokens) is our token-mean loss, with the same gradient."""
    gjsd = trl_generalized_jsd_loss()
    student, teacher = (z.to(dtype) for z in logits_of(make(seed=13)))
    labels = torch.where(MASK, 1, -100)
    s1, s2 = student.clone().requires_grad_(), student.clone().requires_grad_()
    theirs_per_token = gjsd(s1, teacher, labels=labels, beta=beta, temperature=temperature, reduction="none").sum(-1)
    theirs = gjsd(s1, teacher, labels=labels, beta=beta, temperature=temperature)
    ours = divergence_from_logits(s2, teacher, MASK, beta=beta, temperature=temperature, chunk_size=4, vocab_block=10)
    (g_theirs,) = torch.autograd.grad(theirs, s1)
    (g_ours,) = torch.autograd.grad(ours.loss, s2)
    tol = dict(rtol=0, atol=1e-14) if dtype == torch.float64 else dict(rtol=2e-6, atol=5e-6)
    torch.testing.assert_close(ours.per_token[MASK], theirs_per_token.detach(), **tol)
    torch.testing.assert_close(ours.loss, theirs.detach(), **tol)
    torch.testing.assert_close(g_ours, g_theirs, **(tol if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-6)))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_bfloat16_heads_compute_in_float32(beta):
    """Half-precision hidden states and heads (the teacher's too): the matmuls run in bfloat16, the divergence
    in float32, equal to the float64 divergence of the bfloat16 logits to bfloat16 matmul rounding."""
    x = {k: v.to(torch.bfloat16) for k, v in make(seed=14).items()}
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    out = divergence_from_hidden(
        hidden, weight, x["teacher_hidden"], x["teacher_weight"], MASK, beta=beta, chunk_size=4, vocab_block=10
    )
    out.loss.backward()
    assert out.per_token.dtype == torch.float32 and weight.grad.dtype == torch.bfloat16
    expected = plain(
        hidden.detach().double() @ weight.detach().double().t(),
        x["teacher_hidden"].double() @ x["teacher_weight"].double().t(),
        beta,
    )
    # measured: within 0.2% relative (bfloat16 logits carry 8 bits)
    torch.testing.assert_close(out.per_token.double(), torch.where(MASK, expected, 0.0), rtol=5e-3, atol=1e-3)
    assert torch.isfinite(hidden.grad.float()).all() and hidden.grad[MASK].abs().max() > 0


@pytest.mark.compile
@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_compiles_whole_forward_and_backward(beta):
    """torch.compile(fullgraph=True) of the call over vocabulary tiles (a host read or an untraceable call
    would fail here; JSD(β) with its first run for the log-normalisers), with the eager loss and gradient.
    Each case from a reset: a β that changes between compiles of one function makes it a symbolic float,
    which the checks of β and τ (math.isfinite) cannot read."""
    hidden, weight, teacher_hidden, teacher_weight, mask = small(15)
    hidden, weight, teacher_hidden, teacher_weight = (
        t.float() for t in (hidden, weight, teacher_hidden, teacher_weight)
    )

    def call(h, w):
        return divergence_from_hidden(
            h,
            w,
            teacher_hidden,
            teacher_weight,
            mask,
            beta=beta,
            chunk_size=4,
            vocab_block=4,
        ).loss

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="inductor")
    (h1, w1), (h2, w2) = [(hidden.clone().requires_grad_(), weight.clone().requires_grad_()) for _ in range(2)]
    loss = compiled(h1, w1)
    loss.backward()
    expected = call(h2, w2)
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)
