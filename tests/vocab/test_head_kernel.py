"""The head-kernel route (pgloss.vocab.head_tile, head_tile_kernels.py: the logits formed inside the kernels)
against float64 logits formed by hand (plain_head.py) and against the kernel route. On a machine without a GPU the
kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET=1) with blocks of 16 rows, 16 columns and 16
hidden units: N = 21 tokens, V = 37 columns and H = 40 fill none of them, and `vocab_block` 10 cuts the
vocabulary into four forward ranges and four ∂W slabs.

Covered: float32 and bfloat16 heads; no bias, a strided bias, an expanded zero bias (stride 0), a −inf in the bias
(a banned token, one target on it); logit scale, soft-cap, τ; masked rows holding NaN; log π, H and ∂x, ∂W, ∂b;
`loss_from_hidden` (GRPO with an entropy bonus) on the route; the route's choice and refusals; no host sync; the
slab's plan. Calls inside torch.autocast: test_autocast.py."""

import pytest
import torch
from properties.host_sync import no_host_sync
from vocab import plain_head

import pgloss
from pgloss.vocab import head_tile, kernels
from pgloss.vocab.banned import LOG_PROB_FLOOR
from pgloss.vocab.entropy import LogProbEntropy
from pgloss.vocab.full_kl import full_kl_from_hidden
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, T, H, V = 3, 7, 40, 37
MASK = (torch.arange(T)[None, :] < torch.tensor([7, 4, 6])[:, None]).to(DEVICE)
BANNED = torch.tensor([3, 20, 21])
VOCAB_BLOCKS = [None, 10]

# name -> (bias: None, "strided", "expanded" or "banned"; logit scale; soft-cap; τ; masked rows)
CASES = {
    "plain": (None, 1.0, None, 1.0, False),
    "strided bias, tau, mask": ("strided", 1.0, None, 0.7, True),
    "expanded zero bias": ("expanded", 1.0, None, 1.0, False),
    "bias, scale, softcap, tau": ("strided", 0.8, 3.0, 0.7, False),
    "banned, scale, mask": ("banned", 1.3, None, 0.9, True),
}


def draw(seed, dtype):
    """Float32 draws (from float64) cast to `dtype`; the first target on a banned token."""
    gen, r = plain_head.normal(seed, DEVICE)
    x = dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.3),
        bias=r(2 * V, scale=0.5),
        upstream=r(B, T),
        upstream2=r(B, T),
    )
    x = {k: v.to(dtype) for k, v in x.items()}
    x["targets"] = torch.randint(0, V, (B, T), generator=gen).to(DEVICE)
    x["targets"][0, 0] = 3  # banned
    return x


def leaves(x, bias_kind, masked):
    """hidden (NaN at masked rows when `masked`), weight, and the bias's leaf and the view the head reads."""
    hidden = x["hidden"].masked_fill(~MASK[..., None], float("nan")) if masked else x["hidden"]
    hidden, weight = hidden.clone().requires_grad_(), x["weight"].clone().requires_grad_()
    if bias_kind is None:
        return hidden, weight, None, None
    if bias_kind == "expanded":
        leaf = torch.zeros(1, dtype=weight.dtype, device=DEVICE, requires_grad=True)
        return hidden, weight, leaf, leaf.expand(V)
    base = x["bias"].clone()
    if bias_kind == "banned":
        base[::2].index_fill_(0, BANNED.to(DEVICE), -torch.inf)
    leaf = base.requires_grad_()
    return hidden, weight, leaf, leaf[::2]  # every other value: a stride of 2


