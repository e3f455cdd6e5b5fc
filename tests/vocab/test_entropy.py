"""pgloss.vocab.entropy: chunked, tempered log-probs and entropy against plain torch."""

import math

import pytest
import torch

import pgloss.vocab.banned
import pgloss.vocab.entropy
from pgloss.vocab.entropy import default_chunk_size, log_prob_and_entropy

V = 37


def plain(logits, targets, temperature):
    """The obvious implementation: the whole log-softmax materialised."""
    log_pi = torch.log_softmax(logits.to(torch.float64) / temperature, dim=-1)
    log_prob = log_pi.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    pi = log_pi.exp()
    entropy = -(pi * torch.where(pi > 0, log_pi, 0.0)).sum(-1)
    return log_prob, entropy


def make(shape=(3, 5), dtype=torch.float64, seed=0, scale=3.0):
    gen = torch.Generator().manual_seed(seed)
    logits = (scale * torch.randn(*shape, V, generator=gen, dtype=torch.float64)).to(dtype)
    targets = torch.randint(0, V, shape, generator=gen)
    return logits, targets


def value_and_grads(fn, logits, w_lp, w_h):
    """fn(logits) -> (log_prob, entropy), and the gradient of Σ w_lp·log_prob + w_h·H."""
    x = logits.clone().requires_grad_()
    log_prob, entropy = fn(x)
    (log_prob * w_lp + entropy * w_h).sum().backward()
    return log_prob, entropy, x.grad


@pytest.fixture
def small_blocks(monkeypatch):
    """Cache blocks of 2 rows (instead of ~2²² elements), so that chunks hold several blocks."""
    monkeypatch.setattr(pgloss.vocab.entropy, "_BLOCK_ELEMENTS", 2 * V)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, None, 100])
@pytest.mark.parametrize("blocks", ["default", "small"])
def test_matches_plain_float64(temperature, chunk_size, blocks, request):
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    logits, targets = make()
    gen = torch.Generator().manual_seed(1)
    w_lp, w_h = (
        torch.randn(3, 5, generator=gen, dtype=torch.float64),
        torch.randn(3, 5, generator=gen, dtype=torch.float64),
    )
    lp, h, g = value_and_grads(
        lambda x: log_prob_and_entropy(x, targets, temperature=temperature, chunk_size=chunk_size), logits, w_lp, w_h
    )
    lp_ref, h_ref, g_ref = value_and_grads(lambda x: plain(x, targets, temperature), logits, w_lp, w_h)
    assert lp.dtype == h.dtype == torch.float64 and lp.shape == h.shape == (3, 5)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
    assert (h > 0).all() and (h <= math.log(V) + 1e-12).all()


def test_entropy_formula_and_uniform():
    # H = lse(z) − Σ π z; a constant row is uniform with H = log V and log π = −log V.
    logits, targets = make(shape=(4,))
    _, h = log_prob_and_entropy(logits, targets, temperature=0.7)
    z = logits / 0.7
    expected = torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)
    torch.testing.assert_close(h, expected, rtol=0, atol=1e-12)
    lp, h = log_prob_and_entropy(torch.full((2, V), 5.0, dtype=torch.float64), torch.tensor([0, 7]))
    torch.testing.assert_close(h, torch.full((2,), math.log(V), dtype=torch.float64))
    torch.testing.assert_close(lp, torch.full((2,), -math.log(V), dtype=torch.float64))


@pytest.mark.parametrize("use", ["log_prob", "entropy"])
def test_one_output_used(use):
    # Only one output in the graph: the other's gradient arrives as None and is skipped.
    logits, targets = make()
    x, y = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    lp, h = log_prob_and_entropy(x, targets, chunk_size=4)
    (lp if use == "log_prob" else h).sum().backward()
    lp_ref, h_ref = plain(y, targets, 1.0)
    (lp_ref if use == "log_prob" else h_ref).sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)


def test_float32_agrees_with_float64():
    logits, targets = make(dtype=torch.float32, scale=5.0)
    w = torch.randn(3, 5, generator=torch.Generator().manual_seed(2))
    lp, h, g = value_and_grads(lambda x: log_prob_and_entropy(x, targets, temperature=0.7, chunk_size=4), logits, w, -w)
    lp_ref, h_ref, g_ref = value_and_grads(lambda x: plain(x, targets, 0.7), logits.double(), w.double(), -w.double())
    assert lp.dtype == h.dtype == torch.float32 and g.dtype == torch.float32
    torch.testing.assert_close(lp, lp_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g, g_ref.float(), rtol=1e-5, atol=1e-6)


def test_bfloat16_computes_in_float32():
    logits, targets = make(dtype=torch.bfloat16)
    x = logits.clone().requires_grad_()
    lp, h = log_prob_and_entropy(x, targets, chunk_size=4)
    assert lp.dtype == h.dtype == torch.float32
    (lp + h).sum().backward()
    assert x.grad.dtype == torch.bfloat16
    lp_ref, h_ref = plain(logits.double(), targets, 1.0)  # the same bf16 values, upcast
    torch.testing.assert_close(lp, lp_ref.float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, h_ref.float(), rtol=1e-5, atol=1e-5)


