"""The divergences beside JSD(β) (vocab/skewed.py, vocab/adaptive_kl.py): DistiLLM's skewed forward and reverse KL and
AKL, through `divergence_from_logits` / `divergence_from_hidden` with `divergence=`, against the float64 loops from the
papers (loops/divergences.py), gradcheck, the materialised logits, tiles against whole rows, micro-batches, and ROLL's
own functions (test_divergences_roll.py); AKL's head search over tiles in test_adaptive_kl.py.
"""

import math

import loops
import pytest
import torch
from properties.micro_batches import cut, micro_batches
from vocab.head_checks import assert_compiles_like_eager

import pgloss
from pgloss.core.normalizer import Normalizer
from pgloss.vocab import backends
from pgloss.vocab.divergence import divergence_from_hidden, divergence_from_logits

B, T, H, H_T, V = 3, 5, 8, 6, 37
MASK = torch.arange(T)[None, :] < torch.tensor([5, 3, 1])[:, None]
ONES = torch.ones(B, T, dtype=torch.bool)
# (divergence, its parameter): both skews' ends of interest, and μ from a small head to most of the mass
CASES = [
    ("skewed_forward", dict(skew=0.1)),
    ("skewed_forward", dict(skew=0.6)),
    ("skewed_reverse", dict(skew=0.1)),
    ("skewed_reverse", dict(skew=0.6)),
    ("adaptive", dict(mu=0.5)),
    ("adaptive", dict(mu=0.2)),
    ("adaptive", dict(mu=0.9)),
]
SKEWED = [case for case in CASES if case[0] != "adaptive"]
# (tokens per chunk, vocabulary columns per tile): neither divides N = 15 nor V = 37; None is the whole vocabulary.
TILES = [(4, None), (4, 10), (7, 13), (15, 1)]


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