def run(route, x, case, vocab_block=None, dtype=None):
    """log π, H and the gradients of hidden, weight and the bias's leaf, on `route` (float64: the plain
    reference), for the upstream gradients (upstream, upstream2)."""
    bias_kind, scale, softcap, tau, masked = CASES[case]
    if dtype is not None:
        x = {k: v.to(dtype) if v.is_floating_point() else v for k, v in x.items()}
    hidden, weight, leaf, bias = leaves(x, bias_kind, masked)
    mask = MASK if masked else None
    if route == "float64":
        rows = hidden if mask is None else torch.where(mask[..., None], hidden, 0.0)
        z = plain_head.logits(rows, weight, bias, scale, softcap, tau)
        lp, ent = plain_head.log_prob_entropy(plain_head.finite(z), x["targets"])
        banned_target = z.gather(-1, x["targets"][..., None]).squeeze(-1) == -torch.inf
        lp = torch.where(banned_target, LOG_PROB_FLOOR, lp)
        if mask is not None:
            lp, ent = torch.where(mask, lp, 0.0), torch.where(mask, ent, 0.0)
    else:
        with kernels.use(route):
            lp, ent = log_prob_and_entropy_from_hidden(
                hidden,
                weight,
                x["targets"],
                temperature=tau,
                head=pgloss.HeadOptions(bias=bias, logit_scale=scale, softcap=softcap),
                mask=mask,
                vocab_block=vocab_block,
            )
    (lp * x["upstream"].to(lp.dtype) + ent * x["upstream2"].to(lp.dtype)).sum().backward()
    return [lp, ent, hidden.grad, weight.grad, None if leaf is None else leaf.grad]


def relative_errors(got, expected) -> list[float]:
    """max |got − expected| / max |expected| of each pair (0 for a pair of None)."""
    errors = []
    for a, b in zip(got, expected, strict=True):
        assert (a is None) == (b is None)
        if b is not None:
            a, b = a.detach().double().cpu(), b.detach().double().cpu()
            assert torch.isfinite(a).all()
            errors.append(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item())
    return errors


@pytest.mark.parametrize("vocab_block", VOCAB_BLOCKS)
@pytest.mark.parametrize("case", list(CASES))
def test_float32_heads_match_float64_logits(case, vocab_block):
    """log π, H, ∂x, ∂W, ∂b of float32 inputs on the head-kernel route against float64 logits formed by hand.
    Measured in the interpreter (relative to the largest value): values within 2.6e-7, gradients 3.9e-7."""
    x = draw(seed=1, dtype=torch.float32)
    got = run("head-kernel", x, case, vocab_block)
    expected = run("float64", x, case, dtype=torch.float64)
    if CASES[case][0] == "expanded":  # one bias shared by every column: Σ_v ∂L/∂z_v, 0 (softmax's shift invariance)
        assert expected[4].abs().item() < 1e-12 and got[4].abs().item() < 1e-6
        got, expected = got[:4], expected[:4]
    assert max(relative_errors(got, expected)) < 2e-6
    assert got[0].dtype == got[1].dtype == got[2].dtype == got[3].dtype == torch.float32
    if CASES[case][0] == "banned":
        assert got[0][0, 0] == LOG_PROB_FLOOR and (got[4][::2][BANNED] == 0).all()
    if CASES[case][4]:
        assert (got[0][~MASK] == 0).all() and (got[2][~MASK] == 0).all()


@pytest.mark.parametrize("case", ["strided bias, tau, mask", "bias, scale, softcap, tau"])
def test_float32_heads_match_the_kernel_route(case):
    """The same float32 sums in another order: the kernel route's values and gradients within float32 rounding."""
    x = draw(seed=2, dtype=torch.float32)
    got = run("head-kernel", x, case, vocab_block=10)
    expected = run("kernel", x, case, vocab_block=10)
    assert max(relative_errors(got, expected)) < 2e-6