def test_banned_tokens_at_minus_inf():
    # −inf logits (a masked vocabulary) get probability 0, a finite entropy and a zero gradient.
    logits, targets = make()
    banned = torch.zeros(V, dtype=torch.bool)
    banned[[0, 5, 36]] = True
    targets = torch.where(banned[targets], 1, targets)
    x = logits.masked_fill(banned, -torch.inf).requires_grad_()
    lp, h = log_prob_and_entropy(x, targets, temperature=0.7, chunk_size=4)
    (lp + 0.3 * h).sum().backward()
    y = logits[..., ~banned].clone().requires_grad_()  # the same distribution on the allowed tokens
    kept = torch.cumsum(~banned, 0) - 1
    lp_ref, h_ref = plain(y, kept[targets], 0.7)
    (lp_ref + 0.3 * h_ref).sum().backward()
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-12)
    assert torch.isfinite(x.grad).all()
    assert (x.grad[..., banned] == 0).all()
    torch.testing.assert_close(x.grad[..., ~banned], y.grad, rtol=0, atol=1e-12)


def test_leading_shapes():
    for shape in [(7,), (2, 3, 4)]:
        logits, targets = make(shape=shape)
        lp, h = log_prob_and_entropy(logits, targets, chunk_size=3)
        lp_ref, h_ref = plain(logits, targets, 1.0)
        assert lp.shape == h.shape == shape
        torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(h, h_ref, rtol=0, atol=1e-12)


def test_gradcheck():
    logits, targets = make(shape=(5,), scale=2.0)
    x = logits[:, :11].clone().requires_grad_()
    targets = targets % 11
    both = lambda x: log_prob_and_entropy(x, targets, temperature=0.7, chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(both, (x,))
    assert torch.autograd.gradcheck(lambda x: both(x)[1], (x,))


def test_saves_only_the_logits_and_one_float_per_token():
    # No second [N, V] tensor is kept for backward: the logits themselves and [N] vectors.
    logits, targets = make(shape=(15,))
    x = logits.clone().requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        log_prob_and_entropy(x, targets, chunk_size=4)
    big = [t for t in saved if t.numel() > 15]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()


def test_default_chunk_size():
    assert default_chunk_size(151936) == (1 << 27) // 151936 == 883
    assert default_chunk_size(1 << 30) == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(logits=[[0.0]]), TypeError, "logits must be a Tensor"),
        (dict(logits=torch.zeros(3, V, dtype=torch.long)), TypeError, "logits must be a floating"),
        (dict(logits=torch.zeros(())), ValueError, "logits must have shape"),
        (dict(targets=torch.zeros(3)), TypeError, "targets must hold integer"),
        (dict(targets=torch.zeros(4, dtype=torch.long)), ValueError, r"targets must have shape \(3,\)"),
        (dict(temperature=0.0), ValueError, "temperature must be a finite number > 0, got 0.0"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(temperature=True), TypeError, "temperature"),
        (dict(chunk_size=0), ValueError, "chunk_size must be >= 1, got 0"),
        (dict(chunk_size=2.0), TypeError, "chunk_size"),
    ],
)
def test_bad_inputs_raise(kwargs, error, match):
    args = dict(logits=torch.zeros(3, V), targets=torch.zeros(3, dtype=torch.long))
    args.update(kwargs)
    logits, targets = args.pop("logits"), args.pop("targets")
    with pytest.raises(error, match=match):
        log_prob_and_entropy(logits, targets, **args)


def test_the_whole_vocabulary_lse_is_read_at_an_unbanned_target_to_the_bit():
    """lse = z_y − log π(y) at every unbanned target, bit for bit (the formula the lab's runs, and so the README's
    tables, were measured with); a banned target's row reads it at its largest logit instead (`banned.py`)."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, 1000, generator=gen) * 3  # rows where lse read at the largest logit rounds otherwise
    targets = torch.randint(0, 1000, (64,), generator=gen)
    z[-1, targets[-1]] = -torch.inf
    z = z.clamp(min=pgloss.vocab.banned.BANNED_LOGIT)
    _, _, lse = pgloss.vocab.entropy.chunk_log_prob_entropy(z, targets)
    log_pi = torch.log_softmax(z, dim=-1)
    at_target = z.gather(-1, targets[:, None]) - log_pi.gather(-1, targets[:, None])
    assert torch.equal(lse[:-1], at_target[:-1, 0])
    assert lse[-1] == z[-1].max() - log_pi[-1].max() and torch.isfinite(lse[-1])


def test_the_whole_vocabulary_gradient_is_formed_from_lse_at_the_target_to_the_bit():
    """∂ Σ w log π(y) / ∂z = w (1[v = y] − π) with π = e^{z − lse}, lse read at the target, bit for bit: the formula
    the lab's runs were measured with, kept on the whole-vocabulary torch route (the tiled and kernel routes keep the
    max and log s apart instead: tests/properties/test_regressions_2026.py)."""
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(64, 1000, generator=gen) * 3
    targets = torch.randint(0, 1000, (64,), generator=gen)
    w = torch.randn(64, generator=gen)
    x = z.clone().requires_grad_()
    log_prob, _ = log_prob_and_entropy(x, targets)
    (log_prob * w).sum().backward()
    log_pi = torch.log_softmax(z, dim=-1)
    lse = z.gather(-1, targets[:, None]) - log_pi.gather(-1, targets[:, None])
    expected = torch.exp(z - lse) * -w[:, None]
    expected.scatter_add_(-1, targets[:, None], w[:, None])
    assert torch.equal(x.grad, expected)


def test_a_chunk_gradient_without_any_upstream_gradient_is_refused():
    with pytest.raises(ValueError, match="grad_log_prob or grad_entropy"):
        pgloss.vocab.entropy.chunk_grad_logits(
            torch.zeros(2, V), torch.zeros(2, dtype=torch.long), *torch.zeros(3, 2), None, None, 1.0
        )
