"""Rollout correction beside the loss: any algorithm composes with any correction, the weight enters
before the aggregation with the loss's mask and normaliser. Against plain float64 loops, gradients,
micro-batches, two gloo ranks (`on_rank`, `check_ranks`: run by properties/test_two_ranks_step_statistics.py), the
fused path, and decoupled (three-policy) PPO as AReaL writes it."""

import dataclasses
import math

import loops
import loops as lp2
import pytest
import torch
from conftest import log_probs, make_batch
from properties.micro_batches import cut, split_call

import pgloss
from pgloss.correction.gating import Gate
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection

F64 = torch.float64


def data(seed=0, spread=0.3, per_token_adv=False):
    d = make_batch(batch=9, length=7, seed=seed, per_token_adv=per_token_adv)
    gen = torch.Generator().manual_seed(seed + 50)
    d["rollout_log_prob"] = log_probs(
        d["old_log_prob"] + spread * torch.randn(d["mask"].shape, generator=gen, dtype=F64)
    )
    return d


def call(alg, d, log_prob=None, **kw):
    return alg(
        d["log_prob"] if log_prob is None else log_prob,
        d["old_log_prob"],
        d["advantages"],
        d["mask"],
        rollout_log_prob=d["rollout_log_prob"],
        ref_log_prob=d["ref_log_prob"],
        group_ids=d["group_ids"],
        teacher_log_prob=d["teacher_log_prob"],
        **kw,
    )


def expected_dapo(d, *, weight, keep, counted, clip_low=0.2, clip_high=0.28):
    """Σ_kept w·ℓ / N_counted with ℓ DAPO's clipped token loss, as plain loops."""
    total = 0.0
    lp, old, adv = d["log_prob"].tolist(), d["old_log_prob"].tolist(), d["advantages"].tolist()
    for i, row in enumerate(keep):
        for t, k in enumerate(row):
            if k:
                r = math.exp(lp[i][t] - old[i][t])
                total += weight[i][t] * loops.ppo_token(r, adv[i], clip_low=clip_low, clip_high=clip_high)
    return total / counted


@pytest.mark.parametrize("level", ["token", "sequence_product", "sequence_geometric"])
def test_dapo_with_each_weight_level_and_rejection_matches_loop(level):
    d = data(seed=1)
    corr = RolloutCorrection(
        weight_level=level, weight_mode="mask", lower=0.7, upper=1.4, rejection=(Rejection("token_k2", 0.08),)
    )
    out = call(pgloss.get("dapo", rollout_correction=corr), d)
    lists = [d[k].tolist() for k in ("old_log_prob", "rollout_log_prob", "mask")]
    weight, _ = lp2.rollout_weights(*lists, level=level, mode="mask", lower=0.7, upper=1.4)
    keep = lp2.kl_rejection_keep(*lists, "token_k2", 0.08)
    keep = [[k and m for k, m in zip(kr, mr, strict=True)] for kr, mr in zip(keep, lists[2], strict=True)]
    counted = sum(map(sum, keep))
    assert 0 < counted < int(d["mask"].sum())
    assert float(out.loss) == pytest.approx(expected_dapo(d, weight=weight, keep=keep, counted=counted), rel=1e-12)


def test_default_correction_is_the_truncated_weight_of_rollout_is_cap():
    d = data(seed=2, spread=0.6)
    for name in ("grpo", "dapo", "gspo", "cispo", "sapo"):
        legacy = call(pgloss.get(name, rollout_is_cap=1.5), d)
        explicit = call(pgloss.get(name, rollout_correction=RolloutCorrection(upper=1.5)), d)
        torch.testing.assert_close(explicit.loss, legacy.loss, rtol=1e-12, atol=1e-14, msg=name)


