"""A student's divergence from a teacher (vocab/divergence.py): forward KL, reverse KL and JSD_β from
logits and from both models' hidden states, against a float64 loop, plain torch and TRL 1.16.

Measured against TRL 1.16 on the same inputs (B = 3, T = 5, V = 37, β ∈ {0, 0.1, 0.5, 0.9, 1}, τ ∈
{1, 0.7}, 6 seeds): `GKDTrainer.generalized_jsd_loss(reduction="none")` summed over the vocabulary, in
float64: the divergence within 8.9e-15 and its gradient within 3.2e-14. `ChunkedDivergenceFunction`
(its torch path, which computes in float32), from hidden states and heads in float32: the divergence
within 4.8e-6 (2.8e-7 of the largest value, 16.7) and the gradients of the hidden states and the head
within 3.6e-5 (4.9e-6 of the largest, 7.4); both are that far from the float64 result (pgloss 4.9e-6
and 2.6e-5, TRL 3.9e-6 and 1.4e-5): float32 rounding.
"""

import math

import pytest
import torch

import loops
import pgloss
import pgloss.vocab.entropy
from pgloss.vocab.divergence import divergence_from_hidden, divergence_from_logits
from pgloss.vocab.full_kl import full_kl_from_logits

B, T, H, H_TEACHER, V = 3, 5, 8, 6, 37
BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def plain(logits, teacher_logits, beta, temperature=1.0):
    """The divergence on materialised float64 logits, as TRL's generalized_jsd_loss writes it."""
    log_p = torch.log_softmax(logits.double() / temperature, -1)
    log_q = torch.log_softmax(teacher_logits.double() / temperature, -1)
    if beta == 0:
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    if beta == 1:
        return (log_p.exp() * (log_p - log_q)).sum(-1)
    log_m = torch.logsumexp(torch.stack([log_p + math.log1p(-beta), log_q + math.log(beta)]), 0)
    return beta * (log_q.exp() * (log_q - log_m)).sum(-1) + (1 - beta) * (log_p.exp() * (log_p - log_m)).sum(-1)


