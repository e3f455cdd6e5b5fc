"""AReaL's proximal approximation (`pgloss.proximal`): a float64 loop from the formula, the PPO gradient
with the approximation as `old_log_prob`, bad input named, and AReaL 1.0.4's own
`compute_prox_logp_approximations` and `_resolve_proximal_logp` (read from its released source under
$PGLOSS_AREAL_SRC, the root of the unpacked areal wheel; `make test` sets it)."""

from __future__ import annotations

import math
import os
from enum import Enum
from pathlib import Path

import pytest
import torch
from conftest import make_batch

import pgloss
from pgloss.conformance import sources
from pgloss.correction.proximal import METHODS, proximal_log_prob, proximal_weight


def _versions(shape, current, seed):
    """Prompt tokens (-1), the previous policy (alpha 0), staler ones, the current one and a newer one."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-1, current + 2, shape, generator=gen)


def _loop(behave, current, versions, v_theta, method):
    out = torch.empty_like(behave)
    for i in range(behave.shape[0]):
        for t in range(behave.shape[1]):
            v_b = int(versions[i, t])
            a = (v_theta - 1 - v_b) / (v_theta - v_b) if v_theta > v_b and v_b >= 0 else 0.0
            a = min(max(a, 0.0), 1.0)
            b, c = float(behave[i, t]), float(current[i, t])
            if method == "loglinear":
                out[i, t] = b + a * (c - b)
            elif method == "linear":
                out[i, t] = math.log((1 - a) * math.exp(b) + a * math.exp(c) + 1e-10)
            else:
                out[i, t] = b
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", range(4))
def test_matches_float64_loop(method, seed):
    data = make_batch(batch=5, length=9, seed=seed)
    current = 3 + seed
    versions = _versions(data["mask"].shape, current, seed)
    got = proximal_log_prob(data["old_log_prob"], data["log_prob"], versions, current, method=method)
    want = _loop(data["old_log_prob"], data["log_prob"], versions, current, method)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_alpha_at_the_landmarks():
    versions = torch.tensor([[-1, 4, 3, 2, 0, 5, 6]])
    alpha = proximal_weight(versions, 5)
    want = torch.tensor([[0.0, 0.0, 0.5, 2 / 3, 0.8, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(alpha, want, rtol=0, atol=1e-15)


def test_detached_and_ppo_gradient_against_a_loop():
    """The approximation carries no gradient (AReaL passes `logprobs.detach()`): PPO's gradient with it as
    `old_log_prob` is the clipped surrogate's with π_prox a constant, token-mean, as a float64 loop."""
    data = make_batch(batch=5, length=9, seed=7, spread=0.5)
    versions = _versions(data["mask"].shape, 4, 7)
    lp = data["log_prob"].clone().requires_grad_(True)
    prox = proximal_log_prob(data["old_log_prob"], lp, versions, 4)
    assert not prox.requires_grad
    out = pgloss.get("ppo", loss_agg_mode="token-mean")(lp, prox, data["advantages"], data["mask"])
    (grad,) = torch.autograd.grad(out.loss, lp)

    lp2 = data["log_prob"].clone().requires_grad_(True)
    prox_loop = _loop(data["old_log_prob"], data["log_prob"], versions, 4, "loglinear")
    total, count = lp2.new_zeros(()), 0
    for i in range(lp2.shape[0]):
        for t in range(lp2.shape[1]):
            if data["mask"][i, t]:
                r = torch.exp(lp2[i, t] - prox_loop[i, t])
                a = data["advantages"][i]
                total = total + torch.maximum(-a * r, -a * r.clamp(0.8, 1.2))
                count += 1
    (want,) = torch.autograd.grad(total / count, lp2)
    torch.testing.assert_close(out.loss.detach(), (total / count).detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)