@pytest.mark.parametrize("name", ["grpo", "gspo", "cispo", "sapo", "dr_grpo"])
def test_any_loss_composes_weight_before_aggregation(name):
    # loss(correction) = aggregate(w · ℓ) with the loss's own per-token term, mask and mode.
    d = data(seed=3)
    corr = RolloutCorrection(weight_level="sequence_geometric", upper=1.1, rejection=(Rejection("seq_max_k3", 0.3),))
    extra = dict(norm_constant=7.0) if name == "dr_grpo" else {}
    alg = pgloss.get(name, rollout_correction=corr, kl_coef=0.0, **extra)
    plain = pgloss.get(name, kl_coef=0.0, **extra)
    out = call(alg, d)
    keep = corr.keep_mask(d["mask"], d["old_log_prob"], d["rollout_log_prob"])
    assert not torch.equal(keep, d["mask"])
    ref = plain(d["log_prob"], d["old_log_prob"], d["advantages"], keep, group_ids=d["group_ids"])
    weight, _ = lp2.rollout_weights(
        *[d[k].tolist() for k in ("old_log_prob", "rollout_log_prob", "mask")],
        level="sequence_geometric",
        mode="truncate",
        lower=None,
        upper=1.1,
    )
    expected = pgloss.aggregate(
        ref.per_token * torch.tensor(weight, dtype=F64), keep, plain.loss_agg_mode, norm_constant=plain.norm_constant
    )
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-14)


def test_gradient_is_weighted_reinforce_on_policy_and_passes_gradcheck():
    d = data(seed=4)
    corr = RolloutCorrection(upper=1.2)
    alg = pgloss.get("dapo", rollout_correction=corr)
    log_prob = d["old_log_prob"].clone().requires_grad_(True)
    call(alg, d, log_prob=log_prob).loss.backward()
    m = d["mask"]
    w = torch.where(m, (d["old_log_prob"] - d["rollout_log_prob"]).exp().clamp(max=1.2), 0.0)
    torch.testing.assert_close(log_prob.grad, -d["advantages"][:, None] * w * m / m.sum(), rtol=1e-12, atol=1e-14)
    lp = d["log_prob"].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: call(alg, d, log_prob=x).loss, (lp,))


def test_weight_multiplies_the_kl_term_only_when_asked():
    d = data(seed=5)
    off = pgloss.get("grpo", kl_coef=0.1, rollout_correction=RolloutCorrection(upper=1.3))
    on = dataclasses.replace(off, rollout_correction=RolloutCorrection(upper=1.3, weight_kl=True))
    w = torch.where(d["mask"], (d["old_log_prob"] - d["rollout_log_prob"]).exp().clamp(max=1.3), 0.0)
    kl = pgloss.kl_estimate(d["log_prob"], d["ref_log_prob"], "k3")
    agg = lambda v: pgloss.aggregate(v, d["mask"], "seq-mean-token-mean")  # noqa: E731
    diff = call(on, d).loss - call(off, d).loss
    torch.testing.assert_close(diff, 0.1 * (agg(w * kl) - agg(kl)), rtol=1e-10, atol=1e-14)
    assert abs(float(diff)) > 1e-6


def test_bypass_takes_the_rollout_as_old_policy():
    d = data(seed=6)
    bypass = pgloss.get("dapo", rollout_correction=RolloutCorrection(weight_level=None, bypass=True))
    direct = pgloss.get("dapo")(d["log_prob"], d["rollout_log_prob"], d["advantages"], d["mask"])
    torch.testing.assert_close(call(bypass, d).loss, direct.loss, rtol=1e-12, atol=1e-14)


def test_off_policy_mask_zeroes_rows_but_keeps_the_denominator():
    d = data(seed=7, spread=0.5, per_token_adv=True)
    corr = RolloutCorrection(weight_level=None, off_policy_mask=0.05)
    out = call(pgloss.get("dapo", rollout_correction=corr), d)
    m = d["mask"]
    seq_adv = (d["advantages"] * m).sum(-1) / m.sum(-1).clamp(min=1)
    keep = torch.tensor(
        lp2.opsm_keep(d["log_prob"].tolist(), d["rollout_log_prob"].tolist(), seq_adv.tolist(), m.tolist(), 0.05)
    )
    assert not keep[m.any(-1)].all()
    plain = pgloss.get("dapo")(d["log_prob"], d["old_log_prob"], d["advantages"], m).per_token
    torch.testing.assert_close(out.loss, (plain * keep[:, None]).sum() / m.sum(), rtol=1e-12, atol=1e-14)


