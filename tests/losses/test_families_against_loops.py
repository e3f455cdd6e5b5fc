"""The frameworks' other losses as named algorithms: each loss, aggregated, against a plain loop from its formula,
the REINFORCE identity where it holds, and the couplings that make three of them row-coupled."""

import loops
import pytest
import torch
from conftest import make_batch
from properties.micro_batches import cut, split_call

import pgloss

NEW = [
    "gmpo",
    "clip_cov",
    "kl_cov",
    "gpg",
    "tis_pg",
    "topr",
    "dppo_tv",
    "dppo_kl",
    "dro",
    "vespo",
    "luspo",
    "ce_gppo",
    "real",
]
SCORES = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, 0.0, 1.0, -1.0, 0.5], dtype=torch.float64)


def get(name, **hyper):
    return pgloss.get(name, **hyper)


def call(alg, data, log_prob=None, **extra):
    batch = data["log_prob"].shape[0]
    return alg(
        data["log_prob"] if log_prob is None else log_prob,
        data["old_log_prob"],
        data["advantages"],
        data["mask"],
        group_ids=data["group_ids"],
        scores=SCORES[:batch],
        **extra,
    )


def reference_loss(alg, data):
    """The loss from tests/loops/losses.py, aggregated by tests/loops/aggregate.py."""
    lp, old, adv, mask = loops.lists(data)
    name = alg.name

    def agg(values):
        return loops.aggregate(
            values, mask, alg.loss_agg_mode, norm_constant=alg.norm_constant, group_ids=data["group_ids"].tolist()
        )

    if name == "gmpo":
        return agg(loops.gmpo(lp, old, adv, mask, clip_low=alg.clip_low, clip_high=alg.clip_high))
    if name == "clip_cov":
        seed = alg.generator.initial_seed()
        keys = torch.rand(data["mask"].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))

        def draw(cells):  # the candidates of smallest key
            return sorted(cells, key=lambda c: float(keys[c]))

        return agg(
            loops.clip_cov(
                lp,
                old,
                adv,
                mask,
                clip_low=alg.clip_low,
                clip_high=alg.clip_high,
                ratio=alg.clip_cov_ratio,
                lb=alg.clip_cov_lb,
                ub=alg.clip_cov_ub,
                draw=draw,
            )[0]
        )
    if name == "kl_cov":
        return agg(loops.kl_cov(lp, old, adv, mask, ratio=alg.kl_cov_ratio, kl_coef=alg.ppo_kl_coef)[0])
    if name == "gpg":
        return agg(loops.gpg(lp, old, adv, mask))
    if name == "tis_pg":
        return agg(loops.tis_pg(lp, old, adv, mask, low=alg.tis_lower_bound, high=alg.tis_upper_bound))
    if name == "topr":
        scores = SCORES[: len(lp)].tolist()
        return agg(loops.topr(lp, old, adv, mask, scores, low=alg.tis_lower_bound, high=alg.tis_upper_bound))
    if name in ("dppo_tv", "dppo_kl"):
        return agg(
            loops.dppo(
                lp,
                old,
                adv,
                mask,
                divergence=alg.divergence,
                clip_low=alg.clip_low,
                clip_high=alg.clip_high,
                truncation=alg.truncation,
            )
        )
    if name == "dro":
        return agg(loops.dro(lp, old, adv, mask, beta=alg.dro_beta))
    if name == "vespo":
        return agg(
            loops.vespo(
                lp,
                old,
                adv,
                mask,
                k_pos=alg.vespo_k_pos,
                lambda_pos=alg.vespo_lambda_pos,
                k_neg=alg.vespo_k_neg,
                lambda_neg=alg.vespo_lambda_neg,
            )
        )
    if name == "luspo":
        return loops.luspo_loss(lp, old, adv, mask, clip_low=alg.clip_low, clip_high=alg.clip_high)
    if name == "ce_gppo":
        return agg(
            loops.ce_gppo(
                lp,
                old,
                adv,
                mask,
                clip_low=alg.clip_low,
                clip_high=alg.clip_high,
                beta_low=alg.gppo_beta_low,
                beta_high=alg.gppo_beta_high,
                dual_clip=alg.dual_clip,
            )[0]
        )
    if name == "real":
        return loops.real_loss(lp, old, adv, mask, data["group_ids"].tolist(), tau=alg.real_tau)
    raise KeyError(name)


def batch_for(name, seed, per_token_adv=False):
    data = make_batch(batch=9, length=6, seed=seed, spread=0.5, per_token_adv=per_token_adv)
    data["log_prob"] = data["log_prob"].clamp(max=-1e-3)  # probabilities below one (DPPO-KL's Bernoulli KL)
    data["advantages"] = 2 * data["advantages"]
    data["group_ids"] = torch.arange(9) // 3
    return data


def overrides(name):
    """Hyperparameters that make the selection of the covariance losses non-trivial on 40 tokens."""
    if name == "clip_cov":
        return dict(clip_cov_ratio=0.1, clip_cov_lb=0.05, generator=torch.Generator().manual_seed(3))
    if name == "kl_cov":
        return dict(kl_cov_ratio=0.1)
    return {}


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize("seed", [0, 1])
def test_named_loss_matches_loop(name, seed):
    data = batch_for(name, seed, per_token_adv=name not in ("luspo", "real"))
    alg = get(name, **overrides(name))
    out = call(alg, data)
    assert out.loss.dtype == torch.float64
    assert out.loss.item() == pytest.approx(reference_loss(alg, data), rel=1e-10, abs=1e-12)
    assert out.loss.item() != 0.0


