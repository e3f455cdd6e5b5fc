"""The fused path and the exact KL from hidden states with an LM head's bias, logit scale and soft-cap
(head.HeadKind): logits = c·tanh(s·(x Wᵀ + b)/c), then τ. Each function against the materialised path (the
logits formed by hand in float64, then the logits-based function or the plain loss call), gradcheck, meta
tensors, torch.compile, bad input, and the plain head bit for bit at the defaults.

Covered: `log_prob_and_entropy_from_hidden`, `loss_from_hidden` through `Algorithm.from_hidden` (the one-pass
and the recompute routes, and the exact KL to a reference head), `full_kl_from_hidden`.
"""

import pytest
import torch
from vocab.head_checks import assert_compiles_like_eager, assert_refuses_bad_head, records, with_biases

import pgloss
from pgloss.from_hidden import loss_from_hidden
from pgloss.vocab.full_kl import full_kl_from_hidden, full_kl_from_logits
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

B, T, H, H_REF, V = 3, 5, 8, 6, 37  # N = 15 tokens
TAU = 0.7
MASK = torch.arange(T)[None, :] < torch.tensor([5, 3, 1])[:, None]
# (tokens per chunk, vocabulary columns per tile), neither dividing N = 15 nor V = 37; None: the whole vocabulary.
TILES = [(4, None), (4, 10), (7, 13)]
# The loss's routes: chunks shorter than a row (T = 5) recompute in backward; 11 tokens hold two whole rows.
ROUTES = {"recompute": (4, None), "recompute tiled": (4, 10), "one pass": (11, None), "one pass tiled": (11, 10)}

# The policy head's options (the logits' spread is about 2: soft-caps of 1.5 to 3 bend them); True: its bias.
OPTIONS = {
    "none": {},
    "bias": dict(bias=True),
    "scale": dict(logit_scale=1.7),
    "softcap": dict(softcap=2.5),
    "all": dict(bias=True, logit_scale=0.8, softcap=3.0),
}
REF = dict(ref_bias=True, ref_logit_scale=1.25, ref_softcap=2.0)
ALL_ON = dict(logit_scale=1.3, softcap=1.5)


def make(seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=gen, dtype=torch.float64)).to(dtype)  # noqa: E731
    return dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.7),
        bias=r(V, scale=0.5),
        ref_hidden=r(B, T, H_REF),
        ref_weight=r(V, H_REF, scale=0.7),
        ref_bias=r(V, scale=0.5),
        upstream=r(B, T),
        upstream2=r(B, T),
        targets=torch.randint(0, V, (B, T), generator=gen),
        noise=r(3, B, T),
        advantages=r(B),
    )


def options(name, x, bias=None, ref=False):
    """The options of set `name` (and the reference's, `ref`), biases filled in, written flat (`records` turns
    them into the calls' `head=` and `ref_head=`)."""
    return with_biases(dict(OPTIONS[name], **(REF if ref else {})), x, bias)


def leaves(x):
    return [x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")]


def head_logits(hidden, weight, bias=None, logit_scale=1.0, softcap=None):
    """The materialised logits before τ, in float64: c·tanh(s·(x Wᵀ + b)/c), s·(x Wᵀ + b) without a soft-cap."""
    z = hidden.double() @ weight.double().t()
    if bias is not None:
        z = z + bias.double()
    z = logit_scale * z
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def policy_logits(hidden, weight, opts):
    return head_logits(hidden, weight, opts.get("bias"), opts.get("logit_scale", 1.0), opts.get("softcap"))


def ref_logits(x, opts):
    return head_logits(
        x["ref_hidden"],
        x["ref_weight"],
        opts.get("ref_bias"),
        opts.get("ref_logit_scale", 1.0),
        opts.get("ref_softcap"),
    )


def grads(*tensors):
    return [t.grad for t in tensors]


def assert_close_all(got, expected, atol=1e-12):
    for a, b in zip(got, expected, strict=True):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=atol)