PARTS = [slice(0, 2), slice(2, 5), slice(5, 9)]
CORRECTIONS = [
    RolloutCorrection(
        weight_level="token", upper=1.3, batch_normalize=True, rejection=(Rejection("seq_mean_k3", 0.04),)
    ),
    RolloutCorrection(weight_level="sequence_product", weight_mode="mask", lower=0.3, upper=3.0, batch_normalize=True),
    RolloutCorrection(weight_level="sequence_geometric", off_policy_mask=0.0, rejection=(Rejection("token_k1", 1.5),)),
    RolloutCorrection(
        weight_level="segment_geometric",
        upper=1.3,
        batch_normalize=True,
        gates=(Gate("binary_kl", "seq_mean", upper=0.06), Gate("diff", "token", lower=-0.1, upper=0.1)),
    ),
]


@pytest.mark.parametrize("corr", CORRECTIONS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "group-mean-token-mean"])
def test_micro_batches_with_the_corrected_normalizer_match_one_call(corr, mode):
    d = data(seed=8)
    alg = pgloss.get("grpo", loss_agg_mode=mode, kl_coef=0.05, rollout_correction=corr)
    whole_lp = d["log_prob"].clone().requires_grad_(True)
    whole = call(alg, d, log_prob=whole_lp)
    whole.loss.backward()
    normalizer = corr.normalizer(
        cut(d["mask"], PARTS),
        cut(d["old_log_prob"], PARTS),
        cut(d["rollout_log_prob"], PARTS),
        group_ids=cut(d["group_ids"], PARTS),
    )
    total, grad = split_call(
        alg,
        d["log_prob"],
        PARTS,
        normalizer,
        old_log_prob=d["old_log_prob"],
        advantages=d["advantages"],
        mask=d["mask"],
        rollout_log_prob=d["rollout_log_prob"],
        ref_log_prob=d["ref_log_prob"],
        group_ids=d["group_ids"],
    )
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_lp.grad, rtol=1e-12, atol=1e-14)


def test_batch_normalize_without_the_step_mean_is_refused():
    d = data()
    alg = pgloss.get("dapo", rollout_correction=RolloutCorrection(batch_normalize=True))
    with pytest.raises(ValueError, match="algorithm.step_normalizer"):
        call(alg, d, normalizer=pgloss.Normalizer.count(d["mask"]))


def test_bad_correction_is_refused():
    with pytest.raises(TypeError, match="rollout_correction must be a pgloss.RolloutCorrection"):
        pgloss.get("dapo", rollout_correction="tis")
    d = data()
    alg = pgloss.get("dapo", rollout_correction=RolloutCorrection())
    with pytest.raises(ValueError, match="rollout_log_prob"):
        alg(d["log_prob"], d["old_log_prob"], d["advantages"], d["mask"])


