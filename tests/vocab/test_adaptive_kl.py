"""AKL's head over vocabulary tiles (vocab/adaptive_kl.py): the order-preserving keys of the teacher's logits, the radix
search for the threshold z* against the rule written as a plain loop (ties included), tiles against whole rows where
ties abound, and the search beside the student when the two models' logits differ in dtype."""

import math

import pytest
import torch

from pgloss.vocab.adaptive_kl import levels, logit_of_key, order_key, threshold
from pgloss.vocab.divergence import divergence_from_logits

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_keys_keep_the_order_and_come_back(dtype):
    gen = torch.Generator().manual_seed(0)
    special = [0.0, -0.0, 1e-45 if dtype == torch.float32 else 5e-324, -1e-30, -(2.0**64), 3.4e38, -3.4e38, 1.0, -1.0]
    z = torch.cat([torch.tensor(special, dtype=dtype), (30 * torch.randn(500, generator=gen)).to(dtype)])
    key = order_key(z)
    order = torch.argsort(z, stable=True)
    assert (key[order].diff() >= 0).all()  # the values' order
    assert torch.equal(key[:2], torch.zeros(2, dtype=torch.int64))  # −0 and +0: one key
    back = logit_of_key(key, dtype)
    assert back.dtype == dtype and torch.equal(back, z)
    assert levels(dtype) == ([24, 16, 8, 0] if dtype == torch.float32 else [56, 48, 40, 32, 24, 16, 8, 0])


def rule(row, mu):
    """z* of one row by the definition: the largest teacher logit t whose mass at or above it, G(t), reaches μ (the
    smallest when none does)."""
    z = row.double().tolist()
    top = max(z)
    p = [math.exp(v - top) for v in z]
    total = math.fsum(p)
    p = [v / total for v in p]
    reaching = [t for t in set(z) if math.fsum(q for v, q in zip(z, p, strict=True) if v >= t) >= mu]
    return max(reaching) if reaching else min(z)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mu", [0.05, 0.3, 0.5, 0.77, 0.95])
def test_the_search_finds_the_rule(mu, dtype):
    """Rows with ties everywhere (logits on a grid of halves) and rows without: the search's z* is the rule's."""
    gen = torch.Generator().manual_seed(1)
    tied = (torch.randint(-6, 7, (40, 29), generator=gen) / 2).to(dtype)
    loose = (2 * torch.randn(40, 29, generator=gen)).to(dtype)
    for z in (tied, loose):
        found = threshold(z, torch.logsumexp(z, dim=-1), mu)
        expected = torch.tensor([rule(row, mu) for row in z], dtype=dtype)
        assert torch.equal(found, expected)


@pytest.mark.parametrize("mu", [0.2, 0.5, 0.9])
def test_tiles_equal_whole_rows_where_ties_abound(mu):
    """Teacher logits on a grid, so that tie groups straddle μ and tiles cut them: every tile width gives the
    whole-row values and gradients (a token on the wrong side would move the value by far more)."""
    gen = torch.Generator().manual_seed(2)
    student = (2 * torch.randn(2, 4, 23, generator=gen, dtype=torch.float64)).requires_grad_()
    teacher = torch.randint(-4, 5, (2, 4, 23), generator=gen).double() / 2
    mask = torch.ones(2, 4, dtype=torch.bool)
    whole = divergence_from_logits(student, teacher, mask, divergence="adaptive", mu=mu)
    (g_whole,) = torch.autograd.grad(whole.loss, student)
    for block in (1, 2, 5, 22):
        out = divergence_from_logits(student, teacher, mask, divergence="adaptive", mu=mu, vocab_block=block)
        (grad,) = torch.autograd.grad(out.loss, student)
        torch.testing.assert_close(out.per_token, whole.per_token, rtol=0, atol=1e-14)
        torch.testing.assert_close(grad, g_whole, rtol=0, atol=1e-15)


def test_a_uniform_teacher_is_all_head():
    """Every teacher token tied: all join the head, AKL is the forward KL, in whole rows and tiles."""
    gen = torch.Generator().manual_seed(3)
    student = torch.randn(1, 3, 11, generator=gen, dtype=torch.float64)
    teacher = torch.zeros(1, 3, 11, dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    forward = divergence_from_logits(student, teacher, mask, divergence="forward").per_token
    for block in (None, 4):
        out = divergence_from_logits(student, teacher, mask, divergence="adaptive", mu=0.3, vocab_block=block)
        torch.testing.assert_close(out.per_token, forward, rtol=0, atol=1e-15)


def test_float32_teacher_logits_beside_float64_student_logits():
    """The student's logits in float64, the teacher's in float32 (formed by the loop in float64, τ dividing there):
    the search runs beside the student, on the loop's float64 logits, and tiles give the whole-row values and
    gradients, also at a τ whose division rounds differently in float32."""
    gen = torch.Generator().manual_seed(4)
    student = torch.randn(2, 3, 19, generator=gen, dtype=torch.float64)
    teacher = torch.randint(-3, 4, (2, 3, 19), generator=gen).float() / 3
    mask = torch.tensor([[True, True, False], [True, True, True]])
    for temperature in (1.0, 0.7):
        results = []
        for block in (None, 3):
            s = student.clone().requires_grad_()
            out = divergence_from_logits(
                s, teacher, mask, divergence="adaptive", mu=0.4, vocab_block=block, temperature=temperature
            )
            out.loss.backward()
            results.append((out.per_token, s.grad))
        assert results[0][0].dtype == torch.float64
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