# --- log π(y) and H ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_log_prob_and_entropy_match_the_materialised_logits(name, tiles):
    x = make(seed=1)
    (h1, w1, b1), (h2, w2, b2) = leaves(x), leaves(x)
    opts1, opts2 = options(name, x, b1), options(name, x, b2)
    lp, ent = log_prob_and_entropy_from_hidden(
        h1, w1, x["targets"], temperature=TAU, chunk_size=tiles[0], vocab_block=tiles[1], **records(opts1)
    )
    (lp * x["upstream"] + ent * x["upstream2"]).sum().backward()
    lp_ref, ent_ref = pgloss.log_prob_and_entropy(policy_logits(h2, w2, opts2), x["targets"], temperature=TAU)
    (lp_ref * x["upstream"] + ent_ref * x["upstream2"]).sum().backward()
    # measured worst cases over the option sets and tiles: values 5.3e-15, ∂/∂hidden 1.7e-14, ∂/∂weight 2.0e-14,
    # ∂/∂bias 1.4e-15
    assert_close_all([lp, ent], [lp_ref, ent_ref])
    assert_close_all(grads(h1, w1), grads(h2, w2))
    assert_close_all([b1.grad], [b2.grad if "bias" in opts1 else None])
    if name != "none":  # each option moves log π (the comparison above is not the plain head's twice)
        plain, _ = pgloss.log_prob_and_entropy(
            policy_logits(x["hidden"], x["weight"], {}), x["targets"], temperature=TAU
        )
        assert (lp.detach() - plain).abs().min() > 1e-4


# --- the loss -----------------------------------------------------------------------------------------------


def losses(x, opts):
    """grpo with an entropy bonus and its k3 KL to sampled reference log-probs, and grpo with the exact KL to
    the reference head (`REF`'s options): old and reference log-probs near the current ones."""
    with torch.no_grad():
        current, _ = pgloss.log_prob_and_entropy(
            policy_logits(x["hidden"], x["weight"], opts), x["targets"], temperature=TAU
        )
    old, ref = current + 0.3 * x["noise"][0], current + 0.2 * x["noise"][1]
    old = old.masked_fill(~MASK, float("nan"))
    common = dict(old_log_prob=old, advantages=x["advantages"], mask=MASK)
    return {
        "grpo": (pgloss.get("grpo", entropy_coef=0.01), dict(common, ref_log_prob=ref)),
        "grpo+full_kl": (pgloss.get("grpo", kl_estimator="full", kl_coef=0.3, entropy_coef=0.01), common),
    }


def materialised_loss(algorithm, inputs, hidden, weight, x, opts):
    logits = policy_logits(hidden, weight, opts)
    log_prob, entropy = pgloss.log_prob_and_entropy(logits, x["targets"], temperature=TAU)
    extra = {}
    if algorithm.uses_full_kl:
        extra["full_kl"] = full_kl_from_logits(logits, ref_logits(x, opts), temperature=TAU)
    return algorithm(log_prob=log_prob, entropy=entropy, **inputs, **extra)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ["bias", "softcap", "all"])
