"""Clip-Cov and KL-Cov (losses/clip_cov.py, losses/kl_cov.py; their covariance in losses/cov.py) against the
plain loops, their draws and gradients."""

import math

import loops
import pytest
import torch
from conftest import make_batch

import pgloss
from pgloss.losses.clip_cov import clip_cov_loss
from pgloss.losses.cov import selection_size, token_covariance
from pgloss.losses.kl_cov import kl_cov_loss

CLIP = dict(clip_low=0.2, clip_high=0.2)


def inputs(seed, spread=0.4):
    data = make_batch(batch=6, length=8, seed=seed, spread=spread, per_token_adv=True)
    data["advantages"] = 2 * data["advantages"]  # covariances of order one, some inside (lb, ub)
    mask = data["mask"]
    lp = torch.where(mask, data["log_prob"], 0.0)
    old = torch.where(mask, data["old_log_prob"], 0.0)
    return data, lp, old, data["advantages"], mask


def ratio(lp, old):
    return torch.exp(lp - old)


def key_order(shape, seed):
    """The draw of a seeded generator: candidate cells ordered by their U[0, 1) key (ties row-major)."""
    keys = torch.rand(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).tolist()
    return lambda cells: sorted(cells, key=lambda c: keys[c[0]][c[1]])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clip_cov_matches_loop_with_the_same_draw(seed):
    data, lp, old, adv, mask = inputs(seed)
    cov_ratio, lb, ub = 0.1, 0.05, 5.0
    loss, picked, by_clip = clip_cov_loss(
        ratio(lp, old),
        lp,
        adv,
        mask,
        **CLIP,
        cov_ratio=cov_ratio,
        cov_lb=lb,
        cov_ub=ub,
        generator=torch.Generator().manual_seed(seed),
    )
    expected, expected_picked = loops.clip_cov(
        *loops.lists(data), **CLIP, ratio=cov_ratio, lb=lb, ub=ub, draw=key_order(mask.shape, seed)
    )
    torch.testing.assert_close(
        torch.where(mask, loss, 0.0), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14
    )
    assert {tuple(ix) for ix in picked.nonzero().tolist()} == expected_picked
    assert len(expected_picked) == selection_size(cov_ratio, mask) >= 2  # k = ⌊0.1·N⌋ tokens were detached
    assert not (picked & by_clip).any() and not (picked & ~mask).any()


def test_clip_cov_generator_makes_a_step_reproducible_and_none_uses_the_global_one():
    _, lp, old, adv, mask = inputs(0)

    def run(gen):
        return clip_cov_loss(
            ratio(lp, old), lp, adv, mask, **CLIP, cov_ratio=0.05, cov_lb=0.05, cov_ub=5.0, generator=gen
        )[1]

    first, again = run(torch.Generator().manual_seed(7)), run(torch.Generator().manual_seed(7))
    assert torch.equal(first, again)
    draws = {tuple(run(torch.Generator().manual_seed(s)).nonzero().flatten().tolist()) for s in range(8)}
    assert len(draws) > 1  # the draw is random across seeds
    torch.manual_seed(7)  # None: the global generator of the tensors' device
    assert torch.equal(run(None), first)


def test_clip_cov_gradient_is_ppo_gradient_except_on_picked_tokens():
    _, lp, old, adv, mask = inputs(1)
    kw = dict(**CLIP, cov_ratio=0.1, cov_lb=0.05, cov_ub=5.0)

    def fn(x):
        loss = clip_cov_loss(ratio(x, old), x, adv, mask, **kw, generator=torch.Generator().manual_seed(0))[0]
        return torch.where(mask, loss, 0.0).sum()

    assert torch.autograd.gradcheck(fn, (lp.clone().requires_grad_(),))
    x = lp.clone().requires_grad_()
    _, picked, _ = clip_cov_loss(ratio(x, old), x, adv, mask, **kw, generator=torch.Generator().manual_seed(0))
    fn(x).backward()
    assert picked.any() and (x.grad[picked] == 0).all()


def test_clip_cov_without_candidates_is_ppo():
    _, lp, old, adv, mask = inputs(2)
    loss, picked, _ = clip_cov_loss(ratio(lp, old), lp, adv, mask, **CLIP, cov_ratio=2e-4, cov_lb=1e6, cov_ub=1e7)
    r = ratio(lp, old)
    assert not picked.any()
    torch.testing.assert_close(loss, torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2)), rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 3])
