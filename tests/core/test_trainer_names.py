"""A trainer's name for a pgloss hyperparameter or value gets an error naming pgloss's (`pgloss.core.trainer_names`)."""

import re

import pytest

import pgloss


@pytest.mark.parametrize(
    "given, ours",
    [
        ("epsilon", "clip_low"),
        ("epsilon_high", "clip_high"),
        ("clip_ratio_low", "clip_low"),
        ("clip_ratio_high", "clip_high"),
        ("clip_ratio_c", "dual_clip"),
        ("beta", "kl_coef"),
        ("kl_loss_coef", "kl_coef"),
        ("entropy_coeff", "entropy_coef"),
        ("loss_scale_factor", "norm_constant"),
    ],
)
def test_a_trainers_hyperparameter_name_is_answered_with_ours(given, ours):
    with pytest.raises(TypeError, match=rf"no hyperparameter '{given}' \(did you mean {ours}\?"):
        pgloss.get("dual_clip_ppo", **{given: 0.3})
    assert hasattr(pgloss.get("dual_clip_ppo"), ours) or ours == "norm_constant"


@pytest.mark.parametrize("given, ours", [("low_var_kl", "k3"), ("kl", "k1"), ("mse", "k2"), ("low_var_kl+", "k3+")])
def test_verls_kl_names_are_answered_with_ours(given, ours):
    with pytest.raises(ValueError, match=re.escape(f"did you mean '{ours}'?")):
        pgloss.get("grpo", kl_estimator=given)
    pgloss.get("grpo", kl_estimator=ours)


def test_a_misspelt_name_without_a_synonym_gets_the_closest_name_not_a_trainer_s():
    with pytest.raises(TypeError) as error:
        pgloss.get("dapo", clip_hgh=0.3)
    assert "(did you mean 'clip_high'?)" in str(error.value) and "name for it" not in str(error.value)
