"""pgloss.from_trl and the adapter's option mapping, on TRL 1.16's real GRPOConfig (no model, no trainer)."""

import dataclasses
import math

import pytest
import torch

import pgloss
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection

pytest.importorskip("trl")

from trl import GRPOConfig

from pgloss.trainer_options.trl import adaptive_entropy, rollout_correction
from pgloss.trainer_options.trl_trainer import reference_model_refusal, trainer_algorithm


def config(**options):
    return GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, max_completion_length=64, **options)


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, pgloss.get("dapo", clip_high=0.2)),  # TRL's dapo: epsilon_high None is epsilon
        (dict(loss_type="grpo", beta=0.04), pgloss.get("grpo", kl_correction="ratio_weighted")),
        (dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False), pgloss.get("grpo")),
        (
            dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
            pgloss.get("grpo", kl_coef=0.0, ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
        ),
        (dict(loss_type="bnpo", epsilon_high=0.28, delta=1.5), pgloss.get("bnpo", clip_high=0.28, delta=1.5)),
        (dict(loss_type="dr_grpo", scale_rewards="none"), pgloss.get("dr_grpo", norm_constant=64.0)),
        (dict(loss_type="cispo", epsilon_high=5.0), pgloss.get("cispo", clip_high=5.0, cispo_convention="absolute")),
        (dict(loss_type="sapo", sapo_temperature_neg=2.0), pgloss.get("sapo", tau_neg=2.0)),
        (dict(loss_type="vespo", vespo_k_pos=1.5), pgloss.get("vespo", vespo_k_pos=1.5)),
        (dict(loss_type="luspo", importance_sampling_level="sequence"), pgloss.get("luspo")),
        (dict(loss_type="luspo"), pgloss.get("luspo", ratio_level="token")),  # TRL's default level, with its warning
        (dict(entropy_coef=0.01), pgloss.get("dapo", clip_high=0.2, entropy_coef=0.01)),
    ],
    ids=lambda v: ",".join(f"{k}={v}" for k, v in v.items()) if isinstance(v, dict) else "",
)
def test_from_trl_is_the_loss_the_config_asks_for(options, expected):
    got = pgloss.from_trl(config(**options))
    assert got == expected


def trl_is_ratio(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM importance-sampling ratio (`_generate_and_score_completions`), written out."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    log = diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff
    ratio = torch.exp(log)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize(("clip_min", "clip_max"), [(None, 3.0), (0.5, 2.0), (None, None)])
def test_vllm_importance_sampling_is_the_rollout_correction(mode, clip_min, clip_max):
    """Every vLLM IS mode and bound: pgloss's weight equals TRL's ratio on every valid token."""
    if mode.endswith("truncate") and clip_min is None and clip_max is None:
        pytest.skip("TRL's GRPOConfig refuses a truncation without bounds")
    corr = rollout_correction(
        config(
            use_vllm=True,
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_min=clip_min,
            vllm_importance_sampling_clip_max=clip_max,
        )
    )
    generator = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 5, generator=generator, dtype=torch.float64) * 2
    sampling = old + 0.3 * torch.randn(6, 5, generator=generator, dtype=torch.float64)
    mask = torch.ones(6, 5, dtype=torch.bool)
    mask[0, 3:] = False
    theirs = trl_is_ratio(old, sampling, mask.double(), mode, clip_min, clip_max).expand(6, 5)
    out = corr.apply(
        log_prob=old,
        old_log_prob=old,
        rollout_log_prob=sampling,
        mask=mask,
        seq_advantages=torch.ones(6, dtype=torch.float64),
    )
    torch.testing.assert_close(out.weight[mask], theirs[mask], rtol=1e-12, atol=0)
    assert 0 < float((out.weight[mask] != 1).double().mean())  # the weights are not trivially one
    torch.testing.assert_close(out.mask, mask)  # masked weights stay in the count, as TRL's