def make(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    return dict(hidden=r(B, T, H), weight=r(V, H, scale=0.7), teacher_hidden=r(B, T, H_TEACHER),
                teacher_weight=r(V, H_TEACHER, scale=0.7), upstream=r(B, T))


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(pgloss.vocab.entropy, "_BLOCK_ELEMENTS", 3 * V)


@pytest.mark.parametrize("beta", BETAS)
def test_one_position_matches_the_loop(beta):
    gen = torch.Generator().manual_seed(1)
    student, teacher = (torch.randn(2, V, generator=gen, dtype=torch.float64) for _ in range(2))
    got = divergence_from_logits(student, teacher, beta=beta, temperature=0.7)
    expected = [loops.divergence(a, b, beta, 0.7) for a, b in zip(student.tolist(), teacher.tolist())]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert (got > 0).all()
    same = divergence_from_logits(student, student, beta=beta)
    torch.testing.assert_close(same, torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-14)


def test_the_ends_are_the_two_kls_and_jsd_is_bounded():
    gen = torch.Generator().manual_seed(2)
    student, teacher = (3 * torch.randn(4, V, generator=gen, dtype=torch.float64) for _ in range(2))
    torch.testing.assert_close(divergence_from_logits(student, teacher, beta=1.0), full_kl_from_logits(student, teacher),
                               rtol=0, atol=0)  # the reverse KL is full_kl's statistic
    torch.testing.assert_close(divergence_from_logits(student, teacher, beta=0.0), full_kl_from_logits(teacher, student),
                               rtol=1e-13, atol=1e-14)
    for beta in (0.1, 0.5, 0.9):  # JSD_β ≤ H(β) (β·log(1/β) + (1 − β)·log(1/(1 − β))), 0 for equal models
        bound = -(beta * math.log(beta) + (1 - beta) * math.log1p(-beta))
        assert (divergence_from_logits(student, teacher, beta=beta) <= bound + 1e-12).all()


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("sizes", [dict(), dict(chunk_size=4), dict(chunk_size=4, vocab_block=10)],
                         ids=["whole", "chunks", "tiles"])
def test_from_logits_value_and_gradient(beta, temperature, sizes, small_blocks):
    x = make()
    logits = (x["hidden"] @ x["weight"].t()).requires_grad_()
    teacher = x["teacher_hidden"] @ x["teacher_weight"].t()
    got = divergence_from_logits(logits, teacher, beta=beta, temperature=temperature, **sizes)
    (got * x["upstream"]).sum().backward()
    plain_logits = logits.detach().clone().requires_grad_()
    expected = plain(plain_logits, teacher, beta, temperature)
    (expected * x["upstream"]).sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad, plain_logits.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("sizes", [dict(chunk_size=4), dict(chunk_size=100), dict(chunk_size=4, vocab_block=10)],
                         ids=["chunks", "one-chunk", "tiles"])
def test_from_hidden_equals_materialised_logits(beta, sizes, small_blocks):
    x = make(seed=2)
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    got = divergence_from_hidden(hidden, weight, x["teacher_hidden"], x["teacher_weight"], beta=beta,
                                 temperature=0.7, **sizes)
    (got * x["upstream"]).sum().backward()
    h2, w2 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    expected = plain(h2 @ w2.t(), x["teacher_hidden"] @ x["teacher_weight"].t(), beta, 0.7)
    (expected * x["upstream"]).sum().backward()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_gradcheck(beta):
    x = make(seed=3)
    teacher = x["teacher_hidden"] @ x["teacher_weight"].t()
    assert torch.autograd.gradcheck(lambda z: divergence_from_logits(z, teacher, beta=beta, chunk_size=4),
                                    ((x["hidden"] @ x["weight"].t()).requires_grad_(),))
    fn = lambda h, w: divergence_from_hidden(h, w, x["teacher_hidden"], x["teacher_weight"], beta=beta,  # noqa: E731
                                             chunk_size=4, vocab_block=None if 0 < beta < 1 else 10)
    assert torch.autograd.gradcheck(fn, (x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()))


@pytest.mark.parametrize("beta", [0.0, 0.5])
def test_no_n_by_v_tensor_is_saved_and_the_teacher_gets_no_gradient(beta):
    x = make(seed=4)
    saved = []
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    teacher_hidden = x["teacher_hidden"].clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        got = divergence_from_hidden(hidden, weight, teacher_hidden, x["teacher_weight"], beta=beta, chunk_size=4)
    assert saved and all(math.prod(s) < B * T * V for s in saved), saved
    got.sum().backward()
    assert torch.isfinite(hidden.grad).all() and teacher_hidden.grad is None


@pytest.mark.parametrize("beta", BETAS)
def test_tokens_banned_by_both_models_contribute_zero(beta):
    gen = torch.Generator().manual_seed(5)
    student, teacher = (torch.randn(2, V, generator=gen, dtype=torch.float64) for _ in range(2))
    banned_student, banned_teacher = student.clone(), teacher.clone()
    banned_student[:, :3] = -torch.inf
    banned_teacher[:, :3] = -torch.inf
    got = divergence_from_logits(banned_student, banned_teacher, beta=beta)
    torch.testing.assert_close(got, plain(student[:, 3:], teacher[:, 3:], beta), rtol=0, atol=1e-12)


def test_masked_positions_aggregate_to_the_valid_tokens_only():
    x = make(seed=6)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 2, 0])[:, None]
    logits = (x["hidden"] @ x["weight"].t()).requires_grad_()
    per_token = divergence_from_logits(logits, x["teacher_hidden"] @ x["teacher_weight"].t(), beta=0.5)
    loss = pgloss.aggregate(torch.where(mask, per_token, 0.0), mask, "token-mean")
    loss.backward()
    torch.testing.assert_close(loss, per_token[mask].mean(), rtol=0, atol=1e-14)
    assert not logits.grad[~mask].any()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_with_the_step_normalizer_add_up_to_one_call(mode):
    x = make(seed=9)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 2, 3])[:, None]

    def loss(hidden, rows, normalizer=None):
        per_token = divergence_from_hidden(hidden[rows], x["weight"], x["teacher_hidden"][rows], x["teacher_weight"],
                                           beta=0.5, chunk_size=4)
        return pgloss.aggregate(torch.where(mask[rows], per_token, 0.0), mask[rows], mode, normalizer=normalizer)

    whole_hidden, split_hidden = (x["hidden"].clone().requires_grad_() for _ in range(2))
    loss(whole_hidden, slice(0, 3)).backward()
    parts = [slice(0, 1), slice(1, 3)]
    normalizer = pgloss.Normalizer.count([mask[p] for p in parts])
    total = sum(loss(split_hidden, p, normalizer) for p in parts)
    total.backward()
    torch.testing.assert_close(total, loss(x["hidden"], slice(0, 3)), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(split_hidden.grad, whole_hidden.grad, rtol=1e-13, atol=1e-15)


def test_meta_tensors():
    meta = torch.device("meta")
    hidden = torch.empty(B, T, H, device=meta, requires_grad=True)
    got = divergence_from_hidden(hidden, torch.empty(V, H, device=meta), torch.empty(B, T, H_TEACHER, device=meta),
                                 torch.empty(V, H_TEACHER, device=meta), beta=0.5, chunk_size=4)
    assert got.shape == (B, T) and got.device == meta


def test_bad_input_names_the_argument():
    x = make()
    for beta in (-0.1, 1.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match="beta must be a number in \\[0, 1\\]"):
            divergence_from_logits(torch.zeros(2, V), torch.zeros(2, V), beta=beta)
    with pytest.raises(ValueError, match="teacher_logits must have the shape of logits"):
        divergence_from_logits(torch.zeros(2, V), torch.zeros(2, V + 1))
    with pytest.raises(ValueError, match="teacher_weight must have shape"):
        divergence_from_hidden(x["hidden"], x["weight"], x["teacher_hidden"], x["weight"])
    with pytest.raises(ValueError, match="teacher_hidden must have shape"):
        divergence_from_hidden(x["hidden"], x["weight"], x["teacher_hidden"][:, :-1], x["teacher_weight"])
    with pytest.raises(ValueError, match="temperature"):
        divergence_from_logits(torch.zeros(2, V), torch.zeros(2, V), temperature=0.0)


# -- TRL 1.16 ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trl_generalized_jsd_loss(beta, temperature):
    gkd = pytest.importorskip("trl.experimental.gkd.gkd_trainer")
    x = make(seed=7)
    logits = (x["hidden"] @ x["weight"].t()).requires_grad_()
    teacher = x["teacher_hidden"] @ x["teacher_weight"].t()
    ours = divergence_from_logits(logits, teacher, beta=beta, temperature=temperature)
    (ours * x["upstream"]).sum().backward()
    theirs_logits = logits.detach().clone().requires_grad_()
    theirs = gkd.GKDTrainer.generalized_jsd_loss(theirs_logits, teacher, beta=beta, temperature=temperature,
                                                  reduction="none").sum(-1)
    (theirs * x["upstream"]).sum().backward()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-13)
    torch.testing.assert_close(logits.grad, theirs_logits.grad, rtol=0, atol=1e-13)


@pytest.mark.parametrize("beta", BETAS)
def test_trl_chunked_divergence_function(beta):
    kernels = pytest.importorskip("trl.kernels.chunked_divergence")
    x = make(seed=8, dtype=torch.float32)
    n = B * T
    args = [x["hidden"].reshape(n, H), x["weight"], x["teacher_hidden"].reshape(n, H_TEACHER), x["teacher_weight"]]
    ours_h, ours_w = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
    ours = divergence_from_hidden(ours_h.view(B, T, H), ours_w, x["teacher_hidden"], x["teacher_weight"], beta=beta,
                                  temperature=0.7, chunk_size=4).reshape(n)
    (ours * x["upstream"].reshape(n)).sum().backward()
    theirs_h, theirs_w = args[0].clone().requires_grad_(), args[1].clone().requires_grad_()
    theirs, _ = kernels.ChunkedDivergenceFunction.apply(theirs_h, theirs_w, None, args[2], args[3], None, beta, 0.7)
    (theirs * x["upstream"].reshape(n)).sum().backward()
    for a, b in ((ours, theirs), (ours_h.grad, theirs_h.grad), (ours_w.grad, theirs_w.grad)):  # float32 rounding
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * float(b.abs().max()))
