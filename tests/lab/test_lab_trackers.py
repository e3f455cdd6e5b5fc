"""``--report-to``: the metrics of metrics.jsonl and the run's settings, read back from TensorBoard's event files
and from what a stand-in ``wandb`` module was given; a missing package is one line and exit status 2. The trained
policy is saved as safetensors, and ``pgloss grads --policy`` samples its batch with it."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from lab_helpers import CLI_TINY, PGLOSS, warm_cache  # noqa: F401 (autouse: a warm-start cache of each test's own)

from pgloss import cli
from pgloss.lab import policy

SMALL = ["--steps", "2", *CLI_TINY]


def _records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in ("algorithm", "seed", "step") and v is not None}


def test_tensorboard_holds_the_metrics_and_the_settings(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    out = tmp_path / "run"
    done = subprocess.run(
        [
            PGLOSS,
            "train",
            "--algorithm",
            "dapo:clip_high=0.3",
            *SMALL,
            "--lr",
            "0.001",
            "--report-to",
            "tensorboard",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    events = EventAccumulator(str(out / "tensorboard" / "dapo_clip_high=0.3-seed0"))
    events.Reload()
    records = _records(out)
    assert set(events.Tags()["scalars"]) == {k for r in records for k in _numbers(r)}
    for record in records:
        for metric, value in _numbers(record).items():
            logged = {e.step: e.value for e in events.Scalars(metric)}
            assert logged[record["step"]] == pytest.approx(value, rel=1e-6), (metric, record["step"])
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    ).session_start_info.hparams
    assert start["lr"].number_value == 0.001 and start["algorithm"].string_value == "dapo:clip_high=0.3"
    assert start["entropy_coef"].string_value == "none" and start["steps"].number_value == 2


def test_a_missing_tracker_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    for name, hint in (("tensorboard", "pip install tensorboard"), ("wandb", "pip install wandb")):
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as when it is not installed
        assert cli.main(["train", *SMALL, "--report-to", name, "--out", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"pgloss train: --report-to {name}: ") and hint in err and err.count("\n") == 1
        assert not (tmp_path / name).exists()  # refused before anything is written
    assert cli.main(["compare", *SMALL, "--report-to", "mlflow", "--out", str(tmp_path / "m")]) == 2
    assert "--report-to: unknown 'mlflow'; choose from tensorboard, wandb, none" in capsys.readouterr().err


FAKE_WANDB = textwrap.dedent('''
    """A stand-in for wandb: every call is appended to $FAKE_WANDB_LOG as one JSON line."""
    import json, os

    def _note(**entry):
        with open(os.environ["FAKE_WANDB_LOG"], "a") as f:
            f.write(json.dumps(entry) + "\\n")

    class Run:
        def __init__(self, name):
            self.name = name
        def log(self, values, step=None):
            _note(call="log", run=self.name, values=values, step=step)
        def finish(self):
            _note(call="finish", run=self.name)

    def init(**kwargs):
        _note(call="init", **kwargs)
        return Run(kwargs["name"])
''')


def test_wandb_logs_each_run_offline_with_its_settings(tmp_path):
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "wandb.py").write_text(FAKE_WANDB)
    log, out = tmp_path / "wandb.jsonl", tmp_path / "run"
    env = {**__import__("os").environ, "FAKE_WANDB_LOG": str(log)}
    env["PYTHONPATH"] = str(tmp_path / "fake") + ":" + env.get("PYTHONPATH", "")
    env.pop("WANDB_MODE", None)
    done = subprocess.run(
        [
            PGLOSS,
            "compare",
            "--algorithms",
            "grpo",
            "dr_grpo",
            "--seeds",
            "1",
            "--workers",
            "1",
            *SMALL,
            "--report-to",
            "wandb",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    inits = {c["name"]: c for c in calls if c["call"] == "init"}
    assert set(inits) == {"grpo-seed0", "dr_grpo-seed0"}
    assert all(c["mode"] == "offline" and c["dir"] == str(out) for c in inits.values())
    assert inits["dr_grpo-seed0"]["config"]["algorithm"] == "dr_grpo" and inits["grpo-seed0"]["config"]["lr"] == 2e-4
    for record in _records(out):
        name = f"{record['algorithm']}-seed0"
        [logged] = [c for c in calls if c["call"] == "log" and c["run"] == name and c["step"] == record["step"]]
        assert logged["values"] == _numbers(record)
    assert sorted(c["run"] for c in calls if c["call"] == "finish") == ["dr_grpo-seed0", "grpo-seed0"]


def test_the_trained_policy_is_saved_and_grads_samples_with_it(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["train", *SMALL, "--out", str(out)]) == 0
    cfg, model = policy.load(out)
    final = torch.load(out / "checkpoints" / "grpo-seed0.pt", weights_only=True)["policy"]
    assert cfg.d_model == 16 and cfg.steps == 2
    assert all(torch.equal(model.state_dict()[k], final[k]) for k in final)  # the policy the run ended with
    batch = policy.batch(out, prompts=3, seed=5)
    assert batch["log_prob"].shape[0] == 3 * cfg.group_size and torch.equal(batch["log_prob"], batch["old_log_prob"])
    assert (batch["log_prob"][batch["mask"]] <= 0).all() and set(batch["group_ids"].tolist()) == {0, 1, 2}
    figure = tmp_path / "grads.png"
    assert (
        cli.main(["grads", "--policy", str(out), "--prompts", "3", "--algorithms", "grpo", "--out", str(figure)]) == 0
    )
    assert figure.read_bytes()[:4] == b"\x89PNG"
    assert cli.main(["grads", "--policy", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