def test_off_policy_mask_threshold_is_the_off_policy_mask():
    assert rollout_correction(config(off_policy_mask_threshold=0.5)) == RolloutCorrection(
        weight_level=None, off_policy_mask=0.5
    )
    both = rollout_correction(config(use_vllm=True, off_policy_mask_threshold=0.5))
    assert (both.weight_level, both.weight_mode, both.upper, both.off_policy_mask) == (
        "sequence_product",
        "mask",
        3.0,
        0.5,
    )


# -- a name: TRL options translated; an Algorithm: conflicts refused ---------------------------------------


def test_a_names_trl_options_are_translated_onto_it():
    assert trainer_algorithm(config(epsilon_high=0.4), "dapo") == pgloss.get("dapo", clip_high=0.4)
    assert trainer_algorithm(config(epsilon=0.3), "dapo") == pgloss.get("dapo", clip_low=0.3, clip_high=0.3)
    assert trainer_algorithm(config(delta=2.0, importance_sampling_level="sequence"), "grpo") == pgloss.get(
        "grpo", delta=2.0, ratio_level="sequence", kl_coef=0.0
    )  # TRL's beta (0) is kept
    assert trainer_algorithm(config(sapo_temperature_neg=2.0), "sapo") == pgloss.get("sapo", tau_neg=2.0)
    assert trainer_algorithm(config(epsilon_high=5.0), "cispo") == pgloss.get(
        "cispo", clip_high=5.0, cispo_convention="absolute"
    )
    assert trainer_algorithm(config(beta=0.1, use_bias_correction_kl=False), "dapo") == pgloss.get("dapo", kl_coef=0.1)
    assert trainer_algorithm(config(entropy_coef=0.01), "gspo") == pgloss.get("gspo", entropy_coef=0.01)
    assert trainer_algorithm(config(), "gspo") == pgloss.get("gspo")  # TRL's defaults do not overwrite gspo's
    assert trainer_algorithm(config(), "dr_grpo") == pgloss.get("dr_grpo", generation_budget=64)
    assert trainer_algorithm(config(use_vllm=True), "dapo").rollout_correction == RolloutCorrection(
        weight_level="sequence_product", weight_mode="mask", upper=3.0
    )  # TRL's default under vLLM


def test_a_name_keeps_trls_beta_unless_the_caller_sets_it(caplog):
    """TRL 1.16's beta defaults to 0 (no reference model): algorithm="grpo" keeps it, with one line saying how
    to get grpo's KL term; a beta the caller sets, or an Algorithm that carries kl_coef, is the KL term."""
    with caplog.at_level("INFO", logger="pgloss.trainer_options.trl"):
        assert trainer_algorithm(config(), "grpo") == pgloss.get("grpo", kl_coef=0.0)
    assert "TRL's beta=0.0 is kept" in caplog.text and "GRPOConfig(beta=0.04)" in caplog.text
    assert trainer_algorithm(config(beta=0.04, use_bias_correction_kl=False), "grpo") == pgloss.get("grpo")
    assert trainer_algorithm(config(), pgloss.get("grpo")).kl_coef == 0.04  # asked for, by the Algorithm


class _Config:
    def __init__(self, name_or_path):
        self._name_or_path = name_or_path


class _Model:
    def __init__(self, name_or_path=""):
        self.config = _Config(name_or_path)


def test_a_kl_term_on_a_model_built_in_memory_names_the_fix():
    grpo = pgloss.get("grpo")
    message = reference_model_refusal(_Model(), grpo)
    assert "ref_model" in message and "kl_coef" in message and "save_pretrained" in message
    assert "pgloss.get('grpo', kl_coef=0)" in message
    assert reference_model_refusal(_Model(), pgloss.get("grpo", kl_coef=0.0)) is None  # no KL term: no reference
    assert reference_model_refusal(_Model("some/model"), grpo) is None  # TRL loads the reference from its path
    assert reference_model_refusal("some/model", grpo) is None
    peft = _Model()
    peft.peft_config = {}
    assert reference_model_refusal(peft, grpo) is None  # the adapter switched off is the reference


def refusal(options, algorithm=None):
    with pytest.raises(ValueError) as caught:
        (pgloss.from_trl if algorithm is None else lambda c: trainer_algorithm(c, algorithm))(config(**options))
    return str(caught.value)


