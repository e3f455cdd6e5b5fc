"""Top-k distillation (`pgloss.topk_divergence_from_logits` / `_from_hidden`, the student-top-k forms): against the
float64 loop written from the trainers' formulas (tests/loops/topk.py) for every option set, gradcheck in float64,
from hidden states equal to from logits (values and gradients to hidden, weight, bias), micro-batches counted by one
Normalizer adding up to the whole call, nothing of N x V saved for backward, the Triton routes refusing by name, and
bad input named."""

from __future__ import annotations

import math

import loops
import pytest
import torch
from properties.micro_batches import cut, micro_batches

import pgloss
from pgloss.core.aggregate import aggregate
from pgloss.core.normalizer import Normalizer
from pgloss.vocab import backends

B, T, V, H, K = 3, 5, 37, 8, 6
TAU = 0.7
MASK = torch.arange(T)[None, :] < torch.tensor([5, 3, 4])[:, None]
TILES = [dict(chunk_size=4), dict(chunk_size=4, vocab_block=10), dict(chunk_size=7, vocab_block=13)]

# Each trainer's variant as the option set that reproduces it (docs/reference.md, "Top-k distillation").
PRESETS = {
    "verl": dict(beta=0.0, tail="drop", log_prob_min=-10.0, value_range=(0.0, 10.0)),
    "nemo_rl": dict(beta=0.5, blend="sum", tail="renormalise"),
    "nemo_rl_reverse": dict(beta=1.0, tail="renormalise"),
    "nemo_rl_zero_outside_topk": dict(beta=0.5, blend="sum", tail="drop", outside_log_prob=-100.0),
    "ms_swift": dict(beta=0.5, tail="renormalise"),
    "trl_async": dict(beta=0.0, tail="bucket"),
    "trl_jsd_bucket": dict(beta=0.3, tail="bucket"),
    "reverse_drop": dict(beta=1.0, tail="drop"),
}


