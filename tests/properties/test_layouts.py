"""Every tensor argument of every public call from hidden states, in any memory layout: a permuted storage order
(a transposed weight), every other element (a column of a stacked tensor), extra rows left out (`hidden[:, :-1]`),
an offset into a larger storage, and expanded dimensions (stride 0). Each call with the views equals the call with
their `.contiguous()` copies, in value and in gradient (hidden, weight, bias), in float32, bfloat16 and float16,
on both routes of the vocabulary loop (the kernels in Triton's interpreter on CPU; on CUDA as they run there:
`-k cuda`). The storage around a view holds NaN (id 0, False for integers and masks), so a kernel that reads past
a view or ignores a stride shows. The plain loss call's layouts are tested with the plain call."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pgloss
from pgloss.from_hidden import loss_from_hidden
from pgloss.vocab import kernels
from pgloss.vocab.divergence import divergence_from_hidden
from pgloss.vocab.full_kl import full_kl_from_hidden
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
# (device, route): on CPU the kernels run in Triton's interpreter; on CUDA "auto" takes the kernel route.
PLACES = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cpu", "kernel", id="cpu-kernel"),
    pytest.param("cuda", "torch", id="cuda-torch", marks=pytest.mark.skipif(not CUDA, reason="no GPU")),
    pytest.param("cuda", "auto", id="cuda-kernel", marks=pytest.mark.skipif(not CUDA, reason="no GPU")),
]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# The view against the contiguous copy, relative to the largest value compared (at least 1): the two calls differ
# only in the matmuls' order of summation, rounded to the head's dtype (half precision: a unit or two in the last
# place).
RTOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}
EXAMPLES = settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Layout:
    """How a view of a given shape lies in memory: its dimensions' storage order, a step per dimension (2: every
    other element), extra elements left out at the end of each dimension, an offset into the storage, and the
    dimensions expanded from one element (stride 0)."""

    order: tuple[int, ...]
    steps: tuple[int, ...]
    extra: tuple[int, ...]
    offset: int
    expanded: tuple[bool, ...]


@st.composite
def layouts(draw, ndim: int) -> Layout:
    flags = st.lists(st.booleans(), min_size=ndim, max_size=ndim)
    return Layout(
        tuple(draw(st.permutations(range(ndim)))),
        tuple(1 + s for s in draw(flags)),
        tuple(int(e) for e in draw(flags)),
        draw(st.sampled_from([0, 3])),
        tuple(draw(flags)),
    )


def laid_out(values: torch.Tensor, layout: Layout) -> torch.Tensor:
    """A view holding `values` (of size 1 along `layout.expanded`, expanded to the full shape after) as `layout`
    says; the rest of its storage NaN (0, False)."""
    order = layout.order
    inner = values.permute(order)
    steps = [layout.steps[d] for d in order]
    padded = [n * s + layout.extra[d] for n, s, d in zip(inner.shape, steps, order, strict=True)]
    fill = math.nan if values.is_floating_point() else 0
    storage = torch.full((layout.offset + math.prod(padded),), fill, dtype=values.dtype, device=values.device)
    view = storage[layout.offset :].view(padded)[
        tuple(slice(0, n * s, s) for n, s in zip(inner.shape, steps, strict=True))
    ]
    view.copy_(inner)
    return view.permute(sorted(range(len(order)), key=order.__getitem__))


def argument(draw, make, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(the view, its contiguous copy) of values `make(shape)` in a drawn layout."""
    layout = draw(layouts(len(shape)))
    base = make(tuple(1 if e else n for n, e in zip(shape, layout.expanded, strict=True)))
    view = laid_out(base, layout).expand(shape)
    return view, view.contiguous()


@st.composite
def calls(draw, device: str, two_heads: bool = False, loss: bool = False):
    """A call's arguments twice, as views and as contiguous copies: the trained head (hidden, weight, bias), the
    targets, the mask, the other head for a pair (hidden, weight, bias), and a loss's old log-probs and
    advantages; the sizes, the dtype and the tiles drawn too."""
    dtype = draw(st.sampled_from(DTYPES))
    batch, length, size, vocab = draw(st.integers(1, 2)), draw(st.integers(1, 3)), 4, draw(st.integers(3, 19))
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)

    def floats(scale):
        return lambda shape: (scale * torch.randn(shape, generator=gen)).to(device, dtype)

    def ids(shape):
        return torch.randint(0, vocab, shape, generator=gen).to(device)

    def valid(shape):
        mask = torch.rand(shape, generator=gen) < 0.75
        return mask.to(device)

    spec = dict(
        hidden=(floats(1.0), (batch, length, size)),
        weight=(floats(0.7), (vocab, size)),
        bias=(floats(0.5), (vocab,)),
        targets=(ids, (batch, length)),
        mask=(valid, (batch, length)),
    )
    if two_heads:
        spec |= dict(
            other_hidden=(floats(1.0), (batch, length, size + 2)),
            other_weight=(floats(0.7), (vocab, size + 2)),
            other_bias=(floats(0.5), (vocab,)),
        )
    if loss:
        spec |= dict(
            old_log_prob=(lambda shape: -torch.rand(shape, generator=gen).to(device) - 0.5, (batch, length)),
            advantages=(lambda shape: torch.randn(shape, generator=gen).to(device), (batch,)),
        )
    views, copies = {}, {}
    for name, (make, shape) in spec.items():
        views[name], copies[name] = argument(draw, make, shape)
    tiles = dict(chunk_size=draw(st.sampled_from([None, 2, 5])), vocab_block=draw(st.sampled_from([None, 4])))
    return views, copies, tiles, dtype