def oracle(name, params, student_row, teacher_row, temperature):
    """(value, gradient to the student's logits) of the loop at one position."""
    if name == "adaptive":
        return (
            loops.akl(student_row, teacher_row, params["mu"], temperature),
            loops.akl_grad(student_row, teacher_row, params["mu"], temperature),
        )
    reverse = name == "skewed_reverse"
    return (
        loops.skewed_kl(student_row, teacher_row, params["skew"], reverse, temperature),
        loops.skewed_kl_grad(student_row, teacher_row, params["skew"], reverse, temperature),
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_from_logits_matches_the_loop(case, temperature):
    name, params = case
    x = make(seed=1)
    student = (2.0 * x["hidden"] @ x["weight"].t()).requires_grad_()  # sharper: the terms differ more
    teacher = 2.0 * x["teacher_hidden"] @ x["teacher_weight"].t()
    for chunk, block in TILES:
        out = divergence_from_logits(
            student,
            teacher,
            ONES,
            divergence=name,
            temperature=temperature,
            chunk_size=chunk,
            vocab_block=block,
            **params,
        )
        (grad,) = torch.autograd.grad(out.per_token.sum(), student)
        values = out.per_token.detach()
        for i in range(B):
            for t in range(T):
                value, expected = oracle(name, params, student[i, t].tolist(), teacher[i, t].tolist(), temperature)
                assert abs(float(values[i, t]) - value) < 1e-12
                torch.testing.assert_close(grad[i, t], torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-13)
        assert (out.per_token > 0).all()


def test_akl_oracle_gradient_is_the_derivative_with_the_weights_held():
    """The loop's AKL gradient is the central finite difference of its value with the gap weights held fixed (AKL's
    weights are constants of the gradient: ROLL and the paper's code detach them), and each weight pair sums to 1."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(4):
        student, teacher = (2 * torch.randn(9, generator=gen, dtype=torch.float64)).tolist(), torch.randn(9).tolist()
        for mu in (0.3, 0.5, 0.8):
            weights = loops.akl_weights(student, teacher, mu, 0.7)
            assert abs(sum(weights) - 1) < 1e-15 and min(weights) > 0
            grad = loops.akl_grad(student, teacher, mu, 0.7)
            for v in range(9):
                up, down = list(student), list(student)
                up[v], down[v] = up[v] + 1e-6, down[v] - 1e-6
                numeric = (loops.akl(up, teacher, mu, 0.7, weights) - loops.akl(down, teacher, mu, 0.7, weights)) / 2e-6
                assert abs(numeric - grad[v]) < 1e-8


def test_the_head_reaches_mu():
    """AKL's head is the shortest prefix of the teacher's sorted tokens whose mass reaches μ: with the teacher's
    probabilities (0.4, 0.3, 0.2, 0.1) and the student's (0.1, 0.5, 0.3, 0.1), gaps (0.3, 0.2, 0.1, 0), μ = 0.39 takes
    the first token, 0.41 and 0.5 two, 0.75 three; the value is the gap shares' mixture of the forward and reverse KL."""
    p, q = [0.4, 0.3, 0.2, 0.1], [0.1, 0.5, 0.3, 0.1]
    teacher = torch.log(torch.tensor(p, dtype=torch.float64)).view(1, 1, 4)
    student = torch.log(torch.tensor(q, dtype=torch.float64)).view(1, 1, 4)
    forward = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    reverse = sum(b * math.log(b / a) for a, b in zip(p, q, strict=True))
    for mu, w_head in ((0.39, 0.5), (0.41, 5 / 6), (0.5, 5 / 6), (0.75, 1.0)):
        out = divergence_from_logits(student, teacher, torch.ones(1, 1), divergence="adaptive", mu=mu)
        assert abs(float(out.per_token) - (w_head * forward + (1 - w_head) * reverse)) < 1e-14
        assert abs(loops.akl_weights(student.view(-1).tolist(), teacher.view(-1).tolist(), mu)[0] - w_head) < 1e-15


def test_ties_at_the_boundary_all_join_the_head():
    """Teacher tokens tied with the last head token are in the head together, whatever order a sort gives them."""
    teacher = torch.log(torch.tensor([0.4, 0.2, 0.2, 0.2], dtype=torch.float64)).view(1, 1, 4)
    student = torch.log(torch.tensor([0.1, 0.5, 0.3, 0.1], dtype=torch.float64)).view(1, 1, 4)
    p, q = [0.4, 0.2, 0.2, 0.2], [0.1, 0.5, 0.3, 0.1]
    forward = sum(a * math.log(a / b) for a, b in zip(p, q, strict=True))
    reverse = sum(b * math.log(b / a) for a, b in zip(p, q, strict=True))
    out = divergence_from_logits(student, teacher, torch.ones(1, 1), divergence="adaptive", mu=0.5).per_token
    assert abs(float(out) - forward) < 1e-14  # every token in the head: w_head = 1
    out = divergence_from_logits(student, teacher, torch.ones(1, 1), divergence="adaptive", mu=0.3).per_token
    w_head = 0.3 / 0.8  # the first token alone: its gap 0.3 of 0.8
    assert abs(float(out) - (w_head * forward + (1 - w_head) * reverse)) < 1e-14


def test_equal_distributions_give_zero():
    x = make(seed=3)
    logits = x["hidden"] @ x["weight"].t()
    for name, params in CASES:
        student = logits.clone().requires_grad_()
        out = divergence_from_logits(student, logits, ONES, divergence=name, **params)
        (grad,) = torch.autograd.grad(out.loss, student)
        assert out.per_token.abs().max() < 1e-15 and grad.abs().max() < 1e-15
        assert torch.isfinite(out.per_token).all()


def small(seed):
    """A problem small enough for gradcheck's finite differences: N = 6 tokens, V = 11, H = 4, H' = 3."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return r(2, 3, 4), r(11, 4), r(11), r(2, 3, 3), r(11, 3), r(11), torch.tensor([[True, True, False], [True] * 3])


@pytest.mark.parametrize("vocab_block", [None, 4])
@pytest.mark.parametrize("case", SKEWED, ids=str)
def test_gradcheck(case, vocab_block):
    """The skewed KLs from logits and, with every head option, from hidden states (AKL's weights are constants of
    its gradient, not of its value: its gradient is checked against the loop, whose own finite differences hold the
    weights, above)."""
    name, params = case
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask = small(4)
    teacher = teacher_hidden @ teacher_weight.t()
    sizes = dict(divergence=name, temperature=0.7, chunk_size=4, vocab_block=vocab_block, **params)
    logits = (hidden @ weight.t()).requires_grad_()
    assert torch.autograd.gradcheck(lambda s: divergence_from_logits(s, teacher, mask, **sizes).per_token, (logits,))
    heads = dict(
        teacher_head=pgloss.HeadOptions(teacher_bias, logit_scale=0.7, softcap=2.0),
    )

    def fn(h, w, b):
        head = pgloss.HeadOptions(b, logit_scale=1.3, softcap=1.5)
        return divergence_from_hidden(h, w, teacher_hidden, teacher_weight, mask, head=head, **heads, **sizes).loss

    assert torch.autograd.gradcheck(fn, (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()))


OPTIONS = {
    "plain": ({}, {}),
    "all": (dict(logit_scale=0.8, softcap=3.0), dict(logit_scale=1.25, softcap=2.0)),
}


@pytest.mark.parametrize("options", list(OPTIONS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_from_hidden_equals_from_logits(case, options):
    """From hidden states and heads (biases, scales, soft-caps), chunked and tiled: the values and the student's
    hidden-state, weight and bias gradients of the materialised logits, to float64 rounding; tiles equal whole rows."""
    name, params = case
    x = make(seed=5)
    student_opts, teacher_opts = OPTIONS[options]
    teacher_head = pgloss.HeadOptions(x["teacher_bias"], **teacher_opts)
    h2, w2, b2 = (x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    raw = h2 @ w2.t() + b2
    logits = raw if not student_opts else student_opts["softcap"] * torch.tanh(0.8 * raw / student_opts["softcap"])
    raw_t = x["teacher_hidden"] @ x["teacher_weight"].t() + x["teacher_bias"]
    teacher = (
        raw_t if not teacher_opts else teacher_opts["softcap"] * torch.tanh(1.25 * raw_t / teacher_opts["softcap"])
    )
    expected = divergence_from_logits(logits, teacher, MASK, divergence=name, temperature=0.7, **params)
    (expected.per_token * x["upstream"]).sum().backward()
    for chunk, block in TILES:
        h, w, b = (x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        out = divergence_from_hidden(
            h,
            w,
            x["teacher_hidden"],
            x["teacher_weight"],
            MASK,
            divergence=name,
            temperature=0.7,
            head=pgloss.HeadOptions(b, **student_opts),
            teacher_head=teacher_head,
            chunk_size=chunk,
            vocab_block=block,
            **params,
        )
        (out.per_token * x["upstream"]).sum().backward()
        torch.testing.assert_close(out.per_token, expected.per_token.detach(), rtol=0, atol=1e-13)
        for ours, theirs in ((h, h2), (w, w2), (b, b2)):
            torch.testing.assert_close(ours.grad, theirs.grad, rtol=0, atol=1e-13)
        assert h.grad[~MASK].abs().max() == 0 and h.grad[MASK].abs().max() > 0


@pytest.mark.parametrize("case", CASES, ids=str)
def test_micro_batches_with_a_normalizer_add_up_to_one_call(case):
    name, params = case
    x = make(seed=6)
    args = (x["weight"], x["teacher_hidden"], x["teacher_weight"])
    hidden = x["hidden"].clone().requires_grad_()
    block = 10
    whole = divergence_from_hidden(hidden, *args, MASK, divergence=name, chunk_size=4, vocab_block=block, **params)
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
            divergence=name,
            normalizer=normalizer,
            chunk_size=4,
            vocab_block=block,
            **params,
        ),
        parts,
    )
    torch.testing.assert_close(total, whole.loss.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(leaf.grad, g_whole, rtol=0, atol=1e-14)
    torch.testing.assert_close(whole.loss, whole.per_token[MASK].mean(), rtol=0, atol=1e-15)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_memory_budget_meta_tensors_and_nothing_n_by_v_saved(case):
    """A budget that tiles the vocabulary gives the whole-row values; the call
    runs on meta tensors (no value read on the host); nothing of N x V is saved for backward; float32 computes in
    float32 within its rounding of float64."""
    name, params = case
    x = make(seed=7)
    args = (x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], MASK)
    whole = divergence_from_hidden(*args, divergence=name, **params).per_token
    saved = []
    hidden = x["hidden"].clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        budget = divergence_from_hidden(hidden, *args[1:], divergence=name, memory_budget=4 * 8 * 6 * 5, **params)
    budget.loss.backward()
    torch.testing.assert_close(budget.per_token, whole, rtol=0, atol=1e-13)
    assert saved and all(math.prod(s) < B * T * V for s in saved), saved
    single = divergence_from_hidden(*(a.float() for a in args[:4]), MASK, divergence=name, **params).per_token
    assert single.dtype == torch.float32
    torch.testing.assert_close(single.double(), whole, rtol=1e-5, atol=1e-6)
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    h, w = meta(B, T, H).requires_grad_(), meta(V, H).requires_grad_()
    out = divergence_from_hidden(
        h, w, meta(B, T, H_T), meta(V, H_T), MASK.to("meta"), divergence=name, chunk_size=4, **params
    )
    out.loss.backward()
    assert out.per_token.shape == (B, T) and h.grad.shape == h.shape and w.grad.shape == w.shape


def test_banned_tokens():
    """Tokens both models ban add nothing; where only the student bans one, the skewed forward KL's term is
    p_T log(1/λ) (finite: the mixture keeps the teacher's mass), as the loop gives it."""
    x = make(seed=8)
    student, teacher = x["hidden"] @ x["weight"].t(), x["teacher_hidden"] @ x["teacher_weight"].t()
    banned_s, banned_t = student.clone(), teacher.clone()
    banned_s[..., :3], banned_t[..., :3] = -torch.inf, -torch.inf
    for name, params in CASES:
        for block in (None, 10):
            out = divergence_from_logits(banned_s, banned_t, MASK, divergence=name, vocab_block=block, **params)
            expected = divergence_from_logits(student[..., 3:], teacher[..., 3:], MASK, divergence=name, **params)
            torch.testing.assert_close(out.per_token, expected.per_token, rtol=0, atol=1e-13)
    only = student.clone()
    only[..., 0] = -torch.inf
    for block in (None, 10):
        out = divergence_from_logits(only, teacher, ONES, divergence="skewed_forward", skew=0.1, vocab_block=block)
        for i, t in ((0, 0), (2, 4)):
            row = only[i, t].tolist()
            row[0] = -1e30  # the loop's π_S = 0 there
            expected = loops.skewed_kl(row, teacher[i, t].tolist(), 0.1)
            assert abs(float(out.per_token[i, t]) - expected) < 1e-12


def test_bad_input_names_the_argument():
    x = make()
    student, teacher = x["hidden"] @ x["weight"].t(), x["teacher_hidden"] @ x["teacher_weight"].t()
    call = lambda **kw: divergence_from_logits(student, teacher, MASK, **kw)  # noqa: E731
    with pytest.raises(ValueError, match="divergence must be one of"):
        call(divergence="js")
    with pytest.raises(TypeError, match="divergence must be a str"):
        call(divergence=1)
    for skew in (0.0, 1.0, -0.5, math.nan):
        with pytest.raises(ValueError, match="skew must"):
            call(divergence="skewed_forward", skew=skew)
    with pytest.raises(TypeError, match="skew must be a real number"):
        call(divergence="skewed_reverse", skew="0.1")
    for mu in (0.0, 1.0, 2.0):
        with pytest.raises(ValueError, match="mu must be in"):
            call(divergence="adaptive", mu=mu)
    with pytest.raises(ValueError, match="skew does not apply to divergence='adaptive'"):
        call(divergence="adaptive", skew=0.1)
    with pytest.raises(ValueError, match="mu does not apply to divergence='skewed_forward'"):
        call(divergence="skewed_forward", mu=0.5)
    with pytest.raises(ValueError, match="beta does not apply to divergence='forward'"):
        call(divergence="forward", beta=0.0)
    with pytest.raises(ValueError, match="skew does not apply to divergence='jsd'"):
        call(beta=0.5, skew=0.1)
    with pytest.raises(ValueError, match='divergence="jsd" needs beta'):
        call(divergence="jsd")
    with pytest.raises(TypeError, match="beta must be a real number"):
        call()
    hidden_args = (x["hidden"], x["weight"], x["teacher_hidden"], x["teacher_weight"], MASK)
    for name in ("skewed_forward", "adaptive"):  # no kernel holds them: the kernel route refuses them by name
        with backends.use("kernel"), pytest.raises(ValueError, match="SkewedKL|AdaptiveKL"):
            divergence_from_hidden(*(a.float() for a in hidden_args[:4]), MASK, divergence=name)


def test_named_ends_are_the_old_betas():
    """divergence="forward" / "reverse" / "jsd" are β = 0 / 1 / β, bit for bit."""
    x = make(seed=9)
    student, teacher = x["hidden"] @ x["weight"].t(), x["teacher_hidden"] @ x["teacher_weight"].t()
    for named, beta in ((dict(divergence="forward"), 0.0), (dict(divergence="reverse"), 1.0)):
        for block in (None, 10):
            ours = divergence_from_logits(student, teacher, MASK, vocab_block=block, **named).per_token
            assert torch.equal(
                ours, divergence_from_logits(student, teacher, MASK, beta=beta, vocab_block=block).per_token
            )
    ours = divergence_from_logits(student, teacher, MASK, divergence="jsd", beta=0.3, vocab_block=10).per_token
    assert torch.equal(ours, divergence_from_logits(student, teacher, MASK, beta=0.3, vocab_block=10).per_token)
    # the skew's limits: λ → 0 the plain KLs
    for name, plain in (("skewed_forward", 0.0), ("skewed_reverse", 1.0)):
        skewed = divergence_from_logits(student, teacher, MASK, divergence=name, skew=1e-9).per_token
        torch.testing.assert_close(
            skewed, divergence_from_logits(student, teacher, MASK, beta=plain).per_token, rtol=1e-6, atol=0
        )


@pytest.mark.compile
@pytest.mark.parametrize("name", ["skewed_reverse", "adaptive"])
def test_compiles_whole_forward_and_backward(name):
    """torch.compile(fullgraph=True) over vocabulary tiles with every head option (AKL's head search included), with
    the eager loss and gradients."""
    hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, mask = (t.float() for t in small(7))
    teacher_head = pgloss.HeadOptions(teacher_bias, logit_scale=0.7, softcap=2.0)

    def call(h, w, b):
        head = pgloss.HeadOptions(b, logit_scale=1.3, softcap=1.5)
        return divergence_from_hidden(
            h,
            w,
            teacher_hidden,
            teacher_weight,
            mask,
            divergence=name,
            head=head,
            teacher_head=teacher_head,
            chunk_size=4,
            vocab_block=4,
        ).loss

    assert_compiles_like_eager(call, [hidden, weight, bias])
