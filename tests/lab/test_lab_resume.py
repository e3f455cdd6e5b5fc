"""``--resume`` continues an interrupted run from its last finished step and gives the result of a run never
stopped, bit for bit: in ``trainer.train`` (every random state restored), and as a user meets it, a real
``pgloss train`` / ``pgloss compare`` stopped by SIGTERM once a chosen step's line is in metrics.jsonl."""

import json
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from lab_helpers import CLI_TINY, PGLOSS, TINY, same_run, warm_cache  # noqa: F401 (autouse: a warm-start cache of each test's own)

from pgloss.lab import checkpoint
from pgloss.lab.config import LabConfig
from pgloss.lab.trainer import train

SMALL = ["--steps", "4", *CLI_TINY]


class Stop(Exception):
    pass


def test_train_from_a_checkpoint_is_the_run_never_stopped(tmp_path):
    """DAPO with refill rounds and a noisy sampler: every random stream of a run is in play."""
    cfg = LabConfig(
        algorithm="dapo",
        max_refill_rounds=1,
        sampler_noise=0.05,
        steps=4,
        warm_steps=3,
        prompts_per_step=4,
        group_size=4,
        eval_prompts=4,
        samples=2,
        **TINY,
    )
    whole = train(cfg)
    file = tmp_path / "ck.pt"

    def stop_at_2(record):
        if record["step"] == 2:  # the step's record is out, its checkpoint not yet saved: step 2 is made again
            raise Stop

    with pytest.raises(Stop):
        train(cfg, on_step=stop_at_2, checkpoint=file)
    assert checkpoint.step(file) == 1
    seen = []
    resumed = train(cfg, on_step=lambda r: seen.append(r["step"]), checkpoint=file)
    assert seen == [2, 3, 4] and same_run(whole, resumed)
    assert checkpoint.step(file) == 4  # the finished run's checkpoint holds its final policy
    with pytest.raises(ValueError, match=r"lr 0.0002 there, 0.001 here"):
        train(LabConfig(**{**cfg.__dict__, "lr": 1e-3}), checkpoint=file)


def test_a_run_steering_its_entropy_resumes_with_the_controller_as_it_was(tmp_path):
    """--target-entropy: the controller's coefficient and last entropy are in the checkpoint; a target
    above the run's entropy makes the coefficient grow at every optimizer step, so a resumed run that
    restarted it would log other coefficients."""
    cfg = LabConfig(
        algorithm="grpo",
        target_entropy=50.0,
        entropy_coef_delta=0.01,
        steps=3,
        warm_steps=3,
        prompts_per_step=4,
        group_size=4,
        eval_prompts=4,
        samples=2,
        **TINY,
    )
    whole = train(cfg)
    file = tmp_path / "ck.pt"

    def stop_at_2(record):
        if record["step"] == 2:
            raise Stop

    with pytest.raises(Stop):
        train(cfg, on_step=stop_at_2, checkpoint=file)
    resumed = train(cfg, checkpoint=file)
    assert [r["entropy_coef"] for r in resumed["metrics"]][1:3] == pytest.approx(
        [0.055, 0.095]
    )  # 4 optimizer steps each
    assert same_run(whole, resumed)


def _run(*args, timeout=240):
    return subprocess.run([PGLOSS, *args], capture_output=True, text=True, timeout=timeout)


def _stop_at(args, metrics: Path, line: str, seconds: float = 240) -> str:
    """Start ``pgloss ARGS``, wait for `line` in `metrics`, then SIGTERM it; it exits with 130. Its stderr."""
    proc = subprocess.Popen([PGLOSS, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and line in metrics.read_text():
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    return err


def _policies(out: Path) -> dict:
    return {f.name: checkpoint.load(f)["policy"] for f in sorted((out / "checkpoints").glob("*.pt"))}


def _same_policies(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n][k], b[n][k]) for n in a for k in a[n])


def test_a_train_stopped_by_sigterm_resumes_to_the_same_result(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert _run("train", *SMALL, "--out", str(whole)).returncode == 0
    err = _stop_at(["train", *SMALL, "--out", str(part)], part / "metrics.jsonl", '"step": 2,')
    assert json.loads((part / "config.json").read_text())["status"] == "interrupted"
    resume = err.strip().splitlines()[-1].split("; continue it with: ")[1]  # the command its last line gives
    assert resume == shlex.join(["pgloss", "train", *SMALL, "--out", str(part), "--resume"])
    done = _run(*shlex.split(resume)[1:])
    assert done.returncode == 0, done.stderr[-3000:]
    assert (part / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    assert (part / "samples.md").read_text() == (whole / "samples.md").read_text()
    assert _same_policies(_policies(part), _policies(whole))
    config = json.loads((part / "config.json").read_text())
    assert config["status"] == "finished" and config["resumed"][0].endswith("--resume")


def test_a_comparison_resumes_its_stopped_run_and_starts_the_one_not_begun(tmp_path):
    args = ["compare", "--algorithms", "grpo", "dr_grpo", "--seeds", "1", "--workers", "1", *SMALL]
    whole, part = tmp_path / "whole", tmp_path / "part"
    assert _run(*args, "--out", str(whole)).returncode == 0
    _stop_at([*args, "--out", str(part)], part / "metrics.jsonl", '"step": 2,')
    assert [p.name for p in (part / "checkpoints").glob("*.pt")] == ["grpo-seed0.pt"]
    done = _run(*args, "--out", str(part), "--resume")
    assert done.returncode == 0, done.stderr[-3000:]
    assert (part / "metrics.jsonl").read_bytes() == (whole / "metrics.jsonl").read_bytes()
    assert _same_policies(_policies(part), _policies(whole)) and len(_policies(part)) == 2


def test_resume_refuses_other_settings_a_finished_run_and_no_out(tmp_path):
    out = tmp_path / "run"
    _stop_at(["train", *SMALL, "--out", str(out)], out / "metrics.jsonl", '"step": 0,')
    other = _run("train", *SMALL, "--lr", "0.001", "--algorithm", "dapo", "--out", str(out), "--resume")
    assert other.returncode == 2 and other.stderr.count("\n") == 1
    assert "--algorithm 'grpo' there, 'dapo' here" in other.stderr and "--lr 0.0002 there, 0.001 here" in other.stderr
    assert "--algorithms ['grpo'] there, ['dapo'] here" in other.stderr
    assert _run("train", *SMALL, "--resume").stderr.startswith("pgloss train: --resume: give --out")
    assert _run("train", *SMALL, "--out", str(out), "--resume", "--overwrite").returncode == 2
    assert _run("train", *SMALL, "--out", str(out), "--resume").returncode == 0
    again = _run("train", *SMALL, "--out", str(out), "--resume")
    assert again.returncode == 2 and "is finished, nothing to continue" in again.stderr


def test_the_resume_command_is_the_run_s_own_with_out_and_resume(tmp_path):
    from pgloss.lab.resume import resume_command

    out = tmp_path / "my runs"
    line = "pgloss compare --algorithms grpo dapo --steps 30 --overwrite --out=elsewhere --seeds 2"
    assert resume_command({"command": line}, out) == (
        f"pgloss compare --algorithms grpo dapo --steps 30 --seeds 2 --out '{out}' --resume"
    )
    assert resume_command({"command": "pgloss train --out a --resume --steps 5"}, out) == (
        f"pgloss train --steps 5 --out '{out}' --resume"
    )
    assert resume_command({"command": "pgloss train", "world_size": 2}, out) is None  # torchrun keeps no checkpoint
