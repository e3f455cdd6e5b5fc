"""The shipped warm starts: the default comparison starts from the same weights on every machine."""

import hashlib
import json

import pytest
from lab_helpers import warm_cache  # noqa: F401 (autouse: a warm-start cache of each test's own)

from pgloss.lab import trainer, warm
from pgloss.lab.config import LabConfig

MANIFEST = json.loads((warm.SHIPPED / "manifest.json").read_text())


def test_every_seed_is_shipped_with_the_defaults_settings_and_its_checksum():
    assert MANIFEST["settings"] == warm.settings(LabConfig())
    assert sorted(MANIFEST["seeds"], key=int) == [str(s) for s in warm.SHIPPED_SEEDS]
    for seed in warm.SHIPPED_SEEDS:
        file = warm.shipped(LabConfig(seed=seed))
        assert (
            file is not None and hashlib.sha256(file.read_bytes()).hexdigest() == MANIFEST["seeds"][str(seed)]["sha256"]
        )


@pytest.mark.parametrize(
    "change",
    [
        dict(seed=len(warm.SHIPPED_SEEDS)),
        dict(warm_steps=1499),
        dict(d_model=64),
        dict(task="sum"),
        dict(max_new_tokens=30),
        dict(scratchpad_prob=0.4),
    ],
)
def test_another_warm_start_setting_is_trained_not_shipped(change):
    assert warm.shipped(LabConfig(**change)) is None
    assert not warm.cached(LabConfig(**change), None)


@pytest.mark.parametrize(
    "change", [dict(algorithm="dapo", steps=3, lr=1e-3), dict(threads=2, eval_prompts=8, samples=2)]
)
def test_what_the_warm_start_does_not_read_keeps_it_shipped(change):
    assert warm.shipped(LabConfig(**change)) == warm.shipped(LabConfig())


def test_the_shipped_warm_start_is_loaded_not_trained(monkeypatch):
    def untrained(*args, **kwargs):
        raise AssertionError("the warm start was trained")

    monkeypatch.setattr(trainer, "warm_start", untrained)
    cfg = LabConfig(seed=1)
    assert warm.cached(cfg, None)
    state = warm.state(cfg, None)
    tokenizer, task, model = trainer.build(cfg)
    model.load_state_dict(state)  # strict: every tensor of the model, no other
    assert warm.origin([cfg, LabConfig(seed=0)]).startswith("shipped with pgloss (trained on ")
    assert warm.origin([cfg, LabConfig(seed=99)]).startswith("shipped with pgloss for the seeds it ships")
    assert warm.origin([LabConfig(warm_steps=3)]) == "trained on this machine"


def test_the_shipped_policy_answers_as_its_manifest_says():
    """The eval reward of the shipped seed-0 policy (512 samples): equal where it was trained, within a
    rare flipped sample on a CPU that rounds otherwise."""
    cfg = LabConfig(seed=0)
    tokenizer, task, model = trainer.build(cfg)
    model.load_state_dict(warm.state(cfg, None))
    reward = float(trainer.sampled_reward(model, trainer.eval_problems(task, cfg), tokenizer, cfg))
    assert reward == pytest.approx(MANIFEST["seeds"]["0"]["eval_reward"], abs=0.01)


def test_a_run_from_the_defaults_records_its_shipped_warm_start(tmp_path):
    from pgloss import cli

    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "train",
                "--steps",
                "1",
                "--prompts-per-step",
                "2",
                "--eval-prompts",
                "4",
                "--samples",
                "1",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    config = json.loads((out / "config.json").read_text())
    assert config["warm_start"].startswith("shipped with pgloss") and config["versions"]["machine"]
    assert "warm starts shipped with pgloss" in (out / "report.md").read_text()
