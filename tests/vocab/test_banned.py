"""Banned tokens, a −inf in an LM head's bias (a logits processor's ban, padded vocabulary rows masked with −inf),
on both routes of the vocabulary loop: the token has π = 0, adds nothing to H, the KL or a divergence, and gets no
gradient; every value and gradient is finite, for the trained head and for the reference's or the teacher's. A
target on a banned token gets log π(y) = `LOG_PROB_FLOOR` and no gradient through it. Against float64 logits
formed by hand (plain_head.py), a banned logit stood in for by one 10⁴ below the others (π exactly 0 there too)."""

import pytest
import torch
from vocab import plain_head
from vocab.plain_head import ROUTES, largest_error, scale_of

import pgloss
from pgloss.vocab import kernels
from pgloss.vocab.banned import LOG_PROB_FLOOR
from pgloss.vocab.divergence import divergence_from_hidden
from pgloss.vocab.full_kl import full_kl_from_hidden
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, V = 2, 3, 8, 37
TILES = [(None, None), (4, 10)]
RTOL = 2e-5
BANNED = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 30]  # the whole first tile of 10 columns, and two more


def draw(seed=0, shift=0.0):
    gen, r = plain_head.normal(seed, DEVICE)
    bias = r(V) + shift
    bias[BANNED] = -torch.inf
    allowed = torch.tensor([v for v in range(V) if v not in BANNED])
    targets = allowed[torch.randint(0, len(allowed), (B, T), generator=gen)].to(DEVICE)
    return dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.5),
        bias=bias,
        ref_hidden=r(B, T, H),
        ref_weight=r(V, H, scale=0.5),
        upstream=r(B, T),
        upstream2=r(B, T),
        targets=targets,
    )


