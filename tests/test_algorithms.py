"""Every named algorithm against a plain loop written from its formula, in float64."""

import dataclasses
import math

import loops
import pytest
import torch
from conftest import algorithm, log_probs, make_batch

import pgloss

# The families whose loops live in tests/loops.py (LUSPO and FIPO subclass the clipped family);
# the other names are checked against tests/loops/losses.py in losses/test_families_against_loops.py.
NAMES = [
    n
    for n, (family, _) in pgloss.algorithms.NAMED.items()
    if issubclass(family, (pgloss.ClippedPolicy, pgloss.CISPO, pgloss.SAPO)) and family is not pgloss.CHORD
]
# CHORD (a ClippedPolicy mixed with SFT on expert rows) has its own loop: tests/losses/test_chord.py.


def per_token_advantages(data):
    adv = data["advantages"]
    return adv[:, None].expand_as(data["log_prob"]) if adv.ndim == 1 else adv


def reference_policy(alg, data):
    """ℓ_{i,t} from tests/loops.py for the algorithm's family."""
    lp, old = data["log_prob"].tolist(), data["old_log_prob"].tolist()
    adv, mask = per_token_advantages(data).tolist(), data["mask"].tolist()
    if isinstance(alg, pgloss.CISPO):
        return loops.cispo_per_token(lp, old, adv, clip_low=alg.clip_low, clip_high=alg.clip_high)
    if isinstance(alg, pgloss.SAPO):
        return loops.sapo_per_token(lp, old, adv, tau_pos=alg.tau_pos, tau_neg=alg.tau_neg)
    values = loops.clipped_policy_per_token(
        lp,
        old,
        adv,
        mask,
        level=alg.ratio_level,
        clip_low=alg.clip_low,
        clip_high=alg.clip_high,
        dual_clip=alg.dual_clip,
        delta=alg.delta,
    )
    if isinstance(alg, pgloss.FIPO):
        f = loops.fipo_weights(
            lp,
            old,
            adv,
            mask,
            decay_rate=alg.fipo_decay_rate,
            clip_range=alg.fipo_clip_range,
            clip_high_only=alg.fipo_clip_high_only,
            safety_threshold=alg.fipo_safety_threshold,
            delta=alg.delta,
        )
        values = [[w * v for w, v in zip(fr, vr, strict=True)] for fr, vr in zip(f, values, strict=True)]
    return values


def reference_loss(alg, data):
    mask = data["mask"].tolist()
    group_ids = data["group_ids"].tolist()

    def agg(values):
        return loops.aggregate(values, mask, alg.loss_agg_mode, norm_constant=alg.norm_constant, group_ids=group_ids)

    loss = alg.policy_coef * agg(reference_policy(alg, data))
    lp, ref, ent = data["log_prob"].tolist(), data["ref_log_prob"].tolist(), data["entropy"].tolist()
    old, teacher = data["old_log_prob"].tolist(), data["teacher_log_prob"].tolist()
    if alg.distill_coef:
        values, _ = loops.distill_pg(
            lp,
            old,
            teacher,
            estimator=alg.distill_estimator,
            clamp=alg.distill_clamp,
            clip_low=alg.distill_clip_low,
            clip_high=alg.distill_clip_high,
            dual_clip=alg.distill_dual_clip,
        )
        loss += alg.distill_coef * agg(values)
    if alg.self_distill_coef:
        values, _ = loops.sdpo(lp, old, teacher, cap=alg.self_distill_is_cap)
        loss += alg.self_distill_coef * loops.aggregate(values, mask, "seq-mean-token-mean")
    if alg.sdar_coef:
        values, _ = loops.sdar(lp, teacher, gate_beta=alg.sdar_gate_beta)
        loss += alg.sdar_coef * loops.aggregate(values, mask, "token-mean")
    if alg.kl_coef:
        loss += alg.kl_coef * agg(
            [
                [loops.kl(a, b, alg.kl_estimator) for a, b in zip(ra, rb, strict=True)]
                for ra, rb in zip(lp, ref, strict=True)
            ]
        )
    if alg.entropy_coef:
        loss -= alg.entropy_coef * agg(ent)
    return loss


