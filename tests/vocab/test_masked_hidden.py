"""Hidden states at masked positions never reach a value, a gradient or a metric, on every path from hidden states
and both routes of the vocabulary loop: NaN and ±inf there (left padding under some attention kernels produces
them) give what finite values give, and no gradient to hidden there. Before, the loss and metrics were right but
∂/∂W was NaN everywhere (0 · NaN in Gᵀ x). Masked rows are zeroed before the head's matmul (`chunks.HeadRows`)."""

import pytest
import torch
from vocab import plain_head
from vocab.plain_head import ROUTES, largest_error, scale_of

import pgloss
from pgloss.vocab import kernels
from pgloss.vocab.divergence import divergence_from_hidden
from pgloss.vocab.full_kl import full_kl_from_hidden
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, V = 3, 4, 8, 37
MASK = torch.tensor(
    [[False, True, True, True], [True, True, False, False], [False, False, False, False]], device=DEVICE
)  # left padding, right padding, a row with no token


def draw(fill, seed=0):
    """Inputs whose hidden states (the policy's and the other model's) hold `fill` at masked positions: NaN, inf,
    −inf, or None (random finite values)."""
    gen, r = plain_head.normal(seed, DEVICE)
    x = dict(
        hidden=r(B, T, H),
        ref_hidden=r(B, T, H),
        weight=r(V, H, scale=0.5),
        ref_weight=r(V, H, scale=0.5),
        bias=r(V),
        upstream=r(B, T),
        targets=torch.randint(0, V, (B, T), generator=gen).to(DEVICE),
    )
    noise = r(2, B, T, H, scale=5.0)
    for key, other in (("hidden", noise[0]), ("ref_hidden", noise[1])):
        x[key] = torch.where(MASK[..., None], x[key], other if fill is None else torch.full_like(other, fill))
    return x


FILLS = [float("nan"), float("inf"), -float("inf")]


def leaves(x):
    return [x[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]


def loss_call(name, chunk_size):
    def call(x, h, w, b):
        kl = dict(kl_estimator="full", kl_coef=0.1) if name == "exact KL" else dict(kl_coef=0.0)
        algorithm = pgloss.get("grpo", entropy_coef=0.01, **kl)
        extra = dict(ref_hidden=x["ref_hidden"], ref_weight=x["ref_weight"]) if name == "exact KL" else {}
        out = algorithm.from_hidden(
            h,
            w,
            x["targets"].masked_fill(~MASK, -100),
            head=pgloss.HeadOptions(bias=b),
            mask=MASK,
            old_log_prob=torch.full((B, T), -3.0, device=DEVICE),
            advantages=torch.tensor([1.0, -0.5, 0.3], device=DEVICE),
            chunk_size=chunk_size,
            vocab_block=10,
            **extra,
        )
        out.loss.backward()
        return [out.loss, *out.metrics.values()]

    return call


def per_token_call(which):
    def call(x, h, w, b):
        if which == "log π and H":
            lp, ent = log_prob_and_entropy_from_hidden(
                h, w, x["targets"].masked_fill(~MASK, -100), head=pgloss.HeadOptions(bias=b), mask=MASK, vocab_block=10
            )
            values = [lp, ent]
            (lp * x["upstream"] + ent).sum().backward()
        elif which == "exact KL":
            head = pgloss.HeadOptions(bias=b)
            values = [full_kl_from_hidden(h, w, x["ref_hidden"], x["ref_weight"], head=head, mask=MASK, vocab_block=10)]
            (values[0] * x["upstream"]).sum().backward()
        else:
            head = pgloss.HeadOptions(bias=b)
            out = divergence_from_hidden(
                h, w, x["ref_hidden"], x["ref_weight"], MASK, beta=0.5, head=head, vocab_block=10
            )
            values = [out.loss, *out.metrics.values()]
            out.loss.backward()
        return values

    return call


CALLS = {
    "grpo one pass": loss_call("grpo", 8),
    "grpo recompute": loss_call("grpo", 3),
    "exact KL": loss_call("exact KL", 8),
    "log π and H": per_token_call("log π and H"),
    "full_kl_from_hidden": per_token_call("exact KL"),
    "divergence_from_hidden": per_token_call("JSD"),
}


# NaN on every path; ±inf (the same code, other arithmetic: inf − inf, 0 · inf) on the loss's two routes.
CASES = [(call, FILLS[0]) for call in CALLS] + [
    (call, fill) for call in ("grpo one pass", "grpo recompute") for fill in FILLS[1:]
]


@pytest.mark.parametrize("call, fill", CASES, ids=[f"{c}-{f}" for c, f in CASES])
@pytest.mark.parametrize("route", ROUTES)
def test_non_finite_hidden_states_under_the_mask_reach_nothing(route, call, fill):
    """Values, metrics and ∂/∂(hidden, weight, bias) with `fill` at masked positions equal those with random finite
    values there; ∂/∂hidden is 0 at masked positions."""
    results = []
    for value in (fill, None):
        x = draw(value)
        h, w, b = leaves(x)
        with kernels.use(route):
            values = CALLS[call](x, h, w, b)
        results.append(values + [h.grad, w.grad, b.grad])
    assert all(torch.isfinite(t).all() for t in results[0])
    assert largest_error(results[0], results[1]) <= 1e-6 * scale_of(results[1])
    assert (results[0][-3][~MASK] == 0).all()


def test_masked_positions_of_log_prob_and_entropy_are_zero():
    """With `mask`, log π and H are 0 at masked positions (and their targets there are never read)."""
    x = draw(float("nan"))
    lp, ent = log_prob_and_entropy_from_hidden(
        x["hidden"], x["weight"], x["targets"].masked_fill(~MASK, -100), mask=MASK
    )
    assert (lp[~MASK] == 0).all() and (ent[~MASK] == 0).all() and (ent[MASK] > 0).all()