@pytest.mark.parametrize("loss", ["grpo", "grpo+full_kl"])
def test_loss_matches_the_materialised_logits(loss, name, route):
    """`Algorithm.from_hidden` with the head's options (and the reference head's for the exact KL) equals the
    plain call on log-probs, entropies and the exact KL of the materialised logits: loss, per-token values,
    metrics and the gradients of hidden, weight and bias."""
    x = make(seed=2)
    algorithm, inputs = losses(x, options(name, x))[loss]
    (h1, w1, b1), (h2, w2, b2) = leaves(x), leaves(x)
    opts1, opts2 = options(name, x, b1, ref=algorithm.uses_full_kl), options(name, x, b2, ref=True)
    extra = dict(ref_hidden=x["ref_hidden"], ref_weight=x["ref_weight"]) if algorithm.uses_full_kl else {}
    chunk_size, vocab_block = ROUTES[route]
    targets = x["targets"].masked_fill(~MASK, -100)
    out = algorithm.from_hidden(
        h1,
        w1,
        targets,
        temperature=TAU,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        **inputs,
        **records(opts1),
        **extra,
    )
    out.loss.backward()
    expected = materialised_loss(algorithm, inputs, h2, w2, x, opts2)
    expected.loss.backward()
    # measured worst cases over the routes and option sets: loss 4.4e-16, per-token 1.8e-15, metrics 2.4e-15,
    # ∂/∂hidden 4.4e-16, ∂/∂weight 2.8e-16, ∂/∂bias 1.9e-16
    assert_close_all([out.loss, out.per_token.detach()], [expected.loss, expected.per_token.detach()])
    assert out.metrics.keys() == expected.metrics.keys()
    assert_close_all(list(out.metrics.values()), list(expected.metrics.values()))
    assert_close_all(grads(h1, w1), grads(h2, w2))
    assert_close_all([b1.grad], [b2.grad if "bias" in opts1 else None])
    assert w1.grad.abs().max() > 1e-3 and (h1.grad[~MASK] == 0).all()
    if algorithm.uses_full_kl:
        assert out.metrics["kl"] > 0


def test_the_reference_head_gets_no_gradient_and_a_frozen_bias_none():
    x = make(seed=3)
    algorithm, inputs = losses(x, {})["grpo+full_kl"]
    hidden, weight, bias = leaves(x)
    bias.requires_grad_(False)
    reference = [x[k].clone().requires_grad_() for k in ("ref_hidden", "ref_weight", "ref_bias")]
    out = algorithm.from_hidden(
        hidden,
        weight,
        x["targets"],
        **inputs,
        head=pgloss.HeadOptions(bias=bias, softcap=2.0),
        ref_hidden=reference[0],
        ref_weight=reference[1],
        ref_head=pgloss.HeadOptions(bias=reference[2], softcap=1.5),
    )
    out.loss.backward()
    assert all(t.grad is None for t in reference) and bias.grad is None and weight.grad.abs().max() > 0
    hidden, weight, bias = leaves(x)
    kl = full_kl_from_hidden(
        hidden,
        weight,
        *reference[:2],
        head=pgloss.HeadOptions(bias=bias, softcap=2.0),
        ref_head=pgloss.HeadOptions(bias=reference[2]),
    )
    kl.sum().backward()
    assert all(t.grad is None for t in reference) and bias.grad.abs().max() > 0


@pytest.mark.parametrize("route", ROUTES)
def test_only_the_bias_trains(route):
    """A frozen hidden state and head with a trainable bias: the bias's gradient alone, on either route."""
    x = make(seed=10)
    algorithm, inputs = losses(x, options("all", x))["grpo"]
    (h1, w1, b1), (h2, w2, b2) = leaves(x), leaves(x)
    h1.requires_grad_(False), w1.requires_grad_(False)
    chunk_size, vocab_block = ROUTES[route]
    out = algorithm.from_hidden(
        h1,
        w1,
        x["targets"],
        temperature=TAU,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        **inputs,
        **records(options("all", x, b1)),
    )
    out.loss.backward()
    materialised_loss(algorithm, inputs, h2, w2, x, options("all", x, b2)).loss.backward()
    assert h1.grad is None and w1.grad is None
    # measured: 1.9e-16
    assert_close_all([b1.grad], [b2.grad])


# --- the exact KL ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_full_kl_matches_the_materialised_logits(name, tiles):
    x = make(seed=4)
    (h1, w1, b1), (h2, w2, b2) = leaves(x), leaves(x)
    opts1, opts2 = options(name, x, b1, ref=True), options(name, x, b2, ref=True)
    kl = full_kl_from_hidden(
        h1,
        w1,
        x["ref_hidden"],
        x["ref_weight"],
        temperature=TAU,
        chunk_size=tiles[0],
        vocab_block=tiles[1],
        **records(opts1),
    )
    (kl * x["upstream"]).sum().backward()
    expected = full_kl_from_logits(policy_logits(h2, w2, opts2), ref_logits(x, opts2), temperature=TAU)
    (expected * x["upstream"]).sum().backward()
    # measured worst cases: values 5.3e-15, ∂/∂hidden 1.5e-14, ∂/∂weight 1.8e-14, ∂/∂bias 1.6e-15
    assert_close_all([kl], [expected])
    assert_close_all(grads(h1, w1), grads(h2, w2))
    assert_close_all([b1.grad], [b2.grad if "bias" in opts1 else None])
    assert kl.min() > 0