def call(alg, data, **extra):
    return alg(
        data["log_prob"],
        data["old_log_prob"],
        data["advantages"],
        data["mask"],
        ref_log_prob=data["ref_log_prob"],
        entropy=data["entropy"],
        group_ids=data["group_ids"],
        teacher_log_prob=data["teacher_log_prob"],
        **extra,
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_named_loss_matches_loop(name, seed):
    data = make_batch(seed=seed, spread=0.4)
    alg = algorithm(name, entropy_coef=0.01)
    out = call(alg, data)
    assert out.loss.dtype == torch.float64
    assert out.loss.item() == pytest.approx(reference_loss(alg, data), rel=1e-10, abs=1e-12)
    expected = torch.tensor(reference_policy(alg, data), dtype=torch.float64) * data["mask"]
    torch.testing.assert_close(out.per_token, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", pgloss.AGG_MODES)
@pytest.mark.parametrize("name", ["grpo", "gspo_token", "cispo", "sapo", "fipo"])
def test_every_aggregation_matches_loop(name, mode):
    data = make_batch(seed=3, per_token_adv=True)
    alg = algorithm(name, loss_agg_mode=mode, norm_constant=11.0, kl_coef=0.1)
    assert call(alg, data).loss.item() == pytest.approx(reference_loss(alg, data), rel=1e-10, abs=1e-12)


@pytest.mark.parametrize(
    "setting",
    [
        dict(),  # the 32B headline run: [1, 1.2], safety threshold 10, delta 10
        dict(fipo_clip_high_only=False, fipo_safety_threshold=3.0),  # the 7B run
        dict(fipo_safety_threshold=4.0, delta=None),  # ms-swift's defaults
        dict(fipo_clip_range=None, fipo_safety_threshold=1.5),  # no clipping: the safety interval is [0.8, 1]
    ],
)
def test_fipo_settings_match_loop(setting):
    data = make_batch(seed=6, spread=1.2, per_token_adv=True)
    alg = pgloss.get("fipo", **setting)
    assert call(alg, data).loss.item() == pytest.approx(reference_loss(alg, data), rel=1e-10, abs=1e-12)


def test_fipo_defaults_are_the_32b_run():
    alg = pgloss.get("fipo")
    assert (alg.fipo_clip_range, alg.fipo_clip_high_only, alg.fipo_safety_threshold, alg.delta) == (
        0.2,
        True,
        10.0,
        10.0,
    )


def test_dual_clip_bounds_negative_advantage_loss_at_c():
    # A = -1 and r = e^2 ≈ 7.39: PPO's loss is 7.39, dual clip caps it at c = 3, gradient zero.
    lp = torch.zeros(1, 1, dtype=torch.float64, requires_grad=True)
    args = (
        torch.full((1, 1), -2.0, dtype=torch.float64),
        torch.tensor([-1.0], dtype=torch.float64),
        torch.ones(1, 1, dtype=torch.bool),
    )
    ppo = pgloss.get("ppo")(lp, *args)
    assert ppo.loss.item() == pytest.approx(math.exp(2.0))
    out = pgloss.get("dual_clip_ppo")(lp, *args)
    assert out.loss.item() == pytest.approx(3.0)
    assert out.metrics["pg_clipfrac_lower"].item() == 1.0
    out.loss.backward()
    assert lp.grad.item() == 0.0


def test_delta_cap_equals_dual_clip_with_same_constant():
    data = make_batch(seed=4, spread=1.5)
    for c in (1.5, 3.0):
        a = call(pgloss.get("ppo", dual_clip=c), data)
        b = call(pgloss.get("ppo", delta=c), data)
        torch.testing.assert_close(a.per_token, b.per_token, rtol=0, atol=1e-15)
        assert a.metrics["pg_clipfrac_lower"].item() == b.metrics["pg_clipfrac_lower"].item()


def test_dr_grpo_with_divisor_equal_to_token_count_is_token_mean():
    data = make_batch(seed=5)
    tokens, sequences = data["mask"].sum().item(), data["mask"].any(dim=1).sum().item()
    dr = call(pgloss.get("dr_grpo", norm_constant=tokens / sequences), data)
    token_mean = call(pgloss.get("ppo", loss_agg_mode="token-mean"), data)
    assert dr.loss.item() == pytest.approx(token_mean.loss.item(), rel=1e-12)


def test_sample_grpo_uses_the_whole_sequence_ratio():
    # "OpenR1 in practice (6): sample-level vs token-level loss" (2025-06-04): ρ_i = exp(Σ_t log π_θ - Σ_t log π_old),
    # not the length-normalised GSPO ratio.
    old = torch.full((1, 4), -1.0, dtype=torch.float64)
    lp = old + torch.tensor([[0.05, 0.05, 0.05, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    adv = torch.tensor([-1.0], dtype=torch.float64)
    out = pgloss.get("sample_grpo")(lp, old, adv, mask)
    assert out.metrics["ratio_mean"].item() == pytest.approx(math.exp(0.15))
    assert out.loss.item() == pytest.approx(math.exp(0.15))  # A < 0, r > 1 + ε: unclipped branch -A·r
    gspo = pgloss.get("gspo")(lp, old, adv, mask)
    assert gspo.metrics["ratio_mean"].item() == pytest.approx(math.exp(0.05))


def test_cispo_trl_parameterisation_is_clip_high_minus_one():
    # TRL / ms-swift: min(r, ε_high) with ε_high = 5 is the paper's form with clip_high = 4, no lower bound.
    data = make_batch(seed=6, spread=2.0, per_token_adv=True)
    out = call(pgloss.get("cispo", clip_high=4.0), data)
    r = torch.exp(data["log_prob"] - data["old_log_prob"])
    expected = -torch.clamp(r, max=5.0) * data["advantages"] * data["log_prob"] * data["mask"]
    torch.testing.assert_close(out.per_token, expected)
    verl = call(pgloss.get("cispo", clip_low=0.2, clip_high=0.28), data)
    expected = -r.clamp(0.8, 1.28) * data["advantages"] * data["log_prob"] * data["mask"]
    torch.testing.assert_close(verl.per_token, expected)


def test_gspo_fixes_its_aggregation():
    with pytest.raises(ValueError, match="fixes loss_agg_mode"):
        pgloss.get("gspo", loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="fixes loss_agg_mode"):
        pgloss.get("sample_grpo", loss_agg_mode="seq-mean-token-sum")
    assert pgloss.get("gspo_token", loss_agg_mode="token-mean").loss_agg_mode == "token-mean"


def test_metrics_are_detached_masked_and_split():
    data = make_batch(seed=7, spread=0.6)
    data["log_prob"].requires_grad_(True)
    out = call(pgloss.get("dapo"), data)
    for key, value in out.metrics.items():
        assert value.ndim == 0 and not value.requires_grad, key
    m = data["mask"]
    lr = (data["log_prob"] - data["old_log_prob"]).detach()
    r = lr.exp()
    adv = per_token_advantages(data)
    high = ((adv > 0) & (r > 1.28) & m).sum() / m.sum()
    low = ((adv < 0) & (r < 0.8) & m).sum() / m.sum()
    assert out.metrics["pg_clipfrac_high"].item() == pytest.approx(high.item())
    assert out.metrics["pg_clipfrac_low"].item() == pytest.approx(low.item())
    assert out.metrics["pg_clipfrac"].item() == pytest.approx((high + low).item())
    assert out.metrics["ppo_kl"].item() == pytest.approx((-lr)[m].mean().item())
    assert out.metrics["ratio_max"].item() == pytest.approx(r[m].max().item())
    assert out.metrics["ratio_min"].item() == pytest.approx(r[m].min().item())
    assert out.metrics["entropy"].item() == pytest.approx(data["entropy"][m].mean().item())


def test_truncated_importance_sampling_weight():
    data = make_batch(seed=8)
    rollout = log_probs(data["old_log_prob"] + 0.8 * torch.randn_like(data["old_log_prob"]))
    plain = call(pgloss.get("grpo", kl_coef=0.0), data)
    tis = call(pgloss.get("grpo", kl_coef=0.0, rollout_is_cap=2.0), data, rollout_log_prob=rollout)
    w = torch.exp(data["old_log_prob"] - rollout).clamp(max=2.0)
    torch.testing.assert_close(tis.per_token, plain.per_token * w * data["mask"])


def test_algorithm_is_a_frozen_dataclass_with_paper_defaults():
    dapo = pgloss.get("dapo")
    assert (dapo.clip_low, dapo.clip_high, dapo.kl_coef, dapo.loss_agg_mode) == (0.2, 0.28, 0.0, "token-mean")
    gspo = pgloss.get("gspo")
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    assert pgloss.get("grpo").kl_coef == 0.04 and pgloss.get("grpo").kl_estimator == "k3"
    assert pgloss.get("dual_clip_ppo").dual_clip == 3.0
    assert not pgloss.recipe("dr_grpo").scale_rewards and pgloss.recipe("dapo").dynamic_sampling
    assert pgloss.recipe("grpo") == pgloss.algorithms.Recipe(scale_rewards=True, dynamic_sampling=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        dapo.clip_high = 0.3


def test_the_recipe_is_not_a_field_of_the_loss():
    """Advantages and sampling belong to the trainer: get() refuses them and points at pgloss.recipe."""
    with pytest.raises(
        TypeError, match=r"dynamic_sampling belongs to the advantages and sampling.*pgloss.recipe\('dapo'\)"
    ):
        pgloss.get("dapo", dynamic_sampling=False)
    assert "scale_rewards" not in pgloss.get("dr_grpo", norm_constant=1.0).describe()
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        pgloss.recipe("nope")


@pytest.mark.parametrize("name", ["grpo", "cispo", "sapo", "gspo"])
def test_teacher_terms_on_any_family_match_loop(name):
    """The three teachers' terms (verl's distillation, SDPO's, SDAR's) and a policy weight on families that do
    not name them: each adds its own aggregate, the family's term is weighed."""
    data = make_batch(seed=5, spread=0.5)
    alg = algorithm(
        name, distill_coef=0.3, distill_estimator="k2", self_distill_coef=0.2, sdar_coef=0.1, policy_coef=0.5
    )
    out = call(alg, data)
    assert out.loss.item() == pytest.approx(reference_loss(alg, data), rel=1e-10, abs=1e-12)
    for metric in ("distill_loss", "self_distill_loss", "sdar_loss"):
        assert out.metrics[metric].item() != 0.0