def run(route, x, targets, tiles, **head):
    h, w, b = (x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    with kernels.use(route):
        lp, ent = log_prob_and_entropy_from_hidden(
            h,
            w,
            targets,
            head=pgloss.HeadOptions(bias=b, **head),
            temperature=0.7,
            chunk_size=tiles[0],
            vocab_block=tiles[1],
        )
        (lp * x["upstream"] + ent * x["upstream2"]).sum().backward()
    return [lp, ent, h.grad, w.grad, b.grad]


def reference(x, targets, **head):
    h, w, b = (x[k].double().cpu().requires_grad_() for k in ("hidden", "weight", "bias"))
    z = plain_head.logits(h, w, b, temperature=0.7, **head)
    lp, ent = plain_head.log_prob_entropy(plain_head.finite(z), targets.cpu())
    (lp * x["upstream"].double().cpu() + ent * x["upstream2"].double().cpu()).sum().backward()
    return [lp, ent, h.grad, w.grad, b.grad]


@pytest.mark.parametrize("shift", [0.0, -100.0])
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("route", ROUTES)
def test_banned_tokens_have_no_probability_entropy_or_gradient(route, tiles, shift):
    """log π(y), H and the gradients with a −inf bias (a whole first tile of it), and with every logit negative
    (`shift` −100: verl #7439, a fused entropy that was not shift-invariant for all-negative logits). Before:
    log π right, H, ∂/∂hidden, ∂/∂W and ∂/∂b NaN on both routes."""
    x = draw(shift=shift)
    got, expected = run(route, x, x["targets"], tiles), reference(x, x["targets"])
    assert all(torch.isfinite(t).all() for t in got)
    values_scale = scale_of(expected[:2]) if shift == 0.0 else 1.0 / 16  # logits near −100: float32's ulp, 7.6e-6
    assert largest_error(got[:2], expected[:2]) <= RTOL * max(values_scale, scale_of(expected[:2]))
    assert largest_error(got[2:], expected[2:]) <= RTOL * scale_of(expected[2:]) * (1 if shift == 0.0 else 8)
    assert (got[3][BANNED] == 0).all() and (got[4][BANNED] == 0).all()


@pytest.mark.parametrize("route", ROUTES)
def test_a_soft_capped_head_takes_a_minus_inf_bias_to_minus_c(route):
    """Under a soft-cap c the banned logit is c·tanh(−∞) = −c, finite: the token keeps the probability e^{−c/τ}
    gives it, its slope s (1 − tanh²) is 0 (no gradient to its row of W)."""
    x = draw(seed=1)
    got, expected = run(route, x, x["targets"], (4, 10), softcap=3.0), reference(x, x["targets"], softcap=3.0)
    assert largest_error(got, expected) <= RTOL * scale_of(expected)
    assert (got[3][BANNED] == 0).all()


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("route", ROUTES)
def test_a_target_on_a_banned_token_gets_the_floor_and_no_gradient(route, tiles):
    """log π(y) = −∞ would poison the loss (0 · −∞ in a ratio's gradient, ∞ in a KL estimator): a target on a
    banned token gets `LOG_PROB_FLOOR` and passes no gradient, so the gradient is the entropy's alone."""
    x = draw(seed=2)
    targets = x["targets"].clone()
    targets[0, 1], targets[1, 2] = BANNED[0], BANNED[-1]
    got = run(route, x, targets, tiles)
    assert got[0][0, 1] == got[0][1, 2] == LOG_PROB_FLOOR
    x_entropy_only = dict(x, upstream=torch.where(targets == x["targets"], x["upstream"], 0.0))
    expected = reference(x_entropy_only, x["targets"])
    assert all(torch.isfinite(t).all() for t in got)
    assert largest_error(got[2:], expected[2:]) <= RTOL * scale_of(expected[2:])


def two_heads(x, which):
    """The other head's bias: banned where the policy's is ("same"), or banned alone ("other only")."""
    other = x["bias"].flip(0).clone() if which == "other only" else x["bias"].clone()
    if which == "other only":
        other[other == -torch.inf] = 0.0
        other[[11, 12]] = -torch.inf
    return other


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("route", ROUTES)
def test_divergences_with_tokens_banned_by_both_heads(route, beta):
    """KL(p_T‖p_S), JSD(0.5), KL(p_S‖p_T) and `full_kl_from_hidden` with the same tokens banned by both heads
    (padded vocabulary rows of two models): their terms vanish; values and ∂/∂hidden against float64."""
    x = draw(seed=3)
    other_bias = two_heads(x, "same")
    got = divergence(route, x, other_bias, beta)
    h2 = x["hidden"].double().cpu().requires_grad_()
    z = plain_head.finite(plain_head.logits(h2, x["weight"].cpu(), x["bias"].cpu()))
    z_other = plain_head.finite(plain_head.logits(x["ref_hidden"].cpu(), x["ref_weight"].cpu(), other_bias.cpu()))
    expected = {0.0: lambda: plain_head.kl(z_other, z), 1.0: lambda: plain_head.kl(z, z_other)}.get(
        beta, lambda: plain_head.jsd(z, z_other, beta)
    )()
    (expected * x["upstream"].double().cpu()).sum().backward()
    expected = [expected, h2.grad] + ([expected] if beta == 1.0 else [])
    assert largest_error(got, expected) <= RTOL * scale_of(expected)


def divergence(route, x, other_bias, beta):
    """[per-token value, ∂/∂hidden] (and `full_kl_from_hidden`'s value for β = 1) on `route`."""
    h = x["hidden"].clone().requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    with kernels.use(route):
        out = divergence_from_hidden(
            h,
            x["weight"],
            x["ref_hidden"],
            x["ref_weight"],
            mask,
            beta=beta,
            head=pgloss.HeadOptions(bias=x["bias"]),
            teacher_head=pgloss.HeadOptions(bias=other_bias),
            vocab_block=10,
        )
        (out.per_token * x["upstream"]).sum().backward()
        extra = (
            [
                full_kl_from_hidden(
                    x["hidden"],
                    x["weight"],
                    x["ref_hidden"],
                    x["ref_weight"],
                    head=pgloss.HeadOptions(bias=x["bias"]),
                    ref_head=pgloss.HeadOptions(bias=other_bias),
                )
            ]
            if beta == 1.0
            else []
        )
    return [out.per_token, h.grad, *extra]


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergences_with_tokens_one_head_alone_bans_are_finite_on_both_routes(beta):
    """A token one head bans and the other can sample: JSD(β) is finite by its form (the mixture keeps the other's
    mass); a KL that puts mass where the other head has none is +∞ in exact arithmetic, here finite (the banned
    logit taken as `chunks.BANNED_LOGIT`), and the two routes agree on it."""
    x = draw(seed=4)
    other_bias = two_heads(x, "other only")
    results = [divergence(route, x, other_bias, beta) for route in ROUTES]
    for values in results:
        assert all(torch.isfinite(t).all() for t in values)
    assert largest_error(results[1], results[0]) <= 1e-5 * scale_of(results[0])
    if beta == 0.5:
        h2 = x["hidden"].double().cpu()
        z = plain_head.finite(plain_head.logits(h2, x["weight"].cpu(), x["bias"].cpu()))
        z_other = plain_head.finite(plain_head.logits(x["ref_hidden"].cpu(), x["ref_weight"].cpu(), other_bias.cpu()))
        expected = plain_head.jsd(z, z_other, beta)
        assert largest_error(results[1][:1], [expected]) <= RTOL * scale_of([expected])


@pytest.mark.parametrize("chunk_size", [4, 11])  # the loss's recompute and one-pass routes
@pytest.mark.parametrize("route", ROUTES)
def test_a_loss_whose_padding_sits_on_a_banned_token(route, chunk_size):
    """`from_hidden` replaces the targets at masked positions by token 0, here banned (a pad token the head bans):
    the loss and its gradients are finite and equal the loss with an allowed pad token."""
    x = draw(seed=5)
    mask = torch.tensor([[True, True, False], [True, False, False]], device=DEVICE)
    algorithm = pgloss.get("grpo", kl_coef=0.0, entropy_coef=0.01)
    old = torch.full((B, T), -2.0, device=DEVICE)
    results = []
    for pad in (-100, int(x["targets"][0, 0])):
        h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
        with kernels.use(route):
            out = algorithm.from_hidden(
                h,
                w,
                x["targets"].masked_fill(~mask, pad),
                head=pgloss.HeadOptions(bias=x["bias"]),
                old_log_prob=old,
                advantages=torch.tensor([1.0, -0.5], device=DEVICE),
                mask=mask,
                chunk_size=chunk_size,
            )
            out.loss.backward()
        results.append([out.loss, h.grad, w.grad])
    assert all(torch.isfinite(t).all() for t in results[0])
    assert largest_error(results[0], results[1]) <= 1e-6 * scale_of(results[1])