# --- the defaults are the plain head ------------------------------------------------------------------------

DEFAULTS = dict(bias=None, logit_scale=1.0, softcap=None)
REF_DEFAULTS = dict(ref_bias=None, ref_logit_scale=1.0, ref_softcap=None)


def default_variants(dtype, ref=False):
    """No option, the options at their defaults, and zero biases (x + 0 = x) whose gradient is kept."""
    zero = torch.zeros(V, dtype=dtype, requires_grad=True)
    zero_ref = dict(ref_bias=torch.zeros(V, dtype=dtype)) if ref else {}
    return [{}, dict(DEFAULTS, **(REF_DEFAULTS if ref else {})), dict(bias=zero, **zero_ref)], zero


def assert_all_equal(results):
    for result in results[1:]:
        assert len(result) == len(results[0])
        assert all(torch.equal(a, b) for a, b in zip(results[0], result, strict=True))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", [(4, None), (4, 10)])
def test_defaults_leave_log_prob_entropy_and_full_kl_bit_for_bit(tiles, dtype):
    x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in make(seed=5).items()}
    sizes = dict(temperature=TAU, chunk_size=tiles[0], vocab_block=tiles[1])
    for function in ("log_prob", "full_kl"):
        variants, zero = default_variants(dtype, ref=function == "full_kl")
        results = []
        for extra in variants:
            hidden, weight, _ = leaves(x)
            if function == "log_prob":
                lp, ent = log_prob_and_entropy_from_hidden(hidden, weight, x["targets"], **sizes, **records(extra))
                values = [lp, ent]
            else:
                values = [
                    full_kl_from_hidden(hidden, weight, x["ref_hidden"], x["ref_weight"], **sizes, **records(extra))
                ]
            sum((v * x["upstream"].float()).sum() for v in values).backward()
            results.append([*values, hidden.grad, weight.grad])
        assert_all_equal(results)
        assert zero.grad.dtype == dtype and zero.grad.abs().max() > 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("loss", ["grpo", "grpo+full_kl"])
def test_defaults_leave_the_loss_bit_for_bit(loss, route, dtype):
    """Both routes of `loss_from_hidden` (and the exact KL's): values, metrics and gradients with torch.equal."""
    x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in make(seed=6).items()}
    algorithm, inputs = losses(x, {})[loss]
    ref = algorithm.uses_full_kl
    variants, zero = default_variants(dtype, ref=ref)
    extra = dict(ref_hidden=x["ref_hidden"], ref_weight=x["ref_weight"]) if ref else {}
    chunk_size, vocab_block = ROUTES[route]
    results = []
    for options_ in variants:
        hidden, weight, _ = leaves(x)
        out = loss_from_hidden(
            algorithm,
            hidden,
            weight,
            x["targets"],
            temperature=TAU,
            chunk_size=chunk_size,
            vocab_block=vocab_block,
            **inputs,
            **extra,
            **records(options_),
        )
        out.loss.backward()
        results.append([out.loss, out.per_token, *out.metrics.values(), hidden.grad, weight.grad])
    assert_all_equal(results)
    assert zero.grad.dtype == dtype and zero.grad.abs().max() > 0


# --- gradcheck, meta tensors, compile -----------------------------------------------------------------------


