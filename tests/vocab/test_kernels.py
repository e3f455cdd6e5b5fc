"""The kernel route of the vocabulary loop (pgloss.vocab.kernels, triton_kernels.py) against its references: the
materialised float64 logits and the torch route. On a machine without a GPU the kernels run in Triton's
interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 before triton is imported); on a GPU, on CUDA.

Every name's loss from hidden states on both of the loss's routes (one pass, recompute), the head options (bias,
logit scale, soft-cap, τ) with whole-vocabulary chunks and vocabulary tiles, the exact KL to a reference head,
the three divergences of distillation, bfloat16 heads, and the route's choice and refusals. The kernels compute in
float32, so float32 inputs are held against float64 at float32's tolerance.
"""

import pytest
import torch
from properties.host_sync import no_host_sync
from vocab import test_fused, test_fused_head
from vocab.head_checks import records
from vocab.test_fused_head import MASK, OPTIONS, ROUTES, TAU, TILES, losses, make, materialised_loss, options

import pgloss
from pgloss.vocab import kernels
from pgloss.vocab.divergence import divergence_from_hidden, divergence_from_logits
from pgloss.vocab.full_kl import full_kl_from_hidden
from pgloss.vocab.fused import log_prob_and_entropy_from_hidden

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float32 kernels against float64 references: relative to the largest value compared
RTOL = 2e-5


def on_device(x: dict, dtype=torch.float32) -> dict:
    return {k: (v.to(DEVICE, dtype) if v.is_floating_point() else v.to(DEVICE)) for k, v in x.items()}


def assert_near(got, expected, rtol=RTOL):
    """Each pair within rtol of the largest |expected| (None pairs with None)."""
    for a, b in zip(got, expected, strict=True):
        if b is None:
            assert a is None
            continue
        b = b.detach().double().cpu()
        scale = max(b.abs().max().item(), 1e-6)
        torch.testing.assert_close(a.detach().double().cpu(), b, rtol=0, atol=rtol * scale)


def kernel_leaves(x):
    return [x[k].detach().clone().requires_grad_() for k in ("hidden", "weight", "bias")]


# --- every name -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", test_fused.PATHS)
@pytest.mark.parametrize("name", pgloss.names())
def test_every_algorithm_on_the_kernel_route_matches_float64(name, path):
    """The loss, metrics and gradients of `from_hidden` with float32 inputs on the kernel route against the
    float64 materialised logits (the test of the torch route, test_fused.py, at float32's tolerance)."""
    alg = test_fused.algorithm(name, kl_coef=0.05, entropy_coef=0.01)
    inputs64 = test_fused.leaves(test_fused.make())
    inputs32 = test_fused.leaves({k: v.to(DEVICE) for k, v in test_fused.make(dtype=torch.float32).items()})
    extra = dict(
        group_ids=torch.tensor([0, 0, 1]),
        scores=torch.tensor([1.0, 0.0, 1.0]),
        teacher_log_prob=inputs32["teacher_log_prob"],
    )
    torch.manual_seed(0)  # Clip-Cov draws from the global generator: the same draw on both paths
    with kernels.use("kernel"):
        out, gh, gw = test_fused.run(
            test_fused.fused,
            alg,
            inputs32,
            temperature=TAU,
            chunk_size=test_fused.PATHS[path],
            **{k: v.to(DEVICE) for k, v in extra.items()},
        )
    torch.manual_seed(0)
    extra64 = dict(extra, scores=extra["scores"].double(), teacher_log_prob=inputs64["teacher_log_prob"])
    ref, gh_ref, gw_ref = test_fused.run(test_fused.unfused, alg, inputs64, temperature=TAU, **extra64)
    assert out.loss.dtype == gh.dtype == gw.dtype == torch.float32
    assert_near([out.loss, out.per_token, gh, gw], [ref.loss, ref.per_token, gh_ref, gw_ref], rtol=1e-4)
    assert out.metrics.keys() == ref.metrics.keys()
    assert_near(list(out.metrics.values()), list(ref.metrics.values()), rtol=1e-4)
    assert gw.abs().sum() > 0 and (gh[~inputs32["mask"]] == 0).all()


