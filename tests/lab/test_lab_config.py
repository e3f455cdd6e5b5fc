"""LabConfig refuses impossible settings before any training, naming the flag."""

import pytest
import torch

from pgloss.lab.config import LabConfig


@pytest.mark.parametrize(
    "field, value, flag",
    [
        ("steps", 0, "--steps"),
        ("group_size", 1, "--group-size"),
        ("temperature", 0.0, "--temperature"),
        ("minibatches", 40, "--minibatches"),
        ("d_model", 30, "--d-model"),
        ("scratchpad_prob", 1.5, "--scratchpad-prob"),
        ("samples", 100, "--samples"),
        ("lr", float("nan"), "--lr"),
        ("task", "nope", "--task"),
        ("max_new_tokens", 8, "--max-new-tokens"),
        ("device", "tpu", "--device"),
        ("entropy_coef", float("nan"), "--entropy-coef"),
    ],
)
def test_impossible_settings_are_refused_by_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        LabConfig(**{field: value})


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: .*no CUDA device"):
        LabConfig(device="cuda")


def test_defaults_are_valid():
    assert LabConfig().steps == 50


def test_entropy_coef_reaches_every_algorithm_unless_its_spec_sets_one():
    from pgloss.lab.trainer import make_algorithm

    assert make_algorithm(LabConfig(algorithm="grpo")).entropy_coef == 0.0  # none: the algorithm's own
    assert make_algorithm(LabConfig(algorithm="grpo", entropy_coef=0.01)).entropy_coef == 0.01
    assert make_algorithm(LabConfig(algorithm="sample_grpo", entropy_coef=0.01)).entropy_coef == 0.01
    spec = make_algorithm(LabConfig(algorithm="bnpo:entropy_coef=0.002", entropy_coef=0.01))
    assert spec.entropy_coef == 0.002  # the spec's own setting wins
    kl = make_algorithm(LabConfig(algorithm="grpo:kl_coef=0", entropy_coef=0.01))
    assert kl.kl_coef == 0 and kl.entropy_coef == 0.01
