"""Inputs a kernel's author did not build, on both routes of the vocabulary loop: a bias or targets whose memory is
not one value after another (a column of a stacked tensor, stride 2; an expanded value, stride 0), a soft-cap
from 1 to 10⁴, and the launch's limits (the grid of a long sequence, offsets past 2³¹ elements). Each against the
float64 logits formed by hand (plain_head.py). The kernels run in Triton's interpreter on CPU, on CUDA on a GPU."""

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
B, T, H, V = 2, 3, 8, 37
TILES = [(None, None), (4, 10)]  # whole rows; chunks of 4 tokens in tiles of 10 columns
RTOL = 2e-5  # float32 against float64, relative to the largest value compared


def draw(seed=0):
    gen, r = plain_head.normal(seed, DEVICE)
    return dict(
        hidden=r(B, T, H),
        weight=r(V, H, scale=0.5),
        bias=r(V),
        ref_hidden=r(B, T, H),
        ref_weight=r(V, H, scale=0.5),
        upstream=r(B, T),
        upstream2=r(B, T),
        targets=torch.randint(0, V, (B, T), generator=gen).to(DEVICE),
    )


def bias_view(layout: str, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, callable]:
    """(leaf, the [V] bias as a view of it, the leaf's gradient → the bias's) for a bias laid out as `layout`:
    "stride 2" (column 1 of a [V, 2] stack), "stride 0" (values[0] expanded), "stride 0 of one value" (a
    one-element tensor expanded: a kernel reading V values reads past its storage)."""
    if layout == "stride 2":
        leaf = torch.stack([torch.full_like(values, float("nan")), values], 1).requires_grad_()
        return leaf, leaf[:, 1], lambda g: g[:, 1]
    if layout == "stride 0":
        leaf = values.clone().requires_grad_()
        return leaf, leaf[:1].expand(V), lambda g: g[:1]
    leaf = values[:1].clone().requires_grad_()
    return leaf, leaf.expand(V), lambda g: g


BIAS_LAYOUTS = ["stride 2", "stride 0", "stride 0 of one value"]


def reference_bias(layout, values):
    return values if layout == "stride 2" else values[:1].expand(V)


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("layout", BIAS_LAYOUTS)
@pytest.mark.parametrize("route", ROUTES)
def test_a_strided_or_expanded_bias_is_read_where_it_lies(route, layout, tiles):
    """log π(y), H and ∂/∂(hidden, weight, bias) with a bias view, against the float64 logits of its values.
    Before: the kernels read the bias as if contiguous (log π off by 0.1 to 4 on the kernel route)."""
    x = draw()
    leaf, bias, to_bias = bias_view(layout, x["bias"])
    h, w = x["hidden"].clone().requires_grad_(), x["weight"].clone().requires_grad_()
    with kernels.use(route):
        lp, ent = log_prob_and_entropy_from_hidden(
            h,
            w,
            x["targets"],
            head=pgloss.HeadOptions(bias=bias),
            temperature=0.7,
            chunk_size=tiles[0],
            vocab_block=tiles[1],
        )
        (lp * x["upstream"] + ent * x["upstream2"]).sum().backward()
    h2, w2 = (x[k].double().cpu().requires_grad_() for k in ("hidden", "weight"))
    b2 = reference_bias(layout, x["bias"]).double().cpu().requires_grad_()
    lp2, ent2 = plain_head.log_prob_entropy(plain_head.logits(h2, w2, b2, temperature=0.7), x["targets"].cpu())
    (lp2 * x["upstream"].double().cpu() + ent2 * x["upstream2"].double().cpu()).sum().backward()
    expected_bias_grad = b2.grad if layout == "stride 2" else b2.grad.sum().reshape(1)
    got, expected = [lp, ent, h.grad, w.grad, to_bias(leaf.grad)], [lp2, ent2, h2.grad, w2.grad, expected_bias_grad]
    assert largest_error(got, expected) <= RTOL * scale_of(expected)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("route", ROUTES)
