"""Vocabulary tiles (chunks.ChunkLoop with `vocab_block` < V): log-sum-exp, log π(y), H and the exact KL
accumulated over vocabulary blocks with an online max, each tile's gradient recomputed in backward, equal to
the materialised logits; the tile plan from `memory_budget`; a statistic without the per-tile interface runs
whole-vocabulary chunks."""

import math

import loops
import pytest
import torch

import pgloss
import pgloss.vocab.entropy
from pgloss.from_hidden import loss_from_hidden
from pgloss.vocab.chunks import ChunkLoop, plan_tiles, tileable
from pgloss.vocab.entropy import LogProbEntropy, log_prob_and_entropy
from pgloss.vocab.full_kl import FullKL, full_kl_from_hidden, full_kl_from_logits
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

B, T, H, V = 3, 5, 8, 37
# (tokens per chunk, vocabulary columns per tile): tiles of 10 leave a short last one (7 columns),
# a tile of 1 column is the extreme, 36 leaves a one-column tail.
TILES = [(4, 10), (15, 1), (1, 36), (7, 13)]


def randn(*shape, seed=0, scale=1.0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)


def plain_log_prob_entropy(logits, targets, temperature):
    log_pi = torch.log_softmax(logits.double() / temperature, -1)
    return log_pi.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(log_pi.exp() * log_pi).sum(-1)


@pytest.fixture
def small_blocks(monkeypatch):
    """Cache blocks of 3 rows of a tile, so that a tile spans several blocks."""
    monkeypatch.setattr(pgloss.vocab.entropy, "_BLOCK_ELEMENTS", 3 * 10)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tiles", TILES)
def test_log_prob_and_entropy_tiled_match_materialised_logits(tiles, temperature, small_blocks):
    logits = randn(B, T, V, scale=4.0).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))
    w_lp, w_h = randn(B, T, seed=2), randn(B, T, seed=3)
    lp, ent = log_prob_and_entropy(logits, targets, temperature=temperature, chunk_size=tiles[0], vocab_block=tiles[1])
    (g,) = torch.autograd.grad((w_lp * lp + w_h * ent).sum(), logits)
    lp_ref, ent_ref = plain_log_prob_entropy(logits, targets, temperature)
    (g_ref,) = torch.autograd.grad((w_lp * lp_ref + w_h * ent_ref).sum(), logits)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-13)
    # and a plain float64 loop over the vocabulary at one position
    row = [x / temperature for x in logits[1, 2].tolist()]
    top = max(row)
    lse = top + math.log(sum(math.exp(x - top) for x in row))
    loop_h = -sum(math.exp(x - lse) * (x - lse) for x in row)
    lp, ent = lp.detach(), ent.detach()
    assert abs(float(lp[1, 2]) - (row[int(targets[1, 2])] - lse)) < 1e-12 and abs(float(ent[1, 2]) - loop_h) < 1e-12


def test_the_running_max_moves_between_tiles():
    """Rows whose max lies in the last tile, in the first, and far from the others' scale (a shift of 80
    would overflow exp without the online rescaling)."""
    logits = randn(4, V, scale=2.0)
    logits[0, -1] += 80.0
    logits[1, 0] += 80.0
    logits[2] += torch.linspace(0, 90, V, dtype=torch.float64)
    logits[3] -= torch.linspace(0, 90, V, dtype=torch.float64)
    logits = logits.float().requires_grad_()
    targets = torch.tensor([V - 1, 3, 20, 0])
    lp, ent = log_prob_and_entropy(logits, targets, vocab_block=5)
    lp_ref, ent_ref = plain_log_prob_entropy(logits, targets, 1.0)
    assert torch.isfinite(lp).all() and torch.isfinite(ent).all()
    torch.testing.assert_close(lp.double(), lp_ref, rtol=0, atol=2e-5)
    torch.testing.assert_close(ent.double(), ent_ref, rtol=0, atol=2e-5)