@pytest.mark.parametrize("vocab_block", VOCAB_BLOCKS)
def test_bfloat16_heads_match_float64_logits(vocab_block):
    """bfloat16 inputs: x Wᵀ summed in float32 inside the kernel, so log π and H hold to float32's rounding of the
    float64 logits of the same bfloat16 values; ∂L/∂r is rounded to bfloat16 before the two products (as on the
    kernel route) and the gradients are bfloat16, so they hold to bfloat16's. The kernel route rounds x Wᵀ itself
    to bfloat16, hence its values are further from float64 than these."""
    x = draw(seed=3, dtype=torch.bfloat16)
    case = "bias, scale, softcap, tau"
    got = run("head-kernel", x, case, vocab_block)
    expected = run("float64", x, case, dtype=torch.float64)
    errors = relative_errors(got, expected)
    assert max(errors[:2]) < 2e-6 and max(errors[2:]) < 1e-2
    assert got[2].dtype == got[3].dtype == got[4].dtype == torch.bfloat16
    kernel = run("kernel", x, case, vocab_block)
    assert max(relative_errors(kernel, expected)[:2]) > max(errors[:2])


def test_a_gradient_only_for_the_inputs_that_ask():
    """A frozen head: ∂x alone (no ∂W buffer, no ∂W); frozen hidden states: ∂W alone."""
    x = draw(seed=4, dtype=torch.float32)
    expected = run("float64", x, "plain", dtype=torch.float64)
    for frozen in ("weight", "hidden"):
        hidden, weight = x["hidden"].clone(), x["weight"].clone()
        (weight if frozen == "hidden" else hidden).requires_grad_()
        with kernels.use("head-kernel"):
            lp, ent = log_prob_and_entropy_from_hidden(hidden, weight, x["targets"], vocab_block=10)
        (lp * x["upstream"] + ent * x["upstream2"]).sum().backward()
        got = [hidden.grad, weight.grad]
        assert got[0 if frozen == "hidden" else 1] is None
        wanted = 1 if frozen == "hidden" else 0
        assert relative_errors([got[wanted]], [expected[2 + wanted]])[0] < 2e-6


@pytest.mark.parametrize("chunk_size", [4, 14])
def test_the_loss_from_hidden_states_on_the_route(chunk_size):
    """GRPO with an entropy bonus from hidden states (float32, masked rows, padding targets), on the head-kernel
    route, against the same call in float64 on the torch route; chunks shorter than a row and of two whole rows
    (which the other routes take in one pass) both run the head-kernel route's recompute."""
    alg = pgloss.get("grpo", entropy_coef=0.01, kl_coef=0.0)
    x = draw(seed=5, dtype=torch.float32)
    targets = x["targets"].clamp(min=0).masked_fill(~MASK, -100)
    targets[0, 0] = 1  # no banned token here
    gen = torch.Generator().manual_seed(5)
    old = (-torch.rand(B, T, generator=gen, dtype=torch.float64) - 3.0).to(DEVICE)
    advantages = torch.randn(B, generator=gen, dtype=torch.float64).to(DEVICE)
    results = []
    for route, dtype in (("head-kernel", torch.float32), ("torch", torch.float64)):
        hidden = x["hidden"].detach().to(dtype).requires_grad_()
        weight = x["weight"].detach().to(dtype).requires_grad_()
        with kernels.use(route):
            out = alg.from_hidden(
                hidden,
                weight,
                targets,
                old_log_prob=old.to(dtype),
                advantages=advantages.to(dtype),
                mask=MASK,
                temperature=0.8,
                chunk_size=chunk_size,
            )
            out.loss.backward()
        results.append([out.loss, out.per_token, out.metrics["entropy"], hidden.grad, weight.grad])
    assert max(relative_errors(*results)) < 1e-5
    assert results[0][4].abs().sum() > 0


