"""Calls made inside `torch.autocast`, as a trainer with mixed precision makes them (HF Trainer's CPU AMP wraps the
loss in it, and CUDA's for the model is a trainer's usual mixed precision; some loops call backward inside it too):
every entry point from hidden states, and the plain call, give bit for bit what they give outside it, on both
vocabulary-loop routes and the head-kernel route. On CUDA where a GPU is, else on the CPU (the kernel route in Triton's interpreter).

Autocast runs a matmul in the lower dtype: a float32 head's logits taken by a plain `x @ Wᵀ` inside it are bfloat16
(checked below, so that the test shows it could fail). The loop's matmuls write into buffers in the head's dtype
(`torch.mm(..., out=)`, which autocast leaves alone), and its softmax runs in float32 whatever the context.
"""

import contextlib

import pytest
import torch

import pgloss
from pgloss.vocab import kernels

B, T, H, V = 2, 5, 16, 40
ROUTES = ("torch", "kernel", "head-kernel")
HEAD_KERNEL = ("loss_from_hidden", "log_prob_and_entropy")  # the head-kernel route computes log π and H only
DTYPES = (torch.bfloat16, torch.float16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernel route: CUDA, or Triton's interpreter on CPU


def make():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=gen)
    inputs = dict(
        hidden=hidden,
        weight=0.5 * torch.randn(V, H, generator=gen),
        teacher_hidden=hidden + 0.3 * torch.randn(B, T, H, generator=gen),
        teacher_weight=0.5 * torch.randn(V, H, generator=gen),
        targets=torch.randint(0, V, (B, T), generator=gen),
        mask=torch.arange(T)[None, :] < torch.tensor([5, 3])[:, None],
        advantages=torch.randn(B, generator=gen),
    )
    return {name: value.to(DEVICE) for name, value in inputs.items()}


def loss_from_hidden(x, student):
    return (
        pgloss.get("dapo", entropy_coef=0.01)
        .from_hidden(*student, x["targets"], advantages=x["advantages"], mask=x["mask"], old_log_prob=None)
        .loss
    )


def log_prob_and_entropy(x, student):
    log_prob, entropy = pgloss.log_prob_and_entropy_from_hidden(*student, x["targets"], mask=x["mask"])
    return (log_prob * x["advantages"][:, None]).sum() + entropy.sum()


def full_kl(x, student):
    kl = pgloss.full_kl_from_hidden(*student, x["teacher_hidden"], x["teacher_weight"], mask=x["mask"])
    return kl.sum()


def divergence(x, student):
    return pgloss.divergence_from_hidden(*student, x["teacher_hidden"], x["teacher_weight"], x["mask"], beta=0.5).loss


CALLS = {
    "loss_from_hidden": loss_from_hidden,
    "log_prob_and_entropy": log_prob_and_entropy,
    "full_kl": full_kl,
    "divergence": divergence,
}


def run(call, x, route, context, backward_inside):
    student = (x["hidden"].clone().requires_grad_(True), x["weight"].clone().requires_grad_(True))
    with kernels.use(route), context:
        loss = call(x, student)
        if backward_inside:
            loss.backward()
    if not backward_inside:
        loss.backward()
    return loss.detach(), student[0].grad, student[1].grad


@pytest.mark.parametrize("backward_inside", [False, True], ids=["backward after", "backward inside"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("name", "route"),
    [(name, route) for name in CALLS for route in ROUTES if route != "head-kernel" or name in HEAD_KERNEL],
)
def test_a_call_inside_autocast_is_the_call_outside_it(name, route, dtype, backward_inside):
    x = make()
    outside = run(CALLS[name], x, route, contextlib.nullcontext(), backward_inside)
    inside = run(CALLS[name], x, route, torch.autocast(DEVICE, dtype=dtype), backward_inside)
    assert outside[0].dtype == inside[0].dtype == torch.float32
    for a, b in zip(outside, inside, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_plain_call_inside_autocast_is_the_call_outside_it(dtype):
    x = make()
    gen = torch.Generator().manual_seed(1)
    old = (-torch.rand(B, T, generator=gen) * 3).to(DEVICE)
    noise = torch.randn(B, T, generator=gen).to(DEVICE)
    results = []
    for context in (contextlib.nullcontext(), torch.autocast(DEVICE, dtype=dtype)):
        log_prob = (old + 0.2 * noise).clamp(max=0).requires_grad_(True)
        with context:
            out = pgloss.get("dual_clip_ppo")(log_prob, old, x["advantages"], x["mask"])
            out.loss.backward()
        results.append((out.loss.detach(), log_prob.grad, *out.metrics.values()))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_autocast_does_lower_a_plain_matmul_here():
    """The context this file tests is live: the same product written plainly comes out in bfloat16."""
    x = make()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert (x["hidden"] @ x["weight"].t()).dtype == torch.bfloat16
