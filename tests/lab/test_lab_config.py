"""LabConfig refuses impossible settings before any training, naming the flag."""

import pytest
import torch

from pgloss.lab.config import LabConfig


@pytest.mark.parametrize("field, value, flag", [
    ("steps", 0, "--steps"), ("group_size", 1, "--group-size"), ("temperature", 0.0, "--temperature"),
    ("minibatches", 40, "--minibatches"), ("d_model", 30, "--d-model"), ("scratchpad_prob", 1.5, "--scratchpad-prob"),
    ("samples", 100, "--samples"), ("lr", float("nan"), "--lr"), ("task", "nope", "--task"),
    ("max_new_tokens", 8, "--max-new-tokens"), ("device", "tpu", "--device"),
])
def test_impossible_settings_are_refused_by_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        LabConfig(**{field: value})


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device cuda: .*no CUDA device"):
        LabConfig(device="cuda")


def test_defaults_are_valid():
    assert LabConfig().steps == 50