def test_banned_tokens_in_whole_tiles():
    """−inf logits, including a whole tile of them: π is exactly 0 there, and H and the gradient are finite."""
    logits = randn(3, V, scale=2.0)
    logits[:, 10:20] = -float("inf")
    logits[1, ::3] = -float("inf")
    logits.requires_grad_()
    targets = torch.tensor([0, 1, 25])
    lp, ent = log_prob_and_entropy(logits, targets, vocab_block=10)
    finite = logits.detach().clamp(min=torch.finfo(torch.float64).min)
    lp_ref, ent_ref = plain_log_prob_entropy(finite, targets, 1.0)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(ent, ent_ref, rtol=0, atol=1e-13)
    (lp + ent).sum().backward()
    assert torch.isfinite(logits.grad).all() and (logits.grad[:, 10:20] == 0).all()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("tiles", TILES)
def test_full_kl_tiled_from_logits_and_from_hidden(tiles, temperature):
    logits, ref = randn(B, T, V, scale=3.0).requires_grad_(), randn(B, T, V, seed=1, scale=3.0)
    upstream = randn(B, T, seed=2)
    kl = full_kl_from_logits(logits, ref, temperature=temperature, chunk_size=tiles[0], vocab_block=tiles[1])
    (g,) = torch.autograd.grad((upstream * kl).sum(), logits)
    log_pi, log_rho = (torch.log_softmax(x / temperature, -1) for x in (logits, ref))
    kl_ref = (log_pi.exp() * (log_pi - log_rho)).sum(-1)
    (g_ref,) = torch.autograd.grad((upstream * kl_ref).sum(), logits)
    torch.testing.assert_close(kl, kl_ref, rtol=0, atol=1e-13)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-13)
    assert abs(float(kl[2, 1]) - loops.full_kl(logits[2, 1].tolist(), ref[2, 1].tolist(), temperature)) < 1e-12

    hidden, weight = randn(B, T, H, seed=3).requires_grad_(), randn(V, H, seed=4, scale=0.7).requires_grad_()
    ref_hidden, ref_weight = randn(B, T, 6, seed=5), randn(V, 6, seed=6, scale=0.7)
    kl = full_kl_from_hidden(
        hidden, weight, ref_hidden, ref_weight, temperature=temperature, chunk_size=tiles[0], vocab_block=tiles[1]
    )
    grads = torch.autograd.grad((upstream * kl).sum(), (hidden, weight))
    want = full_kl_from_logits(hidden @ weight.t(), ref_hidden @ ref_weight.t(), temperature=temperature)
    want_grads = torch.autograd.grad((upstream * want).sum(), (hidden, weight))
    torch.testing.assert_close(kl, want, rtol=0, atol=1e-13)
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_from_hidden_tiles_in_bfloat16_match_whole_rows():
    """Half-precision heads: the matmul writes each tile in bfloat16, the statistic runs in float32."""
    hidden = randn(B, T, H, dtype=torch.bfloat16).requires_grad_()
    weight = randn(V, H, seed=1, scale=0.7, dtype=torch.bfloat16).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(2))
    out = [log_prob_and_entropy_from_hidden(hidden, weight, targets, chunk_size=4, vocab_block=vb) for vb in (10, None)]
    grads = [torch.autograd.grad((lp - 0.3 * h).sum(), (hidden, weight)) for lp, h in out]
    for a, b in zip(out[0], out[1], strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
    for a, b in zip(grads[0], grads[1], strict=True):
        assert a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("route", ["one_pass", "recompute"])
@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo", "cispo", "clip_cov"])
def test_loss_from_hidden_tiled_equals_whole_rows_float32(name, route):
    """float32: tiles against whole-vocabulary rows, on both routes, within float32 rounding."""
    alg = pgloss.get(name, kl_coef=0.05, entropy_coef=0.01)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(4, 6, 16, generator=gen), torch.randn(300, 16, generator=gen) * 0.3
    targets = torch.randint(0, 300, (4, 6), generator=gen)
    mask = torch.rand(4, 6, generator=gen) < 0.8
    old = torch.randn(4, 6, generator=gen) * 0.1 - 5.7
    chunk = 12 if route == "one_pass" else 5
    results = []
    for vocab_block in (64, None):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        torch.manual_seed(0)
        out = loss_from_hidden(
            alg,
            h,
            w,
            targets,
            old_log_prob=old,
            advantages=torch.randn(4, generator=gen.manual_seed(1)),
            mask=mask,
            ref_log_prob=old + 0.05,
            chunk_size=chunk,
            vocab_block=vocab_block,
        )
        out.loss.backward()
        results.append((out.loss, h.grad, w.grad))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tiles", [(4, 10), (11, 10)], ids=["recompute", "one_pass"])
def test_exact_kl_loss_from_hidden_in_tiles(tiles):
    """kl_estimator="full" through loss_from_hidden with tiles: the KL's two sources tile together."""
    alg = pgloss.get("grpo", kl_estimator="full", kl_coef=0.1, entropy_coef=0.01)
    hidden, weight = randn(B, T, H).requires_grad_(), randn(V, H, seed=1, scale=0.7).requires_grad_()
    ref_hidden, ref_weight = randn(B, T, H, seed=2), randn(V, H, seed=3, scale=0.7)
    targets = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(B, T, dtype=torch.bool)
    old, adv = randn(B, T, seed=5) * 0.1 - 3.6, randn(B, seed=6)
    kw = dict(old_log_prob=old, advantages=adv, mask=mask, ref_hidden=ref_hidden, ref_weight=ref_weight)
    got = loss_from_hidden(alg, hidden, weight, targets, chunk_size=tiles[0], vocab_block=tiles[1], **kw).loss
    grads = torch.autograd.grad(got, (hidden, weight))
    logits = hidden @ weight.t()
    log_pi = torch.log_softmax(logits, -1)
    log_rho = torch.log_softmax(ref_hidden @ ref_weight.t(), -1)
    want = alg(
        log_pi.gather(-1, targets.unsqueeze(-1)).squeeze(-1),
        old,
        adv,
        mask,
        entropy=-(log_pi.exp() * log_pi).sum(-1),
        full_kl=(log_pi.exp() * (log_pi - log_rho)).sum(-1),
    ).loss
    want_grads = torch.autograd.grad(want, (hidden, weight))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_gradcheck_tiled():
    hidden = randn(2, 3, 4).requires_grad_()
    weight = randn(9, 4, seed=1, scale=0.7).requires_grad_()
    targets = torch.tensor([[0, 8, 4], [5, 2, 7]])
    f = lambda h, w: log_prob_and_entropy_from_hidden(h, w, targets, temperature=0.7, chunk_size=4, vocab_block=4)  # noqa: E731
    assert torch.autograd.gradcheck(f, (hidden, weight))
    ref_hidden, ref_weight = randn(2, 3, 4, seed=2), randn(9, 4, seed=3)
    g = lambda h, w: full_kl_from_hidden(h, w, ref_hidden, ref_weight, chunk_size=5, vocab_block=2)  # noqa: E731
    assert torch.autograd.gradcheck(g, (hidden, weight))


def test_no_tile_outlives_its_tile_and_nothing_n_by_v_is_saved():
    """Inside the loop every logits buffer is [chunk, vocab_block]: no [chunk, V] and no [N, V] tensor."""
    hidden, weight = randn(6, 5, 8).requires_grad_(), randn(V, 8, seed=1).requires_grad_()
    targets = torch.randint(0, V, (6, 5), generator=torch.Generator().manual_seed(2))
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        lp, ent = log_prob_and_entropy_from_hidden(hidden, weight, targets, chunk_size=8, vocab_block=10)
    assert all(V not in shape for shape in shapes if shape != (V, 8))
    allocations = []
    original = torch.Tensor.new_empty

    def spy(self, *size, **kw):
        allocations.append(torch.Size(size[0] if len(size) == 1 and not isinstance(size[0], int) else size).numel())
        return original(self, *size, **kw)

    torch.Tensor.new_empty = spy
    try:
        (lp + ent).sum().backward()
        log_prob_and_entropy_from_hidden(hidden, weight, targets, chunk_size=8, vocab_block=10)
    finally:
        torch.Tensor.new_empty = original
    assert max(allocations) <= 8 * 10 < 8 * V


class _NoTiles:
    """A statistic with only the whole-row interface (as a divergence to a teacher may be): the loop falls
    back to whole-vocabulary token chunks whatever vocab_block says."""

    def __init__(self, targets):
        self.inner = LogProbEntropy(targets)
        self.widths = []

    def allocate(self, *args):
        return self.inner.allocate(*args)

    def forward(self, zs, rows, values):
        self.widths.append(zs[0].shape[1])
        self.inner.forward(zs, rows, values)

    def outputs(self, values):
        return self.inner.outputs(values)

    def grad(self, zs, rows, values, grads, temperature):
        self.widths.append(zs[0].shape[1])
        return self.inner.grad(zs, rows, values, grads, temperature)


def test_a_statistic_without_tiles_falls_back_to_token_chunks():
    assert tileable(LogProbEntropy(torch.zeros(1, dtype=torch.long))) and tileable(FullKL())
    logits = randn(6, V).requires_grad_()
    targets = torch.randint(0, V, (6,), generator=torch.Generator().manual_seed(1))
    statistic = _NoTiles(targets)
    assert not tileable(statistic)
    lp, ent = ChunkLoop.apply(statistic, ("logits",), 1.0, (4, 10), None, logits)
    (lp + ent).sum().backward()
    assert statistic.widths == [V, V, V, V]
    lp_ref, ent_ref = plain_log_prob_entropy(logits, targets, 1.0)
    torch.testing.assert_close(lp, lp_ref, rtol=0, atol=1e-13)


def test_plan_tiles_from_a_memory_budget():
    vocab = 151936
    # No budget: the sizes given, or about 2²⁷ / V tokens of whole rows.
    assert plan_tiles(4096, vocab) == ((1 << 27) // vocab, vocab)
    assert plan_tiles(4096, vocab, chunk_size=64, vocab_block=1000) == (64, 1000)
    assert plan_tiles(4096, 37, vocab_block=100) == ((1 << 27) // 37, 37)
    # A budget holding 512 whole rows keeps whole rows; below, tiles of up to 2048 tokens.
    whole = 512 * vocab * 4 * 3
    assert plan_tiles(4096, vocab, memory_budget=whole) == (512, vocab)
    rows, block = plan_tiles(4096, vocab, memory_budget=64 << 20)
    assert rows == 2048 and block == (64 << 20) // 12 // 2048 and rows * block * 12 <= 64 << 20
    rows, block = plan_tiles(4096, vocab, memory_budget=64 << 20, buffers=2, itemsize=8)
    assert rows * block * 8 * 4 <= 64 << 20
    assert plan_tiles(10, vocab, memory_budget=10 * vocab * 12) == (10, vocab)  # few tokens: whole rows
    assert plan_tiles(10, vocab, memory_budget=12) == (1, 1)


def test_plan_tiles_on_the_kernel_route():
    """Every token in one chunk (up to 2¹⁵), the widest tile that about 2²⁷ values per buffer (or the budget,
    the raw tiles alone) leaves; explicit sizes as given."""
    vocab = 151936
    assert plan_tiles(4096, vocab, itemsize=2, kernel=True) == (4096, 1 << 15)
    assert plan_tiles(16384, vocab, itemsize=2, kernel=True) == (16384, 1 << 13)
    assert plan_tiles(100, vocab, itemsize=2, kernel=True) == (100, vocab)
    assert plan_tiles(1 << 17, vocab, itemsize=2, kernel=True) == (1 << 15, 1 << 12)
    assert plan_tiles(4096, vocab, buffers=2, itemsize=2, kernel=True) == (4096, 1 << 16)  # two heads, two buffers
    assert plan_tiles(4096, vocab, memory_budget=64 << 20, itemsize=2, kernel=True) == (4096, (64 << 20) // 2 // 4096)
    assert plan_tiles(4096, vocab, chunk_size=64, vocab_block=1000, kernel=True) == (64, 1000)
    assert plan_tiles(4096, vocab, chunk_size=64, kernel=True) == (64, vocab)


@pytest.mark.parametrize(
    "chunk_size, vocab_block, sums",
    [(4, 10, (True, True)), (15, 10, (True, False)), (4, None, (False, True)), (15, None, (False, False))],
)
def test_half_precision_gradients_accumulate_in_float32_only_where_they_sum(chunk_size, vocab_block, sums):
    """∂L/∂x sums over vocabulary tiles and ∂L/∂W over token chunks: a bfloat16 head's buffer is a float32
    accumulator where its gradient is such a sum, and the head's own dtype where each part is written once (no
    float32 [V, H] copy of the head for one chunk of every token)."""
    from pgloss.vocab.chunks import HeadRows

    hidden, weight = torch.randn(15, 8, dtype=torch.bfloat16), torch.randn(37, 8, dtype=torch.bfloat16)
    source = HeadRows(hidden, weight, None, chunk_size, torch.float32, vocab_block)
    source.begin_backward((True, True, False))
    expected = [torch.float32 if summed else torch.bfloat16 for summed in sums]
    assert [source.grad_hidden.dtype, source.grad_weight.dtype] == expected


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(memory_budget=0), ValueError, "memory_budget must be >= 1, got 0"),
        (dict(memory_budget=1.5e9), TypeError, "memory_budget must be an int or None, got float"),
        (dict(memory_budget=11), ValueError, "memory_budget must hold at least one value per buffer"),
        (dict(vocab_block=0), ValueError, "vocab_block must be >= 1, got 0"),
        (dict(vocab_block="8"), TypeError, "vocab_block must be an int or None, got str"),
        (dict(chunk_size=0), ValueError, "chunk_size must be >= 1, got 0"),
        (dict(memory_budget=1 << 20, chunk_size=4), ValueError, "memory_budget and chunk_size are exclusive"),
        (dict(memory_budget=1 << 20, vocab_block=4), ValueError, "memory_budget and vocab_block are exclusive"),
    ],
)
def test_bad_tile_arguments_name_the_argument(kwargs, error, message):
    logits = randn(2, V)
    targets = torch.zeros(2, dtype=torch.long)
    hidden, weight = randn(1, 2, 4), randn(V, 4)
    calls = [
        lambda: log_prob_and_entropy(logits, targets, **kwargs),
        lambda: log_prob_and_entropy_from_hidden(hidden, weight, targets.view(1, 2), **kwargs),
        lambda: full_kl_from_logits(logits, logits, **kwargs),
        lambda: pgloss.get("grpo").from_hidden(
            hidden,
            weight,
            targets.view(1, 2),
            old_log_prob=torch.zeros(1, 2),
            advantages=torch.zeros(1),
            mask=torch.ones(1, 2, dtype=torch.bool),
            **kwargs,
        ),
    ]
    for call in calls:
        with pytest.raises(error, match=message):
            call()


def test_memory_budget_runs_on_meta_tensors():
    """The plan reads shapes only: a budget and tiles on meta tensors, both routes, and the exact KL."""
    meta = torch.device("meta")
    hidden = torch.empty(4, 6, 8, device=meta, requires_grad=True)
    weight = torch.empty(1000, 8, device=meta, requires_grad=True)
    targets = torch.empty(4, 6, dtype=torch.long, device=meta)
    base = dict(
        old_log_prob=torch.empty(4, 6, device=meta),
        advantages=torch.empty(4, device=meta),
        mask=torch.empty(4, 6, dtype=torch.bool, device=meta),
    )
    for alg, extra in (
        (pgloss.get("grpo"), dict(ref_log_prob=torch.empty(4, 6, device=meta))),
        (pgloss.get("clip_cov"), {}),
        (
            pgloss.get("grpo", kl_estimator="full", kl_coef=0.1),
            dict(ref_hidden=torch.empty(4, 6, 8, device=meta), ref_weight=torch.empty(1000, 8, device=meta)),
        ),
    ):
        for sizes in (
            dict(memory_budget=48 * 1000),
            dict(chunk_size=12, vocab_block=300),
            dict(chunk_size=5, vocab_block=300),
        ):
            out = alg.from_hidden(hidden, weight, targets, **base, **extra, **sizes)
            out.loss.backward()
            assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
            hidden.grad = weight.grad = None