def small(seed):
    """Small enough for gradcheck's finite differences: B, T = 2, 3; V = 11; H = 4, H' = 3."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    return dict(
        hidden=r(2, 3, 4),
        weight=r(11, 4),
        bias=r(11),
        ref_hidden=r(2, 3, 3),
        ref_weight=r(11, 3),
        ref_bias=r(11),
        targets=torch.randint(0, 11, (2, 3), generator=gen),
        old=-r(2, 3).abs() * 2,
        advantages=r(2),
        mask=torch.tensor([[True, True, False], [True] * 3]),
    )


@pytest.mark.parametrize("vocab_block", [None, 4])
def test_gradcheck_with_every_option(vocab_block):
    s = small(7)
    sizes = dict(temperature=TAU, chunk_size=4, vocab_block=vocab_block)
    ref = dict(ref_head=pgloss.HeadOptions(bias=s["ref_bias"], logit_scale=0.7, softcap=2.0))
    args = [s[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    both = lambda h, w, b: log_prob_and_entropy_from_hidden(  # noqa: E731
        h, w, s["targets"], head=pgloss.HeadOptions(bias=b, **ALL_ON), **sizes
    )
    kl = lambda h, w, b: full_kl_from_hidden(  # noqa: E731
        h, w, s["ref_hidden"], s["ref_weight"], head=pgloss.HeadOptions(bias=b, **ALL_ON), **ref, **sizes
    )
    algorithm = pgloss.get("grpo", kl_estimator="full", kl_coef=0.3, entropy_coef=0.1)

    def loss(h, w, b):
        return algorithm.from_hidden(
            h,
            w,
            s["targets"],
            old_log_prob=s["old"],
            advantages=s["advantages"],
            mask=s["mask"],
            head=pgloss.HeadOptions(bias=b, **ALL_ON),
            ref_hidden=s["ref_hidden"],
            ref_weight=s["ref_weight"],
            **ref,
            **dict(sizes, chunk_size=2),
        ).loss

    for function in (both, kl, loss):
        assert torch.autograd.gradcheck(function, args)


@pytest.mark.parametrize("route", ROUTES)
def test_meta_tensors(route):
    """Every function with every option, forward and backward, on meta tensors: nothing reads a value on the host."""
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    hidden, weight, bias = meta(B, T, H).requires_grad_(), meta(V, H).requires_grad_(), meta(V).requires_grad_()
    targets, mask = torch.empty(B, T, dtype=torch.long, device="meta"), MASK.to("meta")
    chunk_size, vocab_block = ROUTES[route]
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block)
    ref = dict(ref_head=pgloss.HeadOptions(bias=meta(V), logit_scale=0.7, softcap=2.0))
    head = pgloss.HeadOptions(bias=bias, **ALL_ON)
    lp, ent = log_prob_and_entropy_from_hidden(hidden, weight, targets, head=head, **sizes)
    kl = full_kl_from_hidden(hidden, weight, meta(B, T, H_REF), meta(V, H_REF), head=head, **ref, **sizes)
    (lp.sum() + ent.sum() + kl.sum()).backward()
    for algorithm, extra in (
        (pgloss.get("grpo", entropy_coef=0.01), dict(ref_log_prob=meta(B, T))),
        (
            pgloss.get("grpo", kl_estimator="full", kl_coef=0.3),
            dict(ref_hidden=meta(B, T, H_REF), ref_weight=meta(V, H_REF), **ref),
        ),
    ):
        out = algorithm.from_hidden(
            hidden,
            weight,
            targets,
            old_log_prob=meta(B, T),
            advantages=meta(B),
            mask=mask,
            head=head,
            **sizes,
            **extra,
        )
        assert out.loss.device.type == "meta" and out.loss.shape == ()
        out.loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape and bias.grad.shape == bias.shape


@pytest.mark.compile
def test_compiles_whole_forward_and_backward():
    """torch.compile(fullgraph=True), CPU inductor, of the loss with the exact KL over vocabulary tiles (the
    recompute route: log π, H and the KL from both heads, every option on), with the eager loss and gradients.
    (The one-pass route calls torch.autograd.grad inside the forward, which dynamo does not trace by default.)"""
    s = {k: v.float() if v.is_floating_point() else v for k, v in small(8).items()}
    algorithm = pgloss.get("grpo", kl_estimator="full", kl_coef=0.3, entropy_coef=0.1)

    def call(h, w, b):
        return algorithm.from_hidden(
            h,
            w,
            s["targets"],
            old_log_prob=s["old"],
            advantages=s["advantages"],
            mask=s["mask"],
            head=pgloss.HeadOptions(bias=b, **ALL_ON),
            ref_hidden=s["ref_hidden"],
            ref_weight=s["ref_weight"],
            ref_head=pgloss.HeadOptions(bias=s["ref_bias"], logit_scale=0.7, softcap=2.0),
            chunk_size=4,
            vocab_block=4,
        ).loss

    assert_compiles_like_eager(call, [s[k] for k in ("hidden", "weight", "bias")])


# --- low precision --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["recompute tiled", "one pass"])
def test_bfloat16_head_with_a_bias(route):
    """bfloat16 hidden states, head and bias: the matmul in bfloat16, the bias, scale and soft-cap in float32;
    the bias's gradient comes back in bfloat16, near the float64 one of the same bfloat16 parameters."""
    x = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in make(seed=9).items()}
    algorithm, inputs = losses(x, options("all", x))["grpo"]
    chunk_size, vocab_block = ROUTES[route]
    hidden, weight, bias = leaves(x)
    out = algorithm.from_hidden(
        hidden,
        weight,
        x["targets"],
        temperature=TAU,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        **inputs,
        **records(options("all", x, bias)),
    )
    out.loss.backward()
    assert bias.grad.dtype == weight.grad.dtype == torch.bfloat16
    h, w, b = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
    exact = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    expected = materialised_loss(algorithm, exact, h, w, x, options("all", x, b))
    expected.loss.backward()
    # measured on both routes: loss within 7.6e-4 relative, the bias's gradient within 0.36% of its largest entry
    torch.testing.assert_close(out.loss.double(), expected.loss, rtol=2e-3, atol=1e-5)
    torch.testing.assert_close(bias.grad.double(), b.grad, rtol=0, atol=1e-2 * float(b.grad.abs().max()))


