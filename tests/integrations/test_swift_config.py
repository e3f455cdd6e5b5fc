"""ms-swift's GRPO arguments as a pgloss Algorithm (`pgloss.trainer_options.swift`), without ms-swift installed: the
map and its refusals. The adapter's behaviour inside ms-swift's trainer is tests/integrations/swift_adapter's."""

import subprocess
import sys
from pathlib import Path

import pytest

import pgloss
from pgloss.trainer_options.swift import counts_rejected, from_swift, parse_loss_type, swift_algorithm


def test_ms_swifts_defaults_are_grpo_with_its_kl():
    algorithm = from_swift({})
    assert algorithm.name == "grpo" and algorithm.loss_agg_mode == "seq-mean-token-mean"
    assert (algorithm.kl_coef, algorithm.kl_estimator, algorithm.kl_correction) == (0.04, "k3", None)
    assert (algorithm.clip_low, algorithm.clip_high) == (0.2, 0.2)
    assert from_swift({"kl_in_reward": True}).kl_coef == 0


@pytest.mark.parametrize(
    ("options", "field", "value"),
    [
        (dict(loss_type="dapo", epsilon_high=0.28), "clip_high", 0.28),
        (dict(loss_type="grpo", importance_sampling_level="sequence_token"), "ratio_level", "sequence_token"),
        (dict(loss_type="sapo", tau_pos=2.0), "tau_pos", 2.0),
        (dict(loss_type="fipo", fipo_decay_rate=8.0), "fipo_decay_rate", 8.0),
        (dict(loss_type="real", real_tau=0.2), "real_tau", 0.2),
        (dict(loss_type="dr_grpo", max_completion_length=64), "norm_constant", 64.0),
    ],
)
def test_ms_swifts_loss_types_and_options(options, field, value):
    assert getattr(from_swift(options), field) == value


def test_rollout_importance_sampling_modes():
    token = from_swift(dict(rollout_importance_sampling_mode="token_mask", rollout_importance_sampling_threshold=3.0))
    correction = token.rollout_correction
    assert (correction.weight_level, correction.weight_mode, correction.upper, correction.weight_kl) == (
        "token",
        "mask",
        3.0,
        True,
    )
    sequence = from_swift(dict(rollout_importance_sampling_mode="sequence_mask"))
    assert sequence.rollout_correction.rejection[0].lower == 0.5 and counts_rejected(
        dict(rollout_importance_sampling_mode="sequence_mask")
    )
    assert from_swift(dict(off_policy_sequence_mask_delta=0.1)).rollout_correction.off_policy_mask == 0.1
    with pytest.raises(ValueError, match="rollout_importance_sampling_mode='tokens'"):
        from_swift(dict(rollout_importance_sampling_mode="tokens"))


def test_loss_type_names_any_pgloss_algorithm_with_its_fields():
    assert parse_loss_type("pgloss:gmpo,clip_low=0.3,loss_agg_mode=token-mean") == (
        "gmpo",
        {"clip_low": 0.3, "loss_agg_mode": "token-mean"},
    )
    assert parse_loss_type(["dapo"]) is None
    algorithm = swift_algorithm(dict(loss_type="pgloss:clip_cov,clip_cov_ratio=0.001", beta=0.0))
    assert (algorithm.name, algorithm.clip_cov_ratio, algorithm.kl_coef) == ("clip_cov", 0.001, 0.0)
    # ms-swift's epsilon sets both bounds (epsilon_high None); the loss_type's own field wins over it
    dapo = swift_algorithm(dict(loss_type="pgloss:dapo,clip_high=0.28", epsilon=0.3))
    assert (dapo.clip_low, dapo.clip_high, dapo.kl_coef) == (0.3, 0.28, 0.04)
    assert swift_algorithm(dict(beta=0.0), "dppo_tv") == pgloss.get("dppo_tv", generation_budget=512.0)
    given = pgloss.get("gspo")
    assert swift_algorithm({}, given) is given


def test_sdar_and_the_teachers_advantages():
    """SDAR's arguments are its term's fields, on ms-swift's losses and on a named one; RLSD and OPD-RL (a teacher,
    teacher_kl_coef) change ms-swift's advantages only, so the algorithm is the one without them."""
    sdar = dict(sdar_loss_coef=0.1, sdar_gate_beta=3.0)
    for algorithm in (from_swift(sdar), swift_algorithm(sdar | dict(loss_type="dapo")), swift_algorithm(sdar, "gspo")):
        assert (algorithm.sdar_coef, algorithm.sdar_gate_beta) == (0.1, 3.0)
        assert "teacher_log_prob" in algorithm.needs
    assert swift_algorithm(dict(loss_type="pgloss:grpo,sdar_coef=0.2")).sdar_coef == 0.2
    assert swift_algorithm(dict(sdar_loss_coef=0.2), pgloss.get("grpo", sdar_coef=0.2)).sdar_coef == 0.2
    assert from_swift({}).sdar_coef == 0 and "teacher_log_prob" not in from_swift({}).needs
    teacher = dict(advantage_reweight="rlsd", rlsd_lambda=0.8, teacher_model="some/teacher", teacher_kl_coef=0.5)
    assert swift_algorithm(teacher) == from_swift({})
    assert swift_algorithm(teacher | dict(teacher_model=None, teacher_model_server="http://x:8000")) == from_swift({})


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (dict(advantage_reweight="other"), "advantage_reweight='other'"),
        (dict(loss_type="pgloss:grpo,sdar_coef=0.2", sdar_loss_coef=0.1), "sdar_loss_coef=0.1 with the algorithm's"),
        (dict(chord_sft_dataset=["x.jsonl"]), "chord_sft_dataset"),
        (dict(use_liger_kernel=True), "use_liger_kernel=True"),
        (dict(sequence_parallel_size=2), "sequence_parallel_size=2"),
        (dict(rlhf_type="dpo"), "rlhf_type='dpo'"),
        (dict(loss_type="pgloss:gmpo,no_such_field=1"), "no hyperparameter 'no_such_field'"),
        (dict(loss_type="pgloss:gmpo,clip_low"), "'clip_low' is not field=value"),
        (dict(loss_type="pgloss:gmpo", epsilon_high=0.5), "adapter cannot honour: epsilon_high=0.5"),
        (dict(loss_type="pgloss:grpo", tau_pos=2.0), "tau_pos=2.0"),
        (dict(loss_type="pgloss:cispo", importance_sampling_level="sequence_token"), "sequence_token"),
        (dict(loss_type="pgloss:nope"), "unknown algorithm 'nope'"),
    ],
)
def test_what_pgloss_cannot_honour_is_refused_by_name(options, named):
    with pytest.raises(ValueError, match=named.replace("(", r"\(").replace("[", r"\[")):
        swift_algorithm(options)


def test_the_cli_prints_the_plugin_file():
    out = subprocess.run(
        [sys.executable, "-m", "pgloss.cli", "swift-plugin"], capture_output=True, text=True, check=True
    ).stdout.strip()
    path = Path(out)
    assert path.name == "swift_plugin.py" and "install()" in path.read_text()
