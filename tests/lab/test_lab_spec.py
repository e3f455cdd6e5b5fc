"""Algorithm specs of the command line: parsing, labels, and checks against ``pgloss.get``."""

import pytest

import pgloss
from pgloss.lab.spec import Spec, parse_algorithms, parse_spec

NAMES = pgloss.names()


def labels(*items, loss_args=()):
    return [s.label for s in parse_algorithms(list(items), NAMES, list(loss_args))]


def test_names_spaces_commas_and_all():
    assert labels("grpo,dapo", "gspo") == ["grpo", "dapo", "gspo"]
    assert labels("all") == NAMES
    assert labels("all", "dapo:clip_high=0.3") == [*NAMES, "dapo:clip_high=0.3"]


def test_settings_parse_to_typed_values_and_a_canonical_label():
    spec = parse_spec("dapo:clip_high=0.30,dual_clip=none:loss_agg_mode=token-mean")
    assert spec == Spec("dapo", (("clip_high", 0.3), ("dual_clip", None), ("loss_agg_mode", "token-mean")))
    assert spec.label == "dapo:clip_high=0.3,dual_clip=none,loss_agg_mode=token-mean"
    assert parse_spec("fipo:fipo_clip_high_only=true").args == (("fipo_clip_high_only", True),)
    # a comma-separated key=value continues the previous spec's settings
    assert labels("grpo,dapo:clip_high=0.3,clip_low=0.1") == ["grpo", "dapo:clip_high=0.3,clip_low=0.1"]


def test_two_settings_of_one_loss_are_two_runs_and_duplicates_are_refused():
    assert labels("dapo", "dapo:clip_high=0.3") == ["dapo", "dapo:clip_high=0.3"]
    with pytest.raises(ValueError, match="listed twice"):
        labels("dapo:clip_high=0.3", "dapo:clip_high=0.30")


def test_loss_args_apply_to_every_algorithm_and_a_spec_wins():
    specs = parse_algorithms(["grpo", "dapo:kl_coef=0.1"], NAMES, ["kl_coef=0.01"])
    assert [s.label for s in specs] == ["grpo:kl_coef=0.01", "dapo:kl_coef=0.1"]
    assert specs[0].build(24).kl_coef == 0.01 and specs[1].build(24).kl_coef == 0.1


def test_build_applies_the_settings_and_gives_sum_norm_the_response_budget():
    assert parse_spec("dapo:clip_high=0.3").build(24).clip_high == 0.3
    assert parse_spec("dr_grpo").build(24).norm_constant == 24.0
    assert parse_spec("dr_grpo:norm_constant=100").build(24).norm_constant == 100
    assert parse_spec("grpo:loss_agg_mode=seq-mean-token-sum-norm").build(12).norm_constant == 12.0


def test_a_typo_names_the_valid_hyperparameters():
    with pytest.raises(TypeError, match=r"dapo:clip_hihg=0.3: .*clip_hihg.*clip_high"):
        parse_spec("dapo:clip_hihg=0.3").build(24)
    with pytest.raises(TypeError, match="clip_high must be a real number, got 'wide'"):
        parse_spec("dapo:clip_high=wide").build(24)
    with pytest.raises(ValueError, match="unknown algorithm 'grop'"):
        parse_spec("grop").build(24)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_spec("dapo:clip_high")
    with pytest.raises(ValueError, match="before any algorithm"):
        labels("clip_high=0.3,dapo")
    with pytest.raises(ValueError, match="no algorithm"):
        labels(" , ")


def test_the_exact_full_vocabulary_kl_is_refused_before_training():
    with pytest.raises(ValueError, match="grpo:kl_estimator=full: the lab computes the KL term from sampled tokens"):
        parse_spec("grpo:kl_estimator=full").build(24)
    assert parse_spec("grpo:kl_estimator=k3+").build(24).kl_estimator == "k3+"