# --- bad input ----------------------------------------------------------------------------------------------


def test_bad_options_name_the_argument():
    x = make()
    algorithm, inputs = losses(x, {})["grpo"]
    full = pgloss.get("grpo", kl_estimator="full", kl_coef=0.3)
    ref_head = dict(ref_hidden=x["ref_hidden"], ref_weight=x["ref_weight"])
    calls = {
        "log_prob": lambda **kw: log_prob_and_entropy_from_hidden(x["hidden"], x["weight"], x["targets"], **kw),
        "loss": lambda **kw: algorithm.from_hidden(x["hidden"], x["weight"], x["targets"], **inputs, **kw),
        "full_kl": lambda **kw: full_kl_from_hidden(x["hidden"], x["weight"], x["ref_hidden"], x["ref_weight"], **kw),
    }
    for call in calls.values():  # chunks.check_head's messages, naming the policy's argument
        assert_refuses_bad_head(call, x["bias"])
    # The reference head's options, named ref_*, in the exact KL and the loss that computes it.
    for call in (
        calls["full_kl"],
        lambda **kw: full.from_hidden(x["hidden"], x["weight"], x["targets"], **inputs, **ref_head, **kw),
    ):
        assert_refuses_bad_head(call, x["ref_bias"], prefix="ref_")
    # A reference head without the exact KL is refused, not ignored.
    for extra in (dict(ref_head=pgloss.HeadOptions()), dict(ref_head=pgloss.HeadOptions(softcap=30.0))):
        with pytest.raises(
            ValueError,
            match=r"ref_hidden, ref_weight and ref_head are for kl_estimator='full'; grpo has kl_estimator='k3'",
        ):
            calls["loss"](**extra)