def test_the_route_is_taken_only_when_chosen_and_refused_where_it_cannot_run(monkeypatch):
    x = draw(seed=6, dtype=torch.float32)
    statistic, kind = LogProbEntropy(x["targets"].reshape(-1)), pgloss.vocab.head.PLAIN
    assert kernels.route(statistic, (kind,), x["weight"]) == ("kernel" if DEVICE == "cuda" else "torch")
    with kernels.use("head-kernel"):
        assert kernels.route(statistic, (kind,), x["weight"]) == "head-kernel"
        with pytest.raises(ValueError, match=r"^the head-kernel route runs .* got LogProbEntropy .* torch.float64"):
            kernels.route(statistic, (kind,), x["weight"].double())
        with pytest.raises(ValueError, match=r"^the head-kernel route runs .* got LogProbEntropy on \('logits',\)"):
            pgloss.log_prob_and_entropy(x["hidden"] @ x["weight"].t(), x["targets"])
        with pytest.raises(ValueError, match=r"^the head-kernel route runs .* got FullKL on .*use\(\"kernel\"\)"):
            full_kl_from_hidden(x["hidden"], x["weight"], x["hidden"], x["weight"])
        if DEVICE == "cpu":
            monkeypatch.delenv("TRITON_INTERPRET")
            with pytest.raises(RuntimeError, match="^the head-kernel route on cpu tensors runs only in Triton's"):
                kernels.route(statistic, (kind,), x["weight"])


def test_the_route_builds_nothing_from_the_host():
    """The torch operations around the kernels (the partial states' combine, the gradient buffers and slabs)
    under the host-sync detector of tests/properties, forward and backward, a bfloat16 head in slabs."""
    x = draw(seed=7, dtype=torch.bfloat16)
    with no_host_sync():
        got = run("head-kernel", x, "banned, scale, mask", vocab_block=10)
    assert got[3].abs().sum() > 0


def test_the_slab_is_vocab_block_or_what_the_budget_holds():
    """(tokens, columns per ∂W slab): `vocab_block`, else a float32 [columns, H] slab of `memory_budget` bytes
    (2²⁵ without one); `chunk_size` is checked and unused; the sizes' rules are every route's."""
    weight = torch.empty(152064, 3584, device="meta")  # its shape alone
    assert head_tile.plan(16384, weight, None, None, None) == (16384, 2**25 // (4 * 3584))
    assert head_tile.plan(16384, weight, 512, None, None) == (16384, 2**25 // (4 * 3584))
    assert head_tile.plan(16384, weight, None, 4096, None) == (16384, 4096)
    assert head_tile.plan(16384, weight, None, None, 2**30) == (16384, 2**30 // (4 * 3584))
    assert head_tile.plan(4, torch.empty(37, 40), None, None, None) == (4, 37)
    with pytest.raises(ValueError, match="^memory_budget and chunk_size are exclusive"):
        head_tile.plan(16384, weight, 512, None, 2**30)


@pytest.mark.skipif(DEVICE != "cuda", reason="the GPU's blocks (64 rows, 128 columns): the interpreter's are above")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_loop_at_the_gpu_blocks(dtype):
    """N = 300, H = 200, V = 1000 on CUDA: several row blocks, column blocks, steps over H and (vocab_block 300)
    forward ranges and ∂W slabs at the blocks a GPU launches, against float64 logits of the same values."""
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(3, 100, 200, generator=gen).to(DEVICE, dtype).requires_grad_()
    weight = (0.1 * torch.randn(1000, 200, generator=gen)).to(DEVICE, dtype).requires_grad_()
    targets = torch.randint(0, 1000, (3, 100), generator=gen).to(DEVICE)
    upstream = torch.randn(3, 100, generator=gen, dtype=torch.float64).to(DEVICE)
    results = []
    for route in ("head-kernel", "float64"):
        h, w = (t.detach().double() if route == "float64" else t.detach() for t in (hidden, weight))
        h.requires_grad_(), w.requires_grad_()
        if route == "float64":
            lp, ent = plain_head.log_prob_entropy(plain_head.logits(h, w, temperature=0.8), targets)
        else:
            with kernels.use(route):
                lp, ent = log_prob_and_entropy_from_hidden(h, w, targets, temperature=0.8, vocab_block=300)
        (lp * upstream.to(lp.dtype) + ent).sum().backward()
        results.append([lp, ent, h.grad, w.grad])
    errors = relative_errors(*results)
    assert max(errors[:2]) < 2e-6 and max(errors[2:]) < (2e-6 if dtype == torch.float32 else 1e-2)