def test_compiles_without_a_graph_break_and_runs_on_meta():
    data = make_batch(batch=3, length=5, seed=2, dtype=torch.float32)
    versions = _versions((3, 5), 3, 2)
    args = (data["old_log_prob"], data["log_prob"], versions)
    compiled = torch.compile(lambda b, lp, v: proximal_log_prob(b, lp, v, 3), fullgraph=True)
    torch.testing.assert_close(compiled(*args), proximal_log_prob(*args, 3), rtol=0, atol=0)
    on_meta = proximal_log_prob(*(a.to("meta") for a in args), 3)
    assert on_meta.device.type == "meta" and on_meta.shape == (3, 5)


def test_float32_stays_float32():
    data = make_batch(batch=3, length=4, seed=1, dtype=torch.float32)
    versions = torch.zeros(3, 4, dtype=torch.int64)
    assert proximal_log_prob(data["old_log_prob"], data["log_prob"], versions, 2).dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (dict(method="recompute"), ValueError, "method"),
        (dict(current_version=True), TypeError, "current_version"),
        (dict(current_version=2.0), TypeError, "current_version"),
        (dict(versions=torch.zeros(2, 3)), TypeError, "versions"),
        (dict(versions=torch.zeros(2, 4, dtype=torch.int64)), ValueError, "versions"),
        (dict(versions=[[0, 0, 0]]), TypeError, "versions"),
        (dict(log_prob=-torch.ones(2, 4)), ValueError, "log_prob"),
        (dict(behave_log_prob=torch.full((2, 3), 0.5)), ValueError, "behave_log_prob"),
        (dict(log_prob=torch.full((2, 3), 0.5)), ValueError, "log_prob"),
        (dict(log_prob=torch.zeros(2, 3, dtype=torch.int64)), TypeError, "log_prob"),
    ],
)
def test_bad_input_named(change, error, words):
    args = dict(
        behave_log_prob=-torch.ones(2, 3),
        log_prob=-torch.ones(2, 3),
        versions=torch.zeros(2, 3, dtype=torch.int64),
        current_version=1,
    )
    args.update(change)
    with pytest.raises(error, match=words):
        proximal_log_prob(**args)


@pytest.fixture(scope="module")
def areal():
    root = os.environ.get("PGLOSS_AREAL_SRC")
    if not root:
        pytest.skip("PGLOSS_AREAL_SRC is not set (the root of the unpacked areal 1.0.4 wheel)")
    constants = Path(root) / "areal" / "utils" / "constants.py"
    actor = Path(root) / "areal" / "trainer" / "ppo" / "actor.py"
    if not (constants.is_file() and actor.is_file()):
        pytest.skip(f"PGLOSS_AREAL_SRC={root} holds no areal/trainer/ppo/actor.py")
    namespace = {"torch": torch, "Enum": Enum}
    methods = ("PROX_APPROX_METHOD_LOGLINEAR", "PROX_APPROX_METHOD_LINEAR", "PROX_APPROX_METHOD_ROLLOUT")
    logp = ("PROX_LOGP_METHOD_RECOMPUTE", "PROX_LOGP_METHOD_LOGLINEAR", "PROX_LOGP_METHOD_METRICS")
    sources.load(
        constants, ("ProxLogpMethod", "ProxApproxMethod", *logp, *methods, "PROX_APPROX_METHODS_ALL"), namespace
    )
    sources.load(actor, ("compute_prox_logp_approximations", "_resolve_proximal_logp"), namespace)
    functional = Path(root) / "areal" / "utils" / "functional" / "functional.py"
    return sources.load(functional, ("ppo_actor_loss_fn",), namespace)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("seed", range(6))
