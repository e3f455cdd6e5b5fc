"""pgloss's losses inside ms-swift 4.6.0's own GRPOTrainer (on its TRL 0.29): a tiny Qwen2 built in code, CPU.

These tests run in the ms-swift environment (`make test` builds it beside the TRL 1.16 one and runs them from
tests/integrations/test_swift_env.py); elsewhere they skip."""

import pytest

pytest.importorskip("swift.rlhf_trainers")

import copy
from pathlib import Path

import swift_window as sw
import torch

import pgloss
from pgloss.integrations.swift import PGLossSwiftGRPOTrainer


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """ms-swift's pipeline built once (loss_type names a pgloss loss: the plugin's route), with a reference model
    (beta = 0.04, ms-swift's GRPO default), and one off-policy generation with rollout log-probs."""
    root = tmp_path_factory.mktemp("swift")
    args = sw.arguments(root, beta=0.04, loss_type="pgloss:dapo")
    trainer = sw.build_trainer(args, PGLossSwiftGRPOTrainer)
    initial = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    batches = sw.off_policy(trainer, rollout=True)
    return trainer, initial, batches


FUSED = ("grpo", "dapo", "gspo", "clip_cov", "cispo", "vespo", "real", "chord")
"""The fused path on a spread of families (every name through it costs about a minute on the CPU; every name's
fused loss is pgloss's own tests' concern, the adapter's wiring is this one)."""


def names(fused: bool) -> list[str]:
    return list(FUSED) if fused else pgloss.names()


@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_step_gradient_is_one_call_for_every_name(built, fused):
    """For every name: one optimizer step (GA = 2) of ms-swift's trainer, through its own training_step, applies
    the gradient of one plain pgloss call on the step's micro-batches (off-policy, with a KL term and rollout
    log-probs); the logged metrics are that call's. Names that need an input ms-swift has not are refused."""
    trainer, initial, batches = built
    trainer.fused = fused
    model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
    checked, refused = [], []
    for number, name in enumerate(names(fused)):
        model.load_state_dict(initial)
        try:
            algorithm = sw.named_algorithm(trainer.args, name)
        except ValueError as error:
            refused.append((name, str(error)))
            continue
        if algorithm.needs - {"ref_log_prob", "entropy", "rollout_log_prob", "group_ids", "scores"}:
            config = copy.copy(trainer.args)
            config.loss_type = "grpo"
            with pytest.raises(ValueError, match=f"cannot honour: {name}, which needs"):
                PGLossSwiftGRPOTrainer(args=config, algorithm=algorithm)
            refused.append((name, "needs"))
            continue
        grads, logged = sw.drive_step(trainer, algorithm, batches, number + 1)
        reference, metrics = sw.window_gradient(model, sw.records(trainer, batches), algorithm, trainer.temperature)
        error = sw.relative_error(grads, reference)
        assert sum(float(g.norm()) for g in reference.values()) > 0, name
        assert error < 2e-5, (name, error)
        for key, value in metrics.items():
            assert logged[f"pgloss/{key}"] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (name, key)
        checked.append(f"{name} {error:.1e}")
    print(f"fused={fused}: {len(checked)} names checked; refused: {refused}")
    assert len(checked) >= len(names(fused)) - 2, refused