HOLDS = ["gpg", "tis_pg", "topr", "dppo_tv", "dppo_kl", "dro", "vespo", "ce_gppo", "kl_cov", "gmpo", "luspo"]


@pytest.mark.parametrize("name", HOLDS)
def test_reinforce_identity_at_ratio_one(name):
    """With log π_θ = log π_old and Â constant per sequence, the gradient is -Â∇log π under the same
    aggregation (GMPO and LUSPO reach it through their sequence ratio)."""
    data = batch_for(name, 5)
    data["old_log_prob"] = data["log_prob"].clone()
    alg = get(name, **overrides(name))
    x = data["log_prob"].clone().requires_grad_()
    call(alg, data, x).loss.backward()
    y = data["log_prob"].clone().requires_grad_()
    mask = data["mask"]
    pgloss.aggregate(torch.where(mask, -data["advantages"][:, None] * y, 0.0), mask, alg.loss_agg_mode).backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)


def test_where_the_identity_does_not_hold():
    """Clip-Cov detaches tokens even at ratio one; REAL's gradient is a group contrast."""
    for name in ("clip_cov", "real"):
        data = batch_for(name, 5)
        data["old_log_prob"] = data["log_prob"].clone()
        x = data["log_prob"].clone().requires_grad_()
        alg = get(name, **overrides(name))
        call(alg, data, x).loss.backward()
        y = data["log_prob"].clone().requires_grad_()
        pgloss.aggregate(
            torch.where(data["mask"], -data["advantages"][:, None] * y, 0.0),
            data["mask"],
            alg.loss_agg_mode,
            group_ids=data["group_ids"],
        ).backward()
        assert (x.grad - y.grad).abs().max() > 1e-3, name


def test_row_coupled_names_are_marked():
    coupled = {name for name, (family, _) in pgloss.algorithms.NAMED.items() if family.couples_rows}
    assert coupled == {"clip_cov", "gvpo", "kl_cov", "real"}


def test_real_is_split_invariant_when_calls_hold_whole_groups():
    data = batch_for("real", 7)
    alg = get("real")
    parts = [slice(0, 3), slice(3, 9)]
    normalizer = pgloss.Normalizer.count(cut(data["mask"], parts), group_ids=cut(data["group_ids"], parts))
    x = data["log_prob"].clone().requires_grad_()
    whole = call(alg, data, x)
    whole.loss.backward()
    total, grad = split_call(
        alg,
        data["log_prob"],
        parts,
        normalizer,
        old_log_prob=data["old_log_prob"],
        advantages=data["advantages"],
        mask=data["mask"],
        group_ids=data["group_ids"],
    )
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-14)


def test_topr_without_scores_is_refused():
    data = batch_for("topr", 0)
    with pytest.raises(ValueError, match="needs scores"):
        get("topr")(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])


def test_real_without_group_ids_is_refused():
    data = batch_for("real", 0)
    with pytest.raises(ValueError, match="needs group_ids"):
        get("real")(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"])


def test_vespo_takes_the_rollout_ratio_into_its_weight_instead_of_multiplying():
    data = batch_for("vespo", 2, per_token_adv=True)
    rollout = data["old_log_prob"] + 0.1
    alg = get("vespo")
    with_rollout = call(alg, data, rollout_log_prob=rollout)
    shifted = dict(data, log_prob=data["log_prob"], old_log_prob=data["old_log_prob"])
    # log(π_old/π_rollout) = -0.1 per token enters S_i, exactly as a 0.1-lower old policy would.
    phi_direct = loops.vespo(
        *loops.lists(dict(shifted, old_log_prob=data["old_log_prob"] + 0.1)),
        k_pos=2,
        lambda_pos=3,
        k_neg=3,
        lambda_neg=2,
    )
    mask = data["mask"].tolist()
    expected = loops.aggregate(phi_direct, mask, "token-mean")
    assert with_rollout.loss.item() == pytest.approx(expected, rel=1e-10)
    assert not any(key.startswith("rollout_is_weight") for key in with_rollout.metrics)  # no second weight


@pytest.mark.parametrize("name", [n for n in NEW if n not in ("clip_cov", "kl_cov", "real")])
@pytest.mark.parametrize("mode", [None, "token-sum", "seq-mean-token-mean"])
def test_split_into_micro_batches_equals_the_whole_batch(name, mode):
    """Each row-independent new name, with its own mode and two others: uneven micro-batches sharing
    the step's Normalizer sum to the whole batch's loss and gradient (float64, KL and entropy on)."""
    data = batch_for(name, 11, per_token_adv=True)
    fixed = get(name).fixed_agg_mode
    alg = get(name, loss_agg_mode=fixed or mode or get(name).loss_agg_mode, kl_coef=0.1, entropy_coef=0.01)
    parts = [slice(0, 2), slice(2, 6), slice(6, 9)]
    normalizer = pgloss.Normalizer.count(cut(data["mask"], parts))
    x = data["log_prob"].clone().requires_grad_()
    whole = call(alg, data, x, ref_log_prob=data["ref_log_prob"], entropy=data["entropy"])
    whole.loss.backward()
    total, grad = split_call(
        alg,
        data["log_prob"],
        parts,
        normalizer,
        old_log_prob=data["old_log_prob"],
        advantages=data["advantages"],
        mask=data["mask"],
        ref_log_prob=data["ref_log_prob"],
        entropy=data["entropy"],
        scores=SCORES[:9],
    )
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-14)
    assert x.grad.abs().sum() > 0