def test_the_other_heads_bias_is_read_where_it_lies(route, beta):
    """The reference's bias of the exact KL (`full_kl_from_hidden`) and the teacher's of a divergence, a column of a
    stacked tensor. Before: the kernel route read it as if contiguous (JSD(0.5) 0.0753 against 0.1164)."""
    x = draw(seed=1)
    other_bias = torch.stack([x["bias"].flip(0), x["bias"]], 1)[:, 1]
    h = x["hidden"].clone().requires_grad_()
    mask = torch.ones(B, T, dtype=torch.bool, device=DEVICE)
    with kernels.use(route):
        if beta == 1.0:
            value = full_kl_from_hidden(
                h,
                x["weight"],
                x["ref_hidden"],
                x["ref_weight"],
                ref_head=pgloss.HeadOptions(bias=other_bias),
                vocab_block=10,
            )
        else:
            value = divergence_from_hidden(
                h,
                x["weight"],
                x["ref_hidden"],
                x["ref_weight"],
                mask,
                beta=beta,
                teacher_head=pgloss.HeadOptions(bias=other_bias),
                vocab_block=10,
            ).per_token
        (value * x["upstream"]).sum().backward()
    h2 = x["hidden"].double().cpu().requires_grad_()
    z = plain_head.logits(h2, x["weight"].cpu())
    z_other = plain_head.logits(x["ref_hidden"].cpu(), x["ref_weight"].cpu(), x["bias"].cpu())
    expected = (
        plain_head.kl(z, z_other)
        if beta == 1.0
        else (plain_head.kl(z_other, z) if beta == 0.0 else plain_head.jsd(z, z_other, beta))
    )
    (expected * x["upstream"].double().cpu()).sum().backward()
    assert largest_error([value, h.grad], [expected, h2.grad]) <= RTOL * scale_of([expected, h2.grad])