def test_refusals_name_the_option_and_their_fix_works():
    """Each refusal names the option, and the fix it suggests is a call that works."""
    message = refusal(dict(loss_type="dr_grpo"), "dapo")
    assert "loss_type='dr_grpo' with algorithm='dapo'" in message and "algorithm='dr_grpo'" in message
    assert trainer_algorithm(config(loss_type="dr_grpo"), "dr_grpo").name == "dr_grpo"
    assert trainer_algorithm(config(loss_type="dr_grpo"), None).name == "dr_grpo"

    dapo = pgloss.get("dapo")
    message = refusal(dict(epsilon_high=0.4), dapo)
    assert "clip_high=0.4" in message and "dataclasses.replace(algorithm, clip_high=0.4)" in message
    assert trainer_algorithm(config(epsilon_high=0.4), dataclasses.replace(dapo, clip_high=0.4)).clip_high == 0.4

    message = refusal(dict(top_entropy_quantile=0.2))
    assert "top_entropy_quantile=0.2" in message and "entropy_mask_applied=True" in message
    assert pgloss.from_trl(config(top_entropy_quantile=0.2), entropy_mask_applied=True).name == "dapo"

    message = refusal(dict(use_adaptive_entropy=True))
    assert "use_adaptive_entropy=True" in message and "entropy_controlled=True" in message
    assert "use_adaptive_entropy=False" in message
    assert pgloss.from_trl(config(use_adaptive_entropy=False, entropy_coef=0.01)).entropy_coef == 0.01
    adaptive = config(
        use_adaptive_entropy=True,
        entropy_coef=0.01,
        entropy_target=0.7,
        entropy_coef_delta=0.002,
        entropy_coef_min=0.001,
        entropy_coef_max=0.05,
    )
    assert pgloss.from_trl(adaptive, entropy_controlled=True).entropy_coef == 0.01
    assert trainer_algorithm(adaptive, None).entropy_coef == 0.01 and trainer_algorithm(adaptive, "dapo").name == "dapo"
    controller = adaptive_entropy(adaptive)
    assert (controller.coef, controller.target, controller.delta, controller.coef_min, controller.coef_max) == (
        0.01,
        0.7,
        0.002,
        0.001,
        0.05,
    )
    assert adaptive_entropy(config()) is None
    with pytest.raises(ValueError, match="coef_min must be <= coef_max"):
        adaptive_entropy(config(use_adaptive_entropy=True, entropy_coef_min=0.5, entropy_coef_max=0.1))

    message = refusal(dict(importance_sampling_level="sequence"))  # TRL's dapo sums a sequence ratio over tokens
    assert "importance_sampling_level='sequence'" in message and "loss_type='grpo'" in message
    assert pgloss.from_trl(config(loss_type="grpo", importance_sampling_level="sequence")).ratio_level == "sequence"

    message = refusal(dict(loss_type="sapo", importance_sampling_level="sequence"))
    assert "importance_sampling_level='sequence' with loss_type='sapo'" in message

    message = refusal(dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence"))
    assert "use_bias_correction_kl=False" in message
    assert (
        pgloss.from_trl(
            config(loss_type="grpo", beta=0.04, importance_sampling_level="sequence", use_bias_correction_kl=False)
        ).kl_correction
        is None
    )

    assert "epsilon=0.3" in refusal(dict(epsilon=0.3), "gmpo")  # GMPO's clip is in log space: no TRL meaning
    assert "delta=1.1" in refusal(dict(delta=1.1))  # pgloss needs δ > 1 + ε_high
    assert "off_policy_mask_threshold" in refusal(dict(loss_type="vespo", off_policy_mask_threshold=0.5))


def test_two_rollout_corrections_are_refused_and_both_fixes_work():
    """vllm_importance_sampling_clip_max is not silently dropped beside the algorithm's own correction."""
    own = pgloss.get("dapo", rollout_correction=RolloutCorrection(rejection=(Rejection("token_k3", upper=0.05),)))
    message = refusal(dict(use_vllm=True, vllm_importance_sampling_clip_max=2.0), own)
    assert "vllm_importance_sampling_clip_max=2.0" in message
    assert (
        trainer_algorithm(config(use_vllm=True, vllm_importance_sampling_correction=False), own).rollout_correction
        == own.rollout_correction
    )
    theirs = trainer_algorithm(
        config(use_vllm=True, vllm_importance_sampling_clip_max=2.0), dataclasses.replace(own, rollout_correction=None)
    )
    assert (theirs.rollout_correction.upper, theirs.rollout_correction.weight_level) == (2.0, "sequence_product")
    # TRL's IS options at their defaults: the algorithm's own correction is used (with a warning).
    assert trainer_algorithm(config(use_vllm=True), own).rollout_correction == own.rollout_correction


def test_import_pgloss_does_not_import_trl():
    import subprocess
    import sys

    code = "import sys, pgloss; pgloss.from_trl; assert 'trl' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def test_vespo_folds_trls_bounded_rollout_ratio_under_vllm_importance_sampling():
    """TRL's VESPO folds its truncated (token_truncate) or masked (token_mask) ratio: pgloss's VESPO
    then folds the same (`vespo_rollout_mode`), and the paper's raw ratio without vLLM."""
    config = lambda **kw: GRPOConfig(output_dir="unused", report_to="none", bf16=False, loss_type="vespo", **kw)  # noqa: E731
    masked = pgloss.from_trl(
        config(
            use_vllm=True,
            vllm_importance_sampling_mode="token_mask",
            vllm_importance_sampling_clip_min=0.5,
            vllm_importance_sampling_clip_max=2.0,
        )
    )
    assert (masked.vespo_rollout_mode, masked.vespo_rollout_clip_min, masked.vespo_rollout_clip_max) == (
        "mask",
        0.5,
        2.0,
    )
    truncated = pgloss.from_trl(config(use_vllm=True, vllm_importance_sampling_mode="token_truncate"))
    assert (truncated.vespo_rollout_mode, truncated.vespo_rollout_clip_max) == ("truncate", 3.0)
    assert pgloss.from_trl(config()).vespo_rollout_mode == "raw"
    with pytest.raises(ValueError, match="token_truncate' or 'token_mask'"):
        pgloss.from_trl(config(use_vllm=True))  # TRL's default sequence_mask: TRL refuses it for VESPO too


def test_grpo_options_hold_trl_s_defaults():
    """`from_trl(dict)` fills what the dict leaves out from `GRPOOptions`: each of its defaults is the installed
    TRL's, and it names every GRPOConfig option pgloss reads."""
    from pgloss.trainer_options.trl import GRPOOptions

    theirs = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    for field in dataclasses.fields(GRPOOptions):
        assert field.name in theirs and field.default == theirs[field.name], field.name


@pytest.mark.parametrize(
    "options",
    [
        dict(loss_type="dapo", epsilon_high=0.28),
        dict(loss_type="grpo", beta=0.04),
        dict(loss_type="cispo", epsilon_high=5.0, max_completion_length=64),
        dict(loss_type="bnpo", vllm_importance_sampling_mode="token_truncate"),
    ],
)
def test_from_trl_takes_a_dict_of_options_as_the_config(options):
    """A dict of GRPOConfig options is the config with TRL's defaults for the rest (the issue's
    `from_trl(dict(loss_type="dapo", epsilon_high=0.28))` raised AttributeError), GRPOConfig.to_dict() too."""
    full = GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, **options)
    assert pgloss.from_trl(options) == pgloss.from_trl(full)
    assert pgloss.from_trl(full.to_dict()) == pgloss.from_trl(full)


def test_from_trl_refuses_a_misspelt_option_in_a_dict():
    with pytest.raises(
        ValueError,
        match=r"^TRL's GRPOConfig: 'epsilon_hgh' is not an option \(did you mean "
        r"'epsilon_high'\?\)",
    ):
        pgloss.from_trl(dict(loss_type="dapo", epsilon_hgh=0.28))