def make(seed=0, dtype=torch.float64):
    """Student hidden states, head and bias; the teacher's top-k ids (distinct per row) and log-probs (from a
    teacher's softmax: they sum to less than 1); row (0, 1) padded after 3 ids, row (2, 0) with no id."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7).to(dtype)
    bias = (torch.randn(V, generator=g, dtype=torch.float64) * 0.5).to(dtype)
    teacher = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2, dim=-1)
    lp, ids = teacher.topk(K, dim=-1)
    ids, lp = ids.clone(), lp.clone()
    ids[0, 1, 3:], lp[0, 1, 3:] = -1, float("-inf")
    ids[2, 0, :] = -1
    return hidden, weight, bias, ids, lp.to(dtype)


def loop(logits, ids, lp, mask, temperature, **options):
    """The float64 loop per position, 0 where masked."""
    out = torch.zeros(logits.shape[:2], dtype=torch.float64)
    for b in range(logits.shape[0]):
        for t in range(logits.shape[1]):
            if mask[b, t]:
                out[b, t] = loops.topk_divergence(
                    logits[b, t].tolist(), ids[b, t].tolist(), lp[b, t].tolist(), temperature=temperature, **options
                )
    return out


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("tiles", range(len(TILES)))
def test_logits_and_hidden_match_the_loop(name, tiles):
    hidden, weight, bias, ids, lp = make(1)
    logits = hidden @ weight.T + bias
    expected = loop(logits, ids, lp, MASK, TAU, **PRESETS[name])
    out = pgloss.topk_divergence_from_logits(logits, ids, lp, MASK, temperature=TAU, **PRESETS[name], **TILES[tiles])
    torch.testing.assert_close(out.per_token, expected, rtol=0, atol=1e-12)
    fused = pgloss.topk_divergence_from_hidden(
        hidden, weight, ids, lp, MASK, temperature=TAU, head=pgloss.HeadOptions(bias), **PRESETS[name], **TILES[tiles]
    )
    torch.testing.assert_close(fused.per_token, expected, rtol=0, atol=1e-12)
    assert float(out.per_token[2, 0]) == 0.0  # no id: D = 0


@pytest.mark.parametrize("name", list(PRESETS))
def test_gradcheck_from_logits_and_from_hidden_with_head_options(name):
    g = torch.Generator().manual_seed(2)
    hidden, weight, bias = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((2, 3, 4), (11, 4), (11,)))
    ids = torch.stack([torch.randperm(11, generator=g)[:3] for _ in range(6)]).view(2, 3, 3)
    ids[0, 1, 2] = -1
    lp = torch.log_softmax(torch.randn(2, 3, 11, generator=g, dtype=torch.float64), -1).gather(-1, ids.clamp(min=0))
    mask = torch.tensor([[True, True, False], [True] * 3])
    options = dict(PRESETS[name], temperature=TAU, chunk_size=4, vocab_block=4)
    if name == "verl":
        options["log_prob_min"] = -1.5  # a clamp that binds on some ids here, away from its kink
    logits = (hidden @ weight.T).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda z: pgloss.topk_divergence_from_logits(z, ids, lp, mask, **options).per_token, (logits,)
    )
    head = dict(logit_scale=1.3, softcap=2.5)

    def fused(h, w, b):
        return pgloss.topk_divergence_from_hidden(
            h, w, ids, lp, mask, head=pgloss.HeadOptions(b, **head), **options
        ).per_token

    assert torch.autograd.gradcheck(fused, (hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()))


@pytest.mark.parametrize("name", ["verl", "nemo_rl_zero_outside_topk", "trl_jsd_bucket"])
def test_hidden_equals_logits_values_and_gradients(name):
    """From hidden states (bias, scale, soft-cap) equal to from the logits they give: values and gradients to
    hidden, weight and bias, whole-vocabulary and tiled."""
    hidden, weight, bias, ids, lp = make(3)
    head = dict(logit_scale=1.2, softcap=3.0)
    upstream = torch.randn(B, T, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    for tiles in TILES:
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        h, w, b = leaves
        logits = head["softcap"] * torch.tanh(head["logit_scale"] * (h @ w.T + b) / head["softcap"])
        a = pgloss.topk_divergence_from_logits(logits, ids, lp, MASK, temperature=TAU, **PRESETS[name], **tiles)
        grads_a = torch.autograd.grad((a.per_token * upstream).sum(), leaves)
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        h, w, b = leaves
        f = pgloss.topk_divergence_from_hidden(
            h, w, ids, lp, MASK, temperature=TAU, head=pgloss.HeadOptions(b, **head), **PRESETS[name], **tiles
        )
        grads_f = torch.autograd.grad((f.per_token * upstream).sum(), leaves)
        torch.testing.assert_close(f.per_token, a.per_token, rtol=0, atol=1e-13)
        for x, y in zip(grads_f, grads_a, strict=True):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-13)
            assert x.abs().max() > 0


def test_masked_hidden_states_are_never_read():
    hidden, weight, _, ids, lp = make(5)
    poisoned = hidden.clone()
    poisoned[~MASK] = float("nan")
    h = poisoned.requires_grad_()
    out = pgloss.topk_divergence_from_hidden(h, weight, ids, lp, MASK, beta=0.0, chunk_size=4)
    out.loss.backward()
    clean = pgloss.topk_divergence_from_hidden(hidden, weight, ids, lp, MASK, beta=0.0, chunk_size=4)
    torch.testing.assert_close(out.per_token, clean.per_token, rtol=0, atol=0)
    assert torch.isfinite(h.grad).all() and (h.grad[~MASK] == 0).all()


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_with_a_normalizer_add_up_to_the_call(mode):
    hidden, weight, _, ids, lp = make(6)
    leaf = hidden.clone().requires_grad_()
    options = dict(PRESETS["verl"], loss_agg_mode=mode, chunk_size=4)
    whole = pgloss.topk_divergence_from_hidden(leaf, weight, ids, lp, MASK, **options)
    torch.testing.assert_close(whole.loss, aggregate(whole.per_token, MASK, mode), rtol=0, atol=0)
    (g_whole,) = torch.autograd.grad(whole.loss, leaf)
    parts = [slice(0, 2), slice(2, 3)]
    normalizer = Normalizer.count(cut(MASK, parts))
    leaf = hidden.clone().requires_grad_()
    total = micro_batches(
        lambda rows: pgloss.topk_divergence_from_hidden(
            leaf[rows], weight, ids[rows], lp[rows], MASK[rows], normalizer=normalizer, **options
        ),
        parts,
    )
    torch.testing.assert_close(total, whole.loss.detach(), rtol=0, atol=1e-14)
    torch.testing.assert_close(leaf.grad, g_whole, rtol=0, atol=1e-14)


def test_nothing_of_n_by_v_is_saved_for_backward():
    hidden, weight, bias, ids, lp = make(7)
    saved = []
    h = hidden.clone().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = pgloss.topk_divergence_from_hidden(
            h,
            weight,
            ids,
            lp,
            MASK,
            head=pgloss.HeadOptions(bias),
            vocab_block=10,
            **PRESETS["nemo_rl_zero_outside_topk"],
        )
    out.loss.backward()
    assert saved and all(math.prod(s) < B * T * V for s in saved), saved


@pytest.mark.parametrize("tail", ["renormalise", "bucket"])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_student_topk_matches_the_loop_and_hidden_equals_logits(tail, beta):
    """TRL's self-distillation support: the student's own top-k ids, the teacher's full-vocabulary log-probs at
    them; from two heads equal to from their logits (values and the student's gradients)."""
    hidden, weight, bias, _, _ = make(8)
    g = torch.Generator().manual_seed(9)
    t_hidden, t_weight = torch.randn(B, T, 5, generator=g, dtype=torch.float64), torch.randn(V, 5, generator=g).double()
    logits, t_logits = hidden @ weight.T + bias, t_hidden @ t_weight.T
    expected = torch.zeros(B, T, dtype=torch.float64)
    for b, t in zip(*torch.nonzero(MASK, as_tuple=True), strict=True):
        ids, lp = loops.student_topk(logits[b, t].tolist(), t_logits[b, t].tolist(), 4, TAU)
        expected[b, t] = loops.topk_divergence(logits[b, t].tolist(), ids, lp, beta=beta, tail=tail, temperature=TAU)
    for tiles in TILES:
        z = logits.clone().requires_grad_()
        a = pgloss.student_topk_divergence_from_logits(
            z, t_logits, MASK, k=4, beta=beta, tail=tail, temperature=TAU, **tiles
        )
        torch.testing.assert_close(a.per_token, expected, rtol=0, atol=1e-12)
        leaves = [x.clone().requires_grad_() for x in (hidden, weight, bias)]
        f = pgloss.student_topk_divergence_from_hidden(
            leaves[0],
            leaves[1],
            t_hidden,
            t_weight,
            MASK,
            k=4,
            beta=beta,
            tail=tail,
            temperature=TAU,
            head=pgloss.HeadOptions(leaves[2]),
            **tiles,
        )
        torch.testing.assert_close(f.per_token, expected, rtol=0, atol=1e-12)
        (g_z,) = torch.autograd.grad(a.loss, z)
        grads = torch.autograd.grad(f.loss, leaves)
        torch.testing.assert_close(grads[0], torch.einsum("btv,vh->bth", g_z, weight), rtol=0, atol=1e-13)
        torch.testing.assert_close(grads[2], g_z.sum(dim=(0, 1)), rtol=0, atol=1e-13)


def test_the_triton_routes_refuse_top_k_by_name():
    hidden, weight, _, ids, lp = make(10, dtype=torch.float32)
    for route in ("kernel", "head-kernel"):
        with backends.use(route), pytest.raises(ValueError, match="SupportLogProbs"):
            pgloss.topk_divergence_from_hidden(hidden, weight, ids, lp, MASK, beta=0.0)


def test_bad_input_is_named():
    hidden, weight, _, ids, lp = make(11)
    logits = hidden @ weight.T
    call = pgloss.topk_divergence_from_logits
    with pytest.raises(TypeError, match="^teacher_ids must hold integer token ids"):
        call(logits, ids.double(), lp, MASK, beta=0.0)
    with pytest.raises(ValueError, match=r"^teacher_ids must have shape \[3, 5, k\]"):
        call(logits, ids[:, :2], lp, MASK, beta=0.0)
    bad = ids.clone()
    bad[0, 0, 0] = V
    with pytest.raises(ValueError, match=rf"^teacher_ids must hold token ids in \[0, {V}\) .* got {V} at \(0, 0, 0\)"):
        call(logits, bad, lp, MASK, beta=0.0)
    bad[0, 0, 0] = -2
    with pytest.raises(ValueError, match="^teacher_ids must hold token ids"):
        call(logits, bad, lp, MASK, beta=0.0)
    bad[0, 0, 0] = V  # at a masked position: not read
    masked = MASK.clone()
    masked[0, 0] = False
    call(logits, bad, lp, masked, beta=0.0)
    with pytest.raises(ValueError, match=r"^teacher_log_probs must have the shape of the ids"):
        call(logits, ids, lp[..., :2], MASK, beta=0.0)
    with pytest.raises(TypeError, match="^teacher_log_probs must be a floating tensor"):
        call(logits, ids, ids, MASK, beta=0.0)
    nan = lp.clone()
    nan[1, 1, 0] = float("nan")
    with pytest.raises(ValueError, match=r"^teacher_log_probs must be finite at every id .* at \(1, 1, 0\)"):
        call(logits, ids, nan, MASK, beta=0.0)
    with pytest.raises(ValueError, match="^beta must be in"):
        call(logits, ids, lp, MASK, beta=1.5)
    with pytest.raises(ValueError, match="^tail must be one of"):
        call(logits, ids, lp, MASK, beta=0.0, tail="keep")
    with pytest.raises(ValueError, match="^blend must be one of"):
        call(logits, ids, lp, MASK, beta=0.0, blend="avg")
    with pytest.raises(ValueError, match='^outside_log_prob needs tail="drop"'):
        call(logits, ids, lp, MASK, beta=1.0, tail="bucket", outside_log_prob=-100.0)
    with pytest.raises(ValueError, match='^outside_log_prob weights the reverse KL: .* blend="sum"'):
        call(logits, ids, lp, MASK, beta=0.5, outside_log_prob=-100.0)
    with pytest.raises(ValueError, match="^value_range must have low <= high"):
        call(logits, ids, lp, MASK, beta=0.0, value_range=(1.0, 0.0))
    with pytest.raises(ValueError, match="^mask must have shape"):
        call(logits, ids, lp, MASK[:, :2], beta=0.0)
    with pytest.raises(ValueError, match=r"^k must be in \[1, 37\]"):
        pgloss.student_topk_divergence_from_logits(logits, logits, MASK, k=0, beta=0.0)
    with pytest.raises(TypeError, match="^weight has dtype"):
        pgloss.topk_divergence_from_hidden(hidden, weight.float(), ids, lp, MASK, beta=0.0)
    with pytest.raises(TypeError, match="head=pgloss.HeadOptions"):
        pgloss.topk_divergence_from_hidden(hidden, weight, ids, lp, MASK, beta=0.0, bias=weight[:, 0])


@pytest.mark.parametrize("name", ["verl", "nemo_rl_zero_outside_topk", "trl_jsd_bucket"])
@pytest.mark.parametrize("vocab_block", [None, 10])
def test_meta_tensors_read_no_value_on_the_host(name, vocab_block):
    """Every entry point, forward and backward, on meta tensors: no `.item()`, `bool(tensor)` or tensor-indexed
    slicing (each raises there, where an accelerator would wait for the host)."""
    meta = lambda *s: torch.empty(*s, device="meta")  # noqa: E731
    hidden, weight, bias = meta(B, T, H).requires_grad_(), meta(V, H).requires_grad_(), meta(V).requires_grad_()
    ids = torch.zeros(B, T, K, dtype=torch.long, device="meta")
    mask = torch.ones(B, T, dtype=torch.bool, device="meta")
    sizes = dict(chunk_size=4, vocab_block=vocab_block)
    out = pgloss.topk_divergence_from_hidden(
        hidden, weight, ids, meta(B, T, K), mask, head=pgloss.HeadOptions(bias, softcap=3.0), **PRESETS[name], **sizes
    )
    out.loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape and bias.grad.shape == bias.shape
    logits = meta(B, T, V).requires_grad_()
    pgloss.topk_divergence_from_logits(logits, ids, meta(B, T, K), mask, **PRESETS[name], **sizes).loss.backward()
    assert logits.grad.shape == logits.shape
    student = pgloss.student_topk_divergence_from_hidden(
        hidden, weight, meta(B, T, 5), meta(V, 5), mask, k=K, beta=0.5, tail="bucket", **sizes
    )
    student.loss.backward()


@pytest.mark.compile
@pytest.mark.parametrize("name", ["nemo_rl_zero_outside_topk", "trl_jsd_bucket"])
def test_compiles_whole_forward_and_backward(name):
    """torch.compile(fullgraph=True) over vocabulary tiles with a bias, scale and soft-cap: the eager loss and
    gradients (a host read would be a graph break, which fullgraph refuses)."""
    from vocab.head_checks import assert_compiles_like_eager

    hidden, weight, bias, ids, lp = make(12, dtype=torch.float32)

    def call(h, w, b):
        head = pgloss.HeadOptions(b, logit_scale=1.2, softcap=3.0)
        return pgloss.topk_divergence_from_hidden(
            h, w, ids, lp, MASK, head=head, chunk_size=4, vocab_block=10, **PRESETS[name]
        ).loss

    assert_compiles_like_eager(call, [hidden, weight, bias])