# --- the head's options -------------------------------------------------------------------------------------


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("name", list(OPTIONS))
def test_log_prob_and_entropy_with_every_head_option(name, tiles):
    """log π(y), H and their gradients to hidden, weight and bias, the upstream gradients as an autograd sum
    gives them (expanded, stride 0) and weighted, against the materialised float64 logits."""
    x = make(seed=1)
    x32 = on_device(x)
    (h1, w1, b1), (h2, w2, b2) = kernel_leaves(x32), test_fused_head.leaves(x)
    opts1, opts2 = options(name, x32, b1), options(name, x, b2)
    with kernels.use("kernel"):
        lp, ent = log_prob_and_entropy_from_hidden(
            h1, w1, x32["targets"], temperature=TAU, chunk_size=tiles[0], vocab_block=tiles[1], **records(opts1)
        )
        (lp * x32["upstream"] + ent.sum()).sum().backward()
    lp_ref, ent_ref = pgloss.log_prob_and_entropy(
        test_fused_head.policy_logits(h2, w2, opts2), x["targets"], temperature=TAU
    )
    (lp_ref * x["upstream"] + ent_ref.sum()).sum().backward()
    assert_near([lp, ent, h1.grad, w1.grad], [lp_ref, ent_ref, h2.grad, w2.grad])
    assert_near([b1.grad], [b2.grad if "bias" in opts1 else None])


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("name", ["bias", "softcap", "all"])
@pytest.mark.parametrize("loss", ["grpo", "grpo+full_kl"])
def test_loss_with_head_options_on_both_routes(loss, name, route):
    """`from_hidden` with the head's options (and the reference head's, for the exact KL) on the kernel route,
    float32, against the plain call on the materialised float64 logits."""
    x = make(seed=2)
    algorithm, inputs = losses(x, options(name, x))[loss]
    x32 = on_device(x)
    inputs32 = {k: v.to(DEVICE, torch.float32) if v.is_floating_point() else v.to(DEVICE) for k, v in inputs.items()}
    (h1, w1, b1), (h2, w2, b2) = kernel_leaves(x32), test_fused_head.leaves(x)
    opts1 = options(name, x32, b1, ref=algorithm.uses_full_kl)
    extra = dict(ref_hidden=x32["ref_hidden"], ref_weight=x32["ref_weight"]) if algorithm.uses_full_kl else {}
    chunk_size, vocab_block = ROUTES[route]
    with kernels.use("kernel"):
        out = algorithm.from_hidden(
            h1,
            w1,
            x32["targets"].masked_fill(~MASK.to(DEVICE), -100),
            temperature=TAU,
            chunk_size=chunk_size,
            vocab_block=vocab_block,
            **inputs32,
            **records(opts1),
            **extra,
        )
        out.loss.backward()
    expected = materialised_loss(algorithm, inputs, h2, w2, x, options(name, x, b2, ref=True))
    expected.loss.backward()
    assert_near([out.loss, out.per_token, h1.grad, w1.grad], [expected.loss, expected.per_token, h2.grad, w2.grad])
    assert_near([b1.grad], [b2.grad if "bias" in opts1 else None])
    assert_near(list(out.metrics.values()), list(expected.metrics.values()), rtol=1e-4)


# --- the exact KL and the divergences ----------------------------------------------------------------------


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_divergences_with_both_heads_options(beta, tiles):
    """KL(p_T‖p_S), JSD(0.5) and KL(p_S‖p_T) (= `full_kl_from_hidden`) from two heads with every option, on
    the kernel route in float32, against the divergence of the materialised float64 logits."""
    x = make(seed=4)
    x32 = on_device(x)
    (h1, w1, b1), (h2, w2, b2) = kernel_leaves(x32), test_fused_head.leaves(x)
    student = dict(logit_scale=0.8, softcap=3.0)
    teacher = dict(logit_scale=1.25, softcap=2.0)
    with kernels.use("kernel"):
        out = divergence_from_hidden(
            h1,
            w1,
            x32["ref_hidden"],
            x32["ref_weight"],
            MASK.to(DEVICE),
            beta=beta,
            temperature=TAU,
            head=pgloss.HeadOptions(bias=b1, **student),
            teacher_head=pgloss.HeadOptions(bias=x32["ref_bias"], **teacher),
            chunk_size=tiles[0],
            vocab_block=tiles[1],
        )
        (out.per_token * x32["upstream"]).sum().backward()
    logits = test_fused_head.head_logits(h2, w2, b2, **student)
    teacher_logits = test_fused_head.head_logits(x["ref_hidden"], x["ref_weight"], x["ref_bias"], 1.25, 2.0)
    expected = divergence_from_logits(logits, teacher_logits, MASK, beta=beta, temperature=TAU)
    (expected.per_token * x["upstream"]).sum().backward()
    assert_near([out.per_token, h1.grad, w1.grad, b1.grad], [expected.per_token, h2.grad, w2.grad, b2.grad])
    if beta == 1.0:
        with kernels.use("kernel"):
            kl = full_kl_from_hidden(
                x32["hidden"],
                x32["weight"],
                x32["ref_hidden"],
                x32["ref_weight"],
                temperature=TAU,
                head=pgloss.HeadOptions(bias=x32["bias"], **student),
                ref_head=pgloss.HeadOptions(bias=x32["ref_bias"], **teacher),
                chunk_size=tiles[0],
                vocab_block=tiles[1],
            )
        assert_near([torch.where(MASK.to(DEVICE), kl, 0.0)], [expected.per_token])


# --- half precision -------------------------------------------------------------------------------------------


# The loss's routes, one chunk of every token in vocabulary tiles (∂L/∂W written once per tile), and each
# route's own default plan.
HALF_ROUTES = dict(ROUTES, **{"one chunk tiled": (15, 10), "default plan": (None, None)})