@pytest.mark.parametrize("chunk_rows", [2, 0], ids=["one-pass", "recompute"])
@pytest.mark.parametrize("corr", CORRECTIONS[:2])
def test_fused_path_matches_materialised_logits(corr, chunk_rows):
    gen = torch.Generator().manual_seed(9)
    B, T, H, V = 6, 5, 8, 17
    hidden = torch.randn(B, T, H, generator=gen, dtype=F64, requires_grad=True)
    weight = torch.randn(V, H, generator=gen, dtype=F64, requires_grad=True)
    targets = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.arange(T)[None, :] < torch.tensor([5, 3, 0, 4, 5, 2])[:, None]
    with torch.no_grad():
        lp_all = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None])[..., 0]
    old = log_probs(lp_all + 0.1 * torch.randn(B, T, generator=gen, dtype=F64))
    rollout = log_probs(old + 0.3 * torch.randn(B, T, generator=gen, dtype=F64))
    adv = torch.randn(B, generator=gen, dtype=F64)
    alg = pgloss.get("dapo", rollout_correction=corr)
    kw = dict(old_log_prob=old, advantages=adv, mask=mask, rollout_log_prob=rollout)
    fused = alg.from_hidden(hidden, weight, targets, chunk_size=chunk_rows * T or 3, **kw)  # 3 < T: recompute
    gh, gw = torch.autograd.grad(fused.loss, [hidden, weight])
    log_prob = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None])[..., 0]
    plain = alg(log_prob, old, adv, mask, rollout_log_prob=rollout)
    ph, pw = torch.autograd.grad(plain.loss, [hidden, weight])
    torch.testing.assert_close(fused.loss, plain.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gh, ph, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gw, pw, rtol=1e-10, atol=1e-12)


def test_decoupled_ppo_matches_areal_loop():
    # AReaL ppo_actor_loss_fn: r = π_θ/π_prox clipped, × clamp(π_prox/π_behave) from token rejection
    # sampling (action clamp), token mean over the original mask.
    d = data(seed=10)
    prox, behave = d["old_log_prob"], d["rollout_log_prob"]
    corr = RolloutCorrection(weight_level="token", lower=0.5, upper=1.2)
    alg = pgloss.get("ppo", loss_agg_mode="token-mean", clip_low=0.2, clip_high=0.28, rollout_correction=corr)
    out = alg(d["log_prob"], prox, d["advantages"], d["mask"], rollout_log_prob=behave)
    total, n = 0.0, 0
    for i in range(9):
        for t in range(7):
            if d["mask"][i, t]:
                r = math.exp(d["log_prob"][i, t] - prox[i, t])
                w = min(max(math.exp(prox[i, t] - behave[i, t]), 0.5), 1.2)
                total += w * loops.ppo_token(r, float(d["advantages"][i]), clip_low=0.2, clip_high=0.28)
                n += 1
    assert float(out.loss) == pytest.approx(total / n, rel=1e-12)


RANK_PARTS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 9)]}


def on_rank(rank):  # inside a gloo process of properties/test_two_ranks_step_statistics.py
    d = data(seed=8)
    out = []
    for corr in CORRECTIONS:
        alg = pgloss.get("dapo", kl_coef=0.05, rollout_correction=corr)
        parts = RANK_PARTS[rank]
        normalizer = corr.normalizer(
            cut(d["mask"], parts), cut(d["old_log_prob"], parts), cut(d["rollout_log_prob"], parts)
        )
        _, grad = split_call(
            alg,
            d["log_prob"],
            parts,
            normalizer,
            old_log_prob=d["old_log_prob"],
            advantages=d["advantages"],
            mask=d["mask"],
            rollout_log_prob=d["rollout_log_prob"],
            ref_log_prob=d["ref_log_prob"],
        )
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
        out.append(grad / 2)
    return out


def check_ranks(results):
    d = data(seed=8)
    for k, corr in enumerate(CORRECTIONS):
        lp = d["log_prob"].clone().requires_grad_(True)
        call(pgloss.get("dapo", kl_coef=0.05, rollout_correction=corr), d, log_prob=lp).loss.backward()
        for rank in (0, 1):
            torch.testing.assert_close(results[rank][k], lp.grad, rtol=1e-12, atol=1e-14, msg=f"{k} rank {rank}")


@pytest.mark.parametrize("shape", [(0, 5), (3, 0)])
def test_empty_batches_give_zero_loss_and_gradient(shape):
    lp = torch.zeros(shape, dtype=F64, requires_grad=True)
    zeros, mask = torch.zeros(shape, dtype=F64), torch.ones(shape, dtype=torch.bool)
    for corr in CORRECTIONS:
        alg = pgloss.get("dapo", rollout_correction=corr)
        out = alg(lp, zeros, torch.zeros(shape[0], dtype=F64), mask, rollout_log_prob=zeros)
        out.loss.backward()
        assert float(out.loss.detach()) == 0.0 and not lp.grad.any()


