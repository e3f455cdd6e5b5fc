"""The exact full-vocabulary KL (full_kl.py) from logits and from hidden states, against plain torch."""

import math

import loops
import pytest
import torch

import pgloss
import pgloss.vocab.entropy
from pgloss.vocab.full_kl import full_kl_from_hidden, full_kl_from_logits

B, T, H, H_REF, V = 3, 5, 8, 6, 37


def plain(logits, ref_logits, temperature=1.0):
    log_pi = torch.log_softmax(logits.double() / temperature, -1)
    log_rho = torch.log_softmax(ref_logits.double() / temperature, -1)
    return (log_pi.exp() * (log_pi - log_rho)).sum(-1)


def make(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def r(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype)

    return dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.7),
        ref_hidden=r(B, T, H_REF),
        ref_weight=r(V, H_REF, scale=0.7),
        upstream=r(B, T),
    )


@pytest.fixture
def small_blocks(monkeypatch):
    monkeypatch.setattr(pgloss.vocab.entropy, "_BLOCK_ELEMENTS", 3 * V)


def test_one_position_matches_the_loop():
    gen = torch.Generator().manual_seed(1)
    logits, ref = (
        torch.randn(2, V, generator=gen, dtype=torch.float64),
        torch.randn(2, V, generator=gen, dtype=torch.float64),
    )
    kl = full_kl_from_logits(logits, ref, temperature=0.7)
    expected = [loops.full_kl(a, b, 0.7) for a, b in zip(logits.tolist(), ref.tolist(), strict=True)]
    torch.testing.assert_close(kl, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14)
    assert (kl > 0).all()
    torch.testing.assert_close(
        full_kl_from_logits(logits, logits), torch.zeros(2, dtype=torch.float64), rtol=0, atol=1e-14
    )


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 4, None])
def test_from_logits_value_and_gradient(temperature, chunk_size, small_blocks):
    x = make()
    logits = (x["hidden"] @ x["weight"].t()).requires_grad_()
    ref = x["ref_hidden"] @ x["ref_weight"].t()
    kl = full_kl_from_logits(logits, ref, temperature=temperature, chunk_size=chunk_size)
    (kl * x["upstream"]).sum().backward()
    plain_logits = logits.detach().clone().requires_grad_()
    expected = plain(plain_logits, ref, temperature)
    (expected * x["upstream"]).sum().backward()
    torch.testing.assert_close(kl, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(logits.grad, plain_logits.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [4, 100])
def test_from_hidden_value_and_gradients(temperature, chunk_size, small_blocks):
    x = make(seed=2)
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    kl = full_kl_from_hidden(
        hidden, weight, x["ref_hidden"], x["ref_weight"], temperature=temperature, chunk_size=chunk_size
    )
    (kl * x["upstream"]).sum().backward()
    h2, w2 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    expected = plain(h2 @ w2.t(), x["ref_hidden"] @ x["ref_weight"].t(), temperature)
    (expected * x["upstream"]).sum().backward()
    torch.testing.assert_close(kl, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=0, atol=1e-12)


def test_gradcheck_from_hidden():
    x = make(seed=3)

    def fn(h, w):
        return full_kl_from_hidden(h, w, x["ref_hidden"], x["ref_weight"], chunk_size=4)

    assert torch.autograd.gradcheck(fn, (x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()))


def test_no_n_by_v_tensor_is_saved_for_backward():
    x = make(seed=4)
    saved = []
    hidden, weight = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        kl = full_kl_from_hidden(hidden, weight, x["ref_hidden"], x["ref_weight"], chunk_size=4)
    assert saved and all(math.prod(s) < B * T * V for s in saved), saved
    kl.sum().backward()
    assert torch.isfinite(hidden.grad).all()


def test_banned_tokens_of_both_models_contribute_zero():
    gen = torch.Generator().manual_seed(5)
    logits, ref = (
        torch.randn(2, V, generator=gen, dtype=torch.float64),
        torch.randn(2, V, generator=gen, dtype=torch.float64),
    )
    banned_logits, banned_ref = logits.clone(), ref.clone()
    banned_logits[:, :3] = -torch.inf
    banned_ref[:, :3] = -torch.inf
    kl = full_kl_from_logits(banned_logits, banned_ref)
    expected = plain(logits[:, 3:], ref[:, 3:])
    torch.testing.assert_close(kl, expected, rtol=0, atol=1e-12)


def test_float32_matches_float64():
    x = make(seed=6, dtype=torch.float32)
    kl32 = full_kl_from_hidden(x["hidden"], x["weight"], x["ref_hidden"], x["ref_weight"], chunk_size=4)
    kl64 = plain(
        x["hidden"].double() @ x["weight"].double().t(), x["ref_hidden"].double() @ x["ref_weight"].double().t()
    )
    assert kl32.dtype == torch.float32
    torch.testing.assert_close(kl32.double(), kl64, rtol=1e-5, atol=1e-6)


def test_bad_input_names_the_argument():
    x = make()
    with pytest.raises(ValueError, match="ref_logits must have the shape of logits"):
        full_kl_from_logits(torch.zeros(2, V), torch.zeros(2, V + 1))
    with pytest.raises(TypeError, match="ref_logits must be a Tensor"):
        full_kl_from_logits(torch.zeros(2, V), [0.0])
    with pytest.raises(ValueError, match="ref_weight must have shape"):
        full_kl_from_hidden(x["hidden"], x["weight"], x["ref_hidden"], x["weight"])
    with pytest.raises(ValueError, match="share a vocabulary"):
        full_kl_from_hidden(x["hidden"], x["weight"], x["ref_hidden"], x["ref_weight"][:-1])
    with pytest.raises(ValueError, match="ref_hidden must have shape"):
        full_kl_from_hidden(x["hidden"], x["weight"], x["ref_hidden"][:, :-1], x["ref_weight"])
    with pytest.raises(ValueError, match="temperature"):
        full_kl_from_logits(torch.zeros(2, V), torch.zeros(2, V), temperature=0.0)


@pytest.mark.parametrize("chunk_size", [4, 11])
def test_algorithm_with_the_exact_kl_from_hidden_matches_materialised_logits(chunk_size):
    """kl_estimator="full": the fused path computes the exact KL from both heads; the plain path
    materialises both logits and passes full_kl. Same loss, metrics and gradients."""
    x = make(seed=7)
    gen = torch.Generator().manual_seed(8)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 1])[:, None]
    targets = torch.randint(0, V, (B, T), generator=gen)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    adv = torch.randn(B, generator=gen, dtype=torch.float64)
    alg = pgloss.get("grpo", kl_estimator="full", kl_coef=0.3)
    h1, w1 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    fused = alg.from_hidden(
        h1,
        w1,
        targets,
        old_log_prob=old,
        advantages=adv,
        mask=mask,
        temperature=0.7,
        ref_hidden=x["ref_hidden"],
        ref_weight=x["ref_weight"],
        chunk_size=chunk_size,
    )
    fused.loss.backward()
    h2, w2 = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    logits = h2 @ w2.t()
    log_prob = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[..., None]).squeeze(-1)
    kl = plain(logits, x["ref_hidden"] @ x["ref_weight"].t(), 0.7)
    plain_out = alg(log_prob, old, adv, mask, full_kl=kl)
    plain_out.loss.backward()
    torch.testing.assert_close(fused.loss, plain_out.loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(fused.metrics["kl"], plain_out.metrics["kl"], rtol=0, atol=1e-12)
    assert plain_out.metrics["kl"] > 0
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-12)


def test_algorithm_with_the_exact_kl_refuses_missing_inputs():
    x = make()
    mask = torch.ones(B, T, dtype=torch.bool)
    lp = torch.full((B, T), -1.0, dtype=torch.float64)
    alg = pgloss.get("grpo", kl_estimator="full")
    with pytest.raises(ValueError, match="needs full_kl"):
        alg(lp, lp, torch.zeros(B, dtype=torch.float64), mask)
    with pytest.raises(ValueError, match="needs ref_hidden and ref_weight"):
        alg.from_hidden(
            x["hidden"],
            x["weight"],
            torch.zeros(B, T, dtype=torch.long),
            old_log_prob=lp,
            advantages=torch.zeros(B, dtype=torch.float64),
            mask=mask,
        )
    with pytest.raises(ValueError, match="takes no kl_correction"):
        pgloss.get("grpo", kl_estimator="full", kl_correction="ratio_weighted")