@pytest.mark.parametrize("route", HALF_ROUTES)
def test_bfloat16_heads_match_the_torch_route(route):
    """A bfloat16 head: the kernel reads the matmul's bfloat16 output as the torch route does, and writes the
    gradient tile in bfloat16 as the torch route copies it: the two routes agree to bfloat16's rounding of that
    tile (float32 sums in a different order)."""
    x = make(seed=6)
    algorithm, inputs = losses(x, options("all", x))["grpo"]
    x16 = on_device(x, torch.bfloat16)
    inputs32 = {k: v.to(DEVICE, torch.float32) if v.is_floating_point() else v.to(DEVICE) for k, v in inputs.items()}
    chunk_size, vocab_block = HALF_ROUTES[route]
    results = []
    for which in ("kernel", "torch"):
        h, w, b = kernel_leaves(x16)
        with kernels.use(which):
            out = algorithm.from_hidden(
                h,
                w,
                x16["targets"],
                temperature=TAU,
                chunk_size=chunk_size,
                vocab_block=vocab_block,
                **inputs32,
                **records(options("all", x16, b)),
            )
            out.loss.backward()
        assert h.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16
        results.append([out.loss, out.metrics["entropy"], h.grad, w.grad, b.grad])
    assert_near(results[0][:2], results[1][:2], rtol=1e-5)
    assert_near(results[0][2:], results[1][2:], rtol=2e-2)


# --- the route ------------------------------------------------------------------------------------------------


def test_the_route_is_chosen_by_device_and_refused_where_the_kernels_cannot_run(monkeypatch):
    x = make()
    statistic = pgloss.vocab.entropy.LogProbEntropy(x["targets"].reshape(-1))
    kind = pgloss.vocab.head.PLAIN
    head32 = x["weight"].to(DEVICE, torch.float32)
    assert kernels.route(statistic, (kind,), head32) == ("kernel" if DEVICE == "cuda" else "torch")
    with kernels.use("torch"):
        assert kernels.route(statistic, (kind,), head32) == "torch"
    with kernels.use("kernel"):
        assert kernels.route(statistic, (kind,), head32) == "kernel"
        with pytest.raises(ValueError, match=r"^the kernel route runs LM-head sources .* in torch.float64"):
            kernels.route(statistic, (kind,), x["weight"])
        with pytest.raises(ValueError, match=r"^the kernel route runs LM-head sources .* \('logits',\)"):
            kernels.route(statistic, ("logits",), x["hidden"].float().reshape(-1, 8))
        if DEVICE == "cpu":
            monkeypatch.delenv("TRITON_INTERPRET")
            with pytest.raises(
                RuntimeError, match="^the kernel route on cpu tensors runs only in Triton's interpreter"
            ):
                kernels.route(statistic, (kind,), head32)
    with pytest.raises(
        ValueError, match=r"^route must be one of \('auto', 'torch', 'kernel', 'head-kernel'\), got 'triton'"
    ):
        with kernels.use("triton"):
            pass


def test_float64_and_logits_stay_on_the_torch_route_when_automatic():
    """Automatic choice: a float64 head, or given logits, never take the kernel route."""
    x = make()
    statistic = pgloss.vocab.entropy.LogProbEntropy(x["targets"].reshape(-1))
    assert kernels.route(statistic, (pgloss.vocab.head.PLAIN,), x["weight"]) == "torch"
    assert kernels.route(statistic, ("logits",), x["hidden"].float().reshape(-1, 8)) == "torch"


@pytest.mark.parametrize("path", test_fused.PATHS)
@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo", "clip_cov"])
def test_the_kernel_route_builds_nothing_from_the_host(name, path):
    """The torch operations around the kernels (the running state, the gradient buffers, the matmuls) under
    the host-sync detector of tests/properties (no host read, no tensor from Python data, no value-sized output),
    forward and backward, as the torch route is held in test_no_host_sync.py; on CUDA the next test asks the
    device itself."""
    alg = test_fused.algorithm(name, entropy_coef=0.01)
    inputs = test_fused.leaves({k: v.to(DEVICE) for k, v in test_fused.make(dtype=torch.float32).items()})
    with kernels.use("kernel"), no_host_sync():
        out = test_fused.fused(alg, inputs, temperature=TAU, chunk_size=test_fused.PATHS[path])
        out.loss.backward()
    assert inputs["weight"].grad.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a host sync shows on CUDA alone (set_sync_debug_mode)")
@pytest.mark.parametrize("path", test_fused.PATHS)
@pytest.mark.parametrize("name", ["grpo", "gspo", "dapo"])
def test_the_kernel_route_never_waits_on_the_host(name, path):
    """Forward and backward on the kernel route with every input already on the GPU: CUDA's sync debug mode
    raises at the first call that waits on the host."""
    alg = test_fused.algorithm(name, entropy_coef=0.01)
    inputs = test_fused.leaves({k: v.to(DEVICE) for k, v in test_fused.make(dtype=torch.float32).items()})
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = test_fused.fused(alg, inputs, temperature=TAU, chunk_size=test_fused.PATHS[path])
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert inputs["weight"].grad.abs().sum() > 0