def test_nan_at_masked_positions_never_reaches_the_loss():
    d = data(seed=11)
    corr = CORRECTIONS[0]
    alg = pgloss.get("dapo", rollout_correction=corr)
    clean = call(alg, d)
    dirty = dict(
        d,
        rollout_log_prob=torch.where(d["mask"], d["rollout_log_prob"], torch.nan),
        old_log_prob=torch.where(d["mask"], d["old_log_prob"], torch.inf),
    )
    lp = torch.where(d["mask"], d["log_prob"], torch.nan).requires_grad_(True)
    out = call(alg, dirty, log_prob=lp)
    out.loss.backward()
    torch.testing.assert_close(out.loss, clean.loss, rtol=0, atol=0)
    assert torch.isfinite(lp.grad).all() and not lp.grad[~d["mask"]].any()


SCORES = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, 0.0, 1.0, -1.0, 0.5], dtype=F64)


@pytest.mark.parametrize("name", [n for n in pgloss.names() if n != "vespo"])
def test_every_named_loss_composes_with_a_correction(name):
    d = data(seed=12)
    corr = RolloutCorrection(weight_level="token", upper=1.3, rejection=(Rejection("token_k2", 0.08),))
    extra = dict(norm_constant=7.0) if name == "dr_grpo" else {}
    torch.manual_seed(0)  # clip_cov draws its tokens at random
    out = call(pgloss.get(name, rollout_correction=corr, **extra), d, scores=SCORES)
    keep = corr.keep_mask(d["mask"], d["old_log_prob"], d["rollout_log_prob"])
    plain = pgloss.get(name, **extra)
    torch.manual_seed(0)
    ref = plain(
        d["log_prob"],
        d["old_log_prob"],
        d["advantages"],
        keep,
        ref_log_prob=d["ref_log_prob"],
        group_ids=d["group_ids"],
        scores=SCORES,
        teacher_log_prob=d["teacher_log_prob"],
    )
    w = torch.where(keep, (d["old_log_prob"] - d["rollout_log_prob"]).exp().clamp(max=1.3), 0.0)
    expected = pgloss.aggregate(
        ref.per_token * w, keep, plain.loss_agg_mode, norm_constant=plain.norm_constant, group_ids=d["group_ids"]
    )
    policy = out.metrics["pg_loss"]
    torch.testing.assert_close(policy, expected, rtol=1e-12, atol=1e-14)
    assert float(out.metrics["rollout_rejected_frac"]) > 0


def test_a_family_that_uses_the_rollout_itself_refuses_a_correction():
    with pytest.raises(ValueError, match="vespo uses the rollout log-probs in its own weight"):
        pgloss.get("vespo", rollout_correction=RolloutCorrection())


def test_bfloat16_counts_the_same_kept_tokens_as_the_call():
    d = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in data(seed=13).items()}
    corr = RolloutCorrection(upper=1.5, rejection=(Rejection("token_k3", 0.02),))
    alg = pgloss.get("dapo", rollout_correction=corr)
    whole = call(alg, d)
    normalizer = corr.normalizer(
        [d["mask"][p] for p in PARTS], [d["old_log_prob"][p] for p in PARTS], [d["rollout_log_prob"][p] for p in PARTS]
    )
    kept = whole.metrics["rollout_rejected_frac"]
    assert float(normalizer.tokens) == pytest.approx(float(d["mask"].sum()) * (1 - float(kept)))
    total = sum(
        alg(
            d["log_prob"][p],
            d["old_log_prob"][p],
            d["advantages"][p],
            d["mask"][p],
            rollout_log_prob=d["rollout_log_prob"][p],
            normalizer=normalizer,
        ).loss
        for p in PARTS
    )
    torch.testing.assert_close(total, whole.loss, rtol=1e-5, atol=1e-7)
