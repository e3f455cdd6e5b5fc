"""A simulated mismatched sampler (another temperature, perturbed weights) and the lab's rollout correction."""

import pytest
import torch
from lab_helpers import TINY, tiny_policy

from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection
from pgloss.lab.config import LabConfig
from pgloss.lab.spec import parse_rollout_correction
from pgloss.lab.trainer import make_sampler, train

RUN = dict(steps=2, warm_steps=3, prompts_per_step=4, group_size=4, eval_prompts=4, samples=2, **TINY)


def test_rollout_correction_option_parses():
    assert parse_rollout_correction("default") is None
    assert parse_rollout_correction("none") == RolloutCorrection(weight_level=None)
    assert parse_rollout_correction("token:upper=2") == RolloutCorrection(weight_level="token", upper=2.0)
    assert parse_rollout_correction("sequence_geometric:mode=mask,lower=0.5,upper=2") == RolloutCorrection(
        weight_level="sequence_geometric", weight_mode="mask", lower=0.5, upper=2.0
    )
    assert parse_rollout_correction("token:seq_mean_k3=0.01,bypass=true") == RolloutCorrection(
        rejection=(Rejection("seq_mean_k3", upper=0.01),), bypass=True
    )


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(rollout_correction="tokn"), "--rollout-correction 'tokn': the level must be"),
        (dict(rollout_correction="token:uper=2"), "--rollout-correction .*unknown key 'uper'"),
        (dict(rollout_correction="token:upper=-1"), "--rollout-correction .*upper > 0"),
        (dict(rollout_correction="token:mode=mask,upper=none"), "--rollout-correction .*needs a lower or an upper"),
        (dict(sampler_temperature=0.0), "--sampler-temperature must be > 0"),
        (dict(sampler_noise=-0.1), "--sampler-noise must be >= 0"),
        (dict(max_refill_rounds=-1), "--max-refill-rounds must be >= 0"),
    ],
)
def test_bad_mismatch_settings_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        LabConfig(**fields)


def test_the_perturbed_sampler_is_seeded_by_step_and_leaves_the_policy_alone():
    policy = tiny_policy()
    before = [p.clone() for p in policy.parameters()]
    cfg = LabConfig(sampler_noise=0.1, **TINY)
    a, b, c = make_sampler(policy, cfg, 3), make_sampler(policy, cfg, 3), make_sampler(policy, cfg, 4)
    w, wa, wc = (next(m.parameters()) for m in (policy, a, c))
    assert torch.equal(wa, next(b.parameters())) and not torch.equal(wa, wc)
    rel = ((wa - w) / w)[w != 0].detach()
    assert 0.08 < float(rel.std()) < 0.12  # relative noise of scale 0.1
    assert all(torch.equal(p, q) for p, q in zip(before, policy.parameters(), strict=True))
    assert make_sampler(policy, LabConfig(**TINY), 3) is policy


ROLLOUT_KEYS = ("rollout_kl", "rollout_is_weight_mean", "rollout_is_ess")


def test_no_mismatch_records_weight_one_and_zero_kl():
    records = train(LabConfig(algorithm="grpo", rollout_correction="token:upper=2", **RUN))["metrics"]
    for r in records[:-1]:
        assert r["rollout_kl"] == 0.0 and r["rollout_is_weight_mean"] == 1.0 and r["rollout_is_ess"] == 1.0
    assert all(records[-1][k] is None for k in ROLLOUT_KEYS)  # the last record makes no update
    plain = train(LabConfig(algorithm="grpo", **RUN))["metrics"]
    assert all(r[k] is None for r in plain for k in ROLLOUT_KEYS)  # no mismatch, no correction: nothing to record


@pytest.mark.parametrize("fields", [dict(sampler_noise=0.2), dict(sampler_temperature=1.5)])
def test_a_mismatched_sampler_records_nontrivial_metrics(fields):
    records = train(LabConfig(algorithm="grpo", rollout_correction="token:upper=1.05", **RUN, **fields))["metrics"]
    for r in records[:-1]:
        assert r["rollout_k3_kl"] > 1e-4 and abs(r["rollout_kl"]) > 1e-4 and r["rollout_is_ess"] < 1.0
        assert 0 < r["rollout_is_bounded_frac"] < 1 and r["rollout_is_weight_max"] <= 1.05 + 1e-6