def test_matches_areal(areal, dtype, seed):
    """Every approximation AReaL computes, and the one its loss uses under `prox_logp_method="loglinear"`.
    AReaL computes α in float32 (`versions.float()`), pgloss in float64: in float64 the two differ by α's
    float32 rounding (at most 2^-24·α·|log π_θ - log π_behave|, measured up to 4e-8), and agree to 1e-12
    where α is exact in float32 (`test_matches_areal_exactly`)."""
    data = make_batch(batch=6, length=11, seed=seed, spread=0.8, dtype=dtype)
    current = 2 + seed
    versions = _versions(data["mask"].shape, current, seed)
    behave, lp = data["old_log_prob"], data["log_prob"]
    theirs = areal["compute_prox_logp_approximations"](behave, lp, versions, current)
    assert set(theirs) == set(METHODS)
    alpha = proximal_weight(versions, current)
    bound = 2.0**-24 * alpha * (lp - behave).abs().to(torch.float64) + 1e-12
    for method in METHODS:
        ours = proximal_log_prob(behave, lp, versions, current, method=method)
        if dtype == torch.float64:
            assert bool(((ours - theirs[method]).abs() <= bound).all()), method
        else:
            torch.testing.assert_close(ours, theirs[method], rtol=0, atol=1e-6)
    resolved = areal["_resolve_proximal_logp"](
        prox_logp_gt=None,
        prox_logp_method="loglinear",
        old_logp=behave,
        logprobs=lp.detach(),
        versions=versions,
        current_version=current,
    )
    assert bool(((proximal_log_prob(behave, lp, versions, current) - resolved).abs() <= bound).all())


@pytest.mark.parametrize("seed", range(4))
def test_matches_areal_exactly(areal, seed):
    """With v_θ - v_b in {1, 2, 4, 8} (α in {0, 1/2, 3/4, 7/8}, exact in float32), float64 to 1e-12."""
    data = make_batch(batch=6, length=11, seed=seed, spread=0.8)
    gen = torch.Generator().manual_seed(seed)
    current = 9
    versions = current - 2 ** torch.randint(0, 4, data["mask"].shape, generator=gen)
    versions[0, :3] = -1  # prompt tokens
    behave, lp = data["old_log_prob"], data["log_prob"]
    theirs = areal["compute_prox_logp_approximations"](behave, lp, versions, current)
    for method in METHODS:
        ours = proximal_log_prob(behave, lp, versions, current, method=method)
        torch.testing.assert_close(ours, theirs[method], rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_decoupled_ppo_without_recompute_matches_areal(areal, seed):
    """AReaL's loss under prox_logp_method="loglinear" (its π_prox, then `ppo_actor_loss_fn`: the clipped
    ratio against π_prox, dual clip c = 3, token mean, no rejection) against pgloss's `dual_clip_ppo`, token-mean,
    called with `old_log_prob=proximal_log_prob(...)`: value and gradient within α's float32 rounding."""
    data = make_batch(batch=6, length=11, seed=seed, spread=0.8, per_token_adv=True)
    current = 5
    versions = _versions(data["mask"].shape, current, seed)
    behave, mask, adv = data["old_log_prob"], data["mask"], data["advantages"]
    leaf = data["log_prob"].clone().requires_grad_(True)
    prox = areal["_resolve_proximal_logp"](
        prox_logp_gt=None,
        prox_logp_method="loglinear",
        old_logp=behave,
        logprobs=leaf.detach(),
        versions=versions,
        current_version=current,
    )
    theirs, _ = areal["ppo_actor_loss_fn"](
        logprobs=leaf,
        proximal_logprobs=prox,
        old_logprobs=behave,
        advantages=adv,
        eps_clip=0.2,
        loss_mask=mask,
        c_clip=3.0,
    )
    (want,) = torch.autograd.grad(theirs, leaf)
    leaf2 = data["log_prob"].clone().requires_grad_(True)
    ours = pgloss.get("dual_clip_ppo", loss_agg_mode="token-mean")(
        leaf2, proximal_log_prob(behave, leaf2, versions, current), adv, mask
    ).loss
    (grad,) = torch.autograd.grad(ours, leaf2)
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-12)
    torch.testing.assert_close(grad, want, rtol=1e-7, atol=1e-12)