def differentiated(args: dict) -> dict:
    """`args` with the trained head's tensors as fresh leaves (the views themselves, as a user passes them)."""
    return {k: v.detach().requires_grad_() if k in ("hidden", "weight", "bias") else v for k, v in args.items()}


def assert_same(call, views: dict, copies: dict, route: str, dtype: torch.dtype) -> None:
    """`call(args)` (returning tensors whose sum it differentiates) on the views and on the copies: equal values
    and gradients to hidden, weight and bias, within the dtype's rounding of the matmuls."""
    results = []
    for args in (views, copies):
        args = differentiated(args)
        with kernels.use(route):
            values = call(args)
            sum(v.float().sum() for v in values).backward()
        results.append(values + [args[k].grad for k in ("hidden", "weight", "bias")])
    for got, expected in zip(*results, strict=True):
        # the matmuls' rounding is relative to the logits (order 1), not to a small value computed from them
        scale = max(expected.detach().abs().nan_to_num(0.0).max().item(), 1.0)  # NaN: a metric with no token
        torch.testing.assert_close(
            got.detach().float(), expected.detach().float(), rtol=0, atol=RTOL[dtype] * scale, equal_nan=True
        )
    assert all(torch.isfinite(g).all() for g in results[0][-3:])


def log_prob_and_entropy(args, tiles):
    lp, ent = log_prob_and_entropy_from_hidden(
        args["hidden"],
        args["weight"],
        args["targets"],
        head=pgloss.HeadOptions(bias=args["bias"], softcap=3.0),
        mask=args["mask"],
        **tiles,
    )
    return [lp, ent]


def loss(args, tiles, algorithm="grpo"):
    alg = pgloss.get(algorithm, kl_coef=0.0, entropy_coef=0.01)
    out = loss_from_hidden(
        alg,
        args["hidden"],
        args["weight"],
        args["targets"],
        head=pgloss.HeadOptions(bias=args["bias"]),
        old_log_prob=args["old_log_prob"],
        advantages=args["advantages"],
        mask=args["mask"],
        **tiles,
    )
    return [out.loss, *out.metrics.values()]


def from_hidden_exact_kl(args, tiles):
    alg = pgloss.get("grpo", kl_estimator="full", kl_coef=0.1, entropy_coef=0.01)
    out = alg.from_hidden(
        args["hidden"],
        args["weight"],
        args["targets"],
        head=pgloss.HeadOptions(bias=args["bias"]),
        old_log_prob=args["old_log_prob"],
        advantages=args["advantages"],
        mask=args["mask"],
        ref_hidden=args["other_hidden"],
        ref_weight=args["other_weight"],
        ref_head=pgloss.HeadOptions(bias=args["other_bias"]),
        **tiles,
    )
    return [out.loss, *out.metrics.values()]


def full_kl(args, tiles):
    return [
        full_kl_from_hidden(
            args["hidden"],
            args["weight"],
            args["other_hidden"],
            args["other_weight"],
            head=pgloss.HeadOptions(bias=args["bias"]),
            ref_head=pgloss.HeadOptions(bias=args["other_bias"]),
            mask=args["mask"],
            **tiles,
        )
    ]


def divergence(args, tiles, beta=0.5):
    out = divergence_from_hidden(
        args["hidden"],
        args["weight"],
        args["other_hidden"],
        args["other_weight"],
        args["mask"],
        beta=beta,
        head=pgloss.HeadOptions(bias=args["bias"]),
        teacher_head=pgloss.HeadOptions(bias=args["other_bias"], softcap=2.0),
        **tiles,
    )
    return [out.loss, out.per_token]


# Each public call from hidden states: its call above and what its arguments need (a second head, the loss's inputs).
ENTRY_POINTS = {
    "log_prob_and_entropy_from_hidden": (log_prob_and_entropy, {}),
    "loss_from_hidden": (loss, dict(loss=True)),
    "from_hidden with the exact KL": (from_hidden_exact_kl, dict(two_heads=True, loss=True)),
    "full_kl_from_hidden": (full_kl, dict(two_heads=True)),
    "divergence_from_hidden": (divergence, dict(two_heads=True)),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("device, route", PLACES)
@EXAMPLES
@given(data=st.data())
def test_views_give_what_their_contiguous_copies_give(entry, device, route, data):
    call, needs = ENTRY_POINTS[entry]
    views, copies, tiles, dtype = data.draw(calls(device, **needs))
    assert_same(lambda args: call(args, tiles), views, copies, route, dtype)


def test_the_layouts_are_what_they_say():
    """The strategy's views: a permuted order, steps, extra elements, an offset and expanded dimensions give the
    strides they describe, and the values they were given."""
    values = torch.arange(6.0).reshape(2, 3)
    view = laid_out(values, Layout(order=(1, 0), steps=(2, 1), extra=(1, 0), offset=3, expanded=(False, False)))
    assert torch.equal(view, values) and view.stride() == (2, 1 * 5) and view.storage_offset() == 3
    expanded = laid_out(values[:1], Layout((0, 1), (1, 2), (0, 1), 0, (True, False))).expand(4, 3)
    assert expanded.stride() == (0, 2) and torch.equal(expanded, values[:1].expand(4, 3))