@pytest.mark.parametrize("layout", ["stride 0", "stride 2"])
@pytest.mark.parametrize("route", ROUTES)
def test_expanded_or_strided_targets_are_read_where_they_lie(route, layout):
    """Targets as `y[:1, :1].expand(B, T)` (stride 0) or every other column of wider ids (stride 2).
    Before: the kernels read `TARGETS + row` (stride 0: log π off by 0.28 to 2.5, ∂/∂hidden by 1.2 to 1.6)."""
    x = draw(seed=2)
    wide = torch.randint(0, V, (B, 2 * T), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    targets = wide[:1, :1].expand(B, T) if layout == "stride 0" else wide[:, ::2]
    h = x["hidden"].clone().requires_grad_()
    with kernels.use(route):
        lp, ent = log_prob_and_entropy_from_hidden(h, x["weight"], targets, vocab_block=10)
        (lp * x["upstream"] + ent).sum().backward()
    h2 = x["hidden"].double().cpu().requires_grad_()
    lp2, ent2 = plain_head.log_prob_entropy(plain_head.logits(h2, x["weight"].cpu()), targets.contiguous().cpu())
    (lp2 * x["upstream"].double().cpu() + ent2).sum().backward()
    assert largest_error([lp, ent, h.grad], [lp2, ent2, h2.grad]) <= RTOL * scale_of([lp2, ent2, h2.grad])


# --- the soft-cap's precision -------------------------------------------------------------------------------


SOFTCAPS = [1.0, 10.0, 100.0, 1e3, 1e4]


def softcap_errors(route, softcap):
    """The largest error in log π (and H) and in ∂/∂W against float64, logits near 3 under a soft-cap c: for a
    large c, s·r/c is near 0, where tanh(u) as 1 − 2/(e^{2u} + 1) loses float32's absolute precision, times c."""
    gen = torch.Generator().manual_seed(5)
    hidden = (3.0 + 0.1 * torch.randn(B, T, H, generator=gen, dtype=torch.float64)) / H**0.5
    weight = 1.0 + 0.05 * torch.randn(V, H, generator=gen, dtype=torch.float64)
    hidden, weight = hidden.div(H**0.5).float().to(DEVICE), weight.float().to(DEVICE)  # logits near 3
    targets = torch.randint(0, V, (B, T), generator=gen).to(DEVICE)
    w = weight.clone().requires_grad_()
    with kernels.use(route):
        lp, ent = log_prob_and_entropy_from_hidden(hidden, w, targets, head=pgloss.HeadOptions(softcap=softcap))
        (lp + ent).sum().backward()
    w2 = weight.double().cpu().requires_grad_()
    lp2, ent2 = plain_head.log_prob_entropy(plain_head.logits(hidden.cpu(), w2, softcap=softcap), targets.cpu())
    (lp2 + ent2).sum().backward()
    return largest_error([lp, ent], [lp2, ent2]), largest_error([w.grad], [w2.grad])


@pytest.mark.parametrize("softcap", SOFTCAPS)
def test_the_kernels_soft_cap_is_as_precise_as_the_torch_routes(softcap):
    """For every c, the kernel route's error is within a small factor of the torch route's (float32's own
    tanh). Before: c = 10⁴ gave the kernel route 9e-5 in log π and 5e-4 in ∂/∂W, against 5e-8 on the torch route."""
    (torch_value, torch_grad), (kernel_value, kernel_grad) = (softcap_errors(r, softcap) for r in ROUTES)
    assert kernel_value <= 4 * torch_value + 2e-7
    assert kernel_grad <= 4 * torch_grad + 2e-7


# --- the launch ---------------------------------------------------------------------------------------------

CUDA_GRID = (2**31 - 1, 65535, 65535)  # the largest grid CUDA launches, per axis (x, y, z)


@pytest.mark.parametrize("rows", [1, 65535, 65536, 2**20, 2**31 - 1])
def test_the_grid_of_any_chunk_fits_cudas_limits(rows):
    """One program per row on the grid's x axis, up to 2³¹ − 1 rows (Liger-Kernel #1294: a grid axis of
    65,536 rows and more crashed an unchunked Triton loss)."""
    grid = kernels.grid(rows)
    assert len(grid) <= 3 and grid[0] == rows
    # CUDA_GRID holds the limits of all three axes: only the grid's own axes are checked against theirs
    assert all(0 < n <= limit for n, limit in zip(grid, CUDA_GRID, strict=False))


def test_a_chunk_beyond_the_grid_is_refused_by_name():
    with pytest.raises(ValueError, match=r"^chunk_size .* 2147483648 rows, .* at most 2147483647"):
        kernels.grid(2**31)


def test_a_tile_wider_than_32_bit_column_offsets_is_refused_by_name():
    kernels.launch_shape(kernels.MAX_WIDTH)
    with pytest.raises(ValueError, match=r"^vocab_block .* columns"):
        kernels.launch_shape(kernels.MAX_WIDTH + 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a launch past 2³¹ elements needs a GPU's memory")
def test_a_tile_past_two_to_the_31_elements_on_cuda():
    """A chunk of 65,537 tokens (one program per row, past 65,535) in one tile of 32,771 columns: 2.1477e9 > 2³¹
    logits, whose 32-bit offsets would wrap (Cut Cross-Entropy #39). Against the kernel route's own small tiles."""
    rows, vocab, size = 65537, 32771, 16
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, rows, size, device="cuda", generator=gen, dtype=torch.bfloat16)
    weight = torch.randn(vocab, size, device="cuda", generator=gen, dtype=torch.bfloat16) / 4
    targets = torch.randint(0, vocab, (1, rows), device="cuda", generator=gen)
    results = []
    for tiles in ((rows, vocab), (4096, 4096)):
        w = weight.clone().requires_grad_()
        with kernels.use("kernel"):
            lp, ent = log_prob_and_entropy_from_hidden(hidden, w, targets, chunk_size=tiles[0], vocab_block=tiles[1])
            (lp.sum() + ent.sum()).backward()
        results.append([lp, ent, w.grad.float()])
        del w
        torch.cuda.empty_cache()
    (lp, ent, gw), (lp2, ent2, gw2) = results
    assert torch.isfinite(lp).all() and torch.isfinite(gw).all()
    torch.testing.assert_close(lp, lp2, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent, ent2, rtol=0, atol=1e-4)
    torch.testing.assert_close(gw, gw2, rtol=2e-2, atol=2e-2 * gw2.abs().max().item())