@pytest.mark.parametrize("cov_ratio", [2e-4, 0.2])
def test_kl_cov_matches_loop(seed, cov_ratio):
    data, lp, old, adv, mask = inputs(seed)
    loss, top = kl_cov_loss(ratio(lp, old), lp, lp - old, adv, mask, cov_ratio=cov_ratio, kl_coef=0.1)
    expected, expected_top = loops.kl_cov(*loops.lists(data), ratio=cov_ratio, kl_coef=0.1)
    torch.testing.assert_close(
        torch.where(mask, loss, 0.0), torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-14
    )
    assert {tuple(ix) for ix in top.nonzero().tolist()} == expected_top
    assert len(expected_top) == max(int(cov_ratio * int(mask.sum())), 1)


def test_kl_cov_gradient():
    _, lp, old, adv, mask = inputs(4)

    def fn(x):
        return torch.where(
            mask, kl_cov_loss(ratio(x, old), x, x - old, adv, mask, cov_ratio=0.2, kl_coef=0.5)[0], 0.0
        ).sum()

    assert torch.autograd.gradcheck(fn, (lp.clone().requires_grad_(),))


def test_covariance_is_centred_over_valid_tokens_only():
    _, lp, _, adv, mask = inputs(5)
    poisoned = torch.where(mask, lp, 1e6)
    cov = token_covariance(poisoned, torch.where(mask, adv, -1e6), mask)
    torch.testing.assert_close(cov[mask], token_covariance(lp, adv, mask)[mask])
    i, t = mask.nonzero()[0].tolist()
    expected = (adv[i, t] - adv[mask].mean()) * (lp[i, t] - lp[mask].mean())
    torch.testing.assert_close(cov[i, t], expected)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov"])
def test_the_log_ratio_clamp_acts_only_beyond_20(name):
    """verl's clip_cov and kl_cov exponentiate log r unclamped; pgloss clamps it at ±max_log_ratio (20):
    the same loss within ±20; beyond, a finite loss with no gradient on that token (verl's grows as
    r and overflows float32 at log r > 88.7). max_log_ratio=1e4 reproduces the unclamped value."""
    data, lp, old, adv, mask = inputs(0)
    overrides = dict(clip_cov_ratio=0.1, clip_cov_lb=0.05) if name == "clip_cov" else dict(kl_cov_ratio=0.1)
    for shift, clamped in ((19.5, False), (25.0, True)):
        x, o = lp.clone(), old.clone()
        o[0, 0] = x[0, 0] - shift  # log r = shift, every log-prob <= 0
        adv0 = adv.clone()
        adv0[0, 0] = -1.0  # a bad token whose ratio exploded: -A·r is the surrogate's branch
        values = {}
        for limit in (20.0, 1e4):
            leaf = x.clone().requires_grad_()
            gen = dict(generator=torch.Generator().manual_seed(0)) if name == "clip_cov" else {}
            out = pgloss.get(name, max_log_ratio=limit, **overrides, **gen)(leaf, o, adv0, mask)
            out.loss.backward()
            values[limit] = (out.loss.detach(), leaf.grad[0, 0])
        (clamped_loss, clamped_grad), (free_loss, free_grad) = values[20.0], values[1e4]
        if clamped:
            assert clamped_grad == 0 and free_grad != 0
            assert free_loss / clamped_loss == pytest.approx(math.exp(5.0), rel=1e-2)  # the token's e^25 against e^20
        else:
            assert clamped_loss.item() == free_loss.item() and clamped_grad == free_grad


def test_the_key_draw_is_uniform_without_replacement():
    """k of n candidates by their U[0, 1) keys: each is picked with probability k/n, never twice, and
    the draw needs no host read (k may be a tensor)."""
    from pgloss.losses.clip_cov import clip_cov_selection

    candidates = torch.tensor([[True, False, True, True], [False, True, False, True]])
    gen = torch.Generator().manual_seed(5)
    draws = torch.stack([clip_cov_selection(candidates, count=torch.tensor(2), generator=gen) for _ in range(4000)])
    assert (draws.sum(dim=(1, 2)) == 2).all() and not (draws & ~candidates).any()
    frequency = draws.double().mean(0)[candidates]
    torch.testing.assert_close(frequency, torch.full_like(frequency, 2 / 5), rtol=0, atol=0.03)
