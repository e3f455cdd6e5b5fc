"""Clip_B and Clip_V (arXiv 2602.03392) against the float64 loops (tests/loops/advantages.py), their
special cases, no host sync on meta tensors, and the statistics over two gloo ranks (`on_rank`,
`check_ranks`: run by properties/test_two_ranks_step_statistics.py when listed there)."""

import loops
import pytest
import torch

from pgloss.correction.token_masks import clip_b_mask, clip_v_mask

F64 = dict(dtype=torch.float64)


def inputs(seed=0, b=8, t=12, v=7):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, t, v, generator=gen, **F64) * 2
    lp_all = torch.log_softmax(logits, -1)
    p = lp_all.exp()
    entropy = -(p * lp_all).sum(-1)
    tokens = torch.randint(0, v, (b, t), generator=gen)
    log_prob = lp_all.gather(-1, tokens[..., None])[..., 0]
    necs = (p * p * (lp_all + entropy[..., None])).sum(-1)  # N = Σ_v π_v² (H + log π_v)
    mask = torch.arange(t)[None, :] < torch.randint(3, t + 1, (b,), generator=gen)[:, None]
    adv = torch.randn(b, generator=gen, **F64)
    adv[::4] = 0.0
    return log_prob, entropy, necs, adv, mask


def token(adv, mask):
    return adv[:, None].expand(mask.shape).tolist()


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.5])
def test_clip_b_matches_loop(mu):
    lp, h, _, adv, mask = inputs()
    got = clip_b_mask(lp, h, adv, mask, mu=mu)
    assert got.tolist() == loops.clipb_mask(lp.tolist(), h.tolist(), token(adv, mask), mask.tolist(), mu)
    assert (mask & ~got).any() or mu > 0.5  # the comparison can fail: something is clipped at small μ
    assert not (got & ~mask).any() and got[adv > 0].sum() == mask[adv > 0].sum()  # positive advantages all kept


@pytest.mark.parametrize("mu, max_frac", [(0.5, 1.0), (0.5, 0.02), (1.5, 1e-4)])
@pytest.mark.parametrize("convention", ["pgloss", "trinity"])
def test_clip_v_matches_loop(mu, max_frac, convention):
    lp, h, necs, adv, mask = inputs(1)
    got = clip_v_mask(lp, h, necs, adv, mask, mu=mu, max_frac=max_frac, convention=convention)
    expected = loops.clipv_mask(
        lp.tolist(),
        h.tolist(),
        necs.tolist(),
        token(adv, mask),
        mask.tolist(),
        mu,
        max_frac,
        trinity=convention == "trinity",
    )
    assert got.tolist() == expected


def test_clip_v_cap_keeps_the_worst_k():
    lp, h, necs, adv, mask = inputs(5)
    free = clip_v_mask(lp, h, necs, adv, mask, mu=0.2, max_frac=1.0)
    capped = clip_v_mask(lp, h, necs, adv, mask, mu=0.2, max_frac=0.01)
    n_free = int((mask & ~free).sum())
    assert n_free > 1 and int((mask & ~capped).sum()) == max(int(0.01 * mask.sum()), 1)
    assert ((mask & ~capped) <= (mask & ~free)).all()  # the capped set is inside the free one


def test_clip_masks_keep_everything_for_constant_discriminators():
    lp = torch.full((3, 4), -0.5, **F64)
    h = torch.full((3, 4), 1.0, **F64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    adv = torch.tensor([-1.0, -2.0, 1.0], **F64)
    assert clip_b_mask(lp, h, adv, mask, mu=1e-3).all()
    assert clip_v_mask(lp, h, torch.zeros(3, 4, **F64), adv, mask, mu=1e-3).all()


def test_clip_masks_accept_token_advantages_and_ignore_masked_values():
    lp, h, necs, adv, mask = inputs(3)
    tok = adv[:, None].expand(mask.shape).clone()
    assert torch.equal(clip_b_mask(lp, h, tok, mask, mu=0.5), clip_b_mask(lp, h, adv, mask, mu=0.5))
    junk = torch.where(mask, lp, torch.nan), torch.where(mask, h, torch.inf), torch.where(mask, necs, torch.nan)
    assert torch.equal(
        clip_v_mask(*junk, adv, mask, mu=0.5, max_frac=0.05), clip_v_mask(lp, h, necs, adv, mask, mu=0.5, max_frac=0.05)
    )


def test_clip_masks_run_on_meta_without_host_reads():
    lp, h, necs, adv, mask = (x.to("meta") for x in inputs())
    assert clip_b_mask(lp, h, adv, mask).device.type == "meta"
    assert clip_v_mask(lp, h, necs, adv, mask).shape == mask.shape


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda lp, h, n, a, m: clip_b_mask(lp, h, a, m, mu=0.0), ValueError, "mu must be > 0"),
        (lambda lp, h, n, a, m: clip_b_mask(lp, h[:, :3], a, m), ValueError, "entropy must have shape"),
        (lambda lp, h, n, a, m: clip_b_mask(lp, h, a[:3], m), ValueError, "advantages must have shape"),
        (lambda lp, h, n, a, m: clip_v_mask(lp, h, n, a, m, max_frac=0.0), ValueError, "max_frac"),
        (lambda lp, h, n, a, m: clip_v_mask(lp, h, n, a, m, convention="verl"), ValueError, "convention"),
        (lambda lp, h, n, a, m: clip_v_mask(lp, h, n[:, :2], a, m), ValueError, "expected_discriminator must have"),
    ],
)
def test_bad_input_is_named(call, error, match):
    with pytest.raises(error, match=match):
        call(*inputs())


# -- over two gloo ranks -------------------------------------------------------------------------------------

ROWS = {0: slice(0, 3), 1: slice(3, 8)}


def _masks(rows):
    lp, h, necs, adv, mask = inputs(4)
    p = rows
    return {
        "clip_b": clip_b_mask(lp[p], h[p], adv[p], mask[p], mu=0.5),
        "clip_v": clip_v_mask(lp[p], h[p], necs[p], adv[p], mask[p], mu=0.3, max_frac=0.03),
    }


def on_rank(rank):
    return _masks(ROWS[rank])


def check_ranks(results):
    whole = _masks(slice(None))
    for name, expected in whole.items():
        assert torch.equal(torch.cat([results[0][name], results[1][name]]), expected), name
