"""``pgloss compare`` and ``pgloss train`` as a user runs them: tiny models, a few steps."""

import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
from lab_helpers import CLI_TINY, PGLOSS, warm_cache  # noqa: F401 (autouse: a warm-start cache of each test's own)

from pgloss import cli
from pgloss.lab import trainer


def test_compare_writes_metrics_plots_samples_report_and_config(tmp_path):
    out = tmp_path / "run"
    cmd = [
        PGLOSS,
        "compare",
        "--algorithms",
        "grpo,sample_grpo",
        "gspo:clip_high=0.001",
        "--steps",
        "2",
        "--seeds",
        "2",
        "--workers",
        "1",
        *CLI_TINY,
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    labels = ("grpo", "sample_grpo", "gspo:clip_high=0.001")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 * 2 * 3  # algorithms x seeds x (steps + final measurement)
    keys = {
        "algorithm",
        "seed",
        "step",
        "reward",
        "accuracy",
        "length",
        "entropy",
        "kl_ref",
        "clip_frac",
        "clip_frac_high",
        "clip_frac_low",
        "ppo_kl",
        "grad_norm",
        "grad_clipped",
        "kept",
    }
    assert all(keys <= set(r) for r in records)
    assert {(r["algorithm"], r["seed"]) for r in records} == {(a, s) for a in labels for s in (0, 1)}
    for name in ("reward", "length", "entropy", "clip_frac", "kl_ref", "ppo_kl", "grad_norm", "kept", "curves"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    report = (out / "report.md").read_text()
    assert all(f"| {a} |" in report for a in labels) and "![ppo_kl](ppo_kl.png)" in report
    assert "| KL to ref.: last 2 steps |" in report and "last 5" not in report  # the window a 2-step run has
    assert report.startswith("# pgloss lab: comparison")
    assert "mean over every update" in report and "OpenR1 in practice (6)" in report
    assert "seed 00" not in report.lower()
    assert "## grpo, seed 1" in (out / "samples.md").read_text()
    assert "Simulated sampler mismatch" not in report and not (out / "rollout_kl.png").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["base"]["steps"] == 2 and config["algorithms"] == list(labels) and config["status"] == "finished"
    assert config["versions"]["torch"] == torch.__version__ and config["versions"]["pgloss"]
    assert config["command"].startswith("pgloss compare")


def test_a_simulated_mismatch_shows_in_the_report_and_plots(tmp_path):
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compare",
                "--algorithms",
                "grpo",
                "--steps",
                "2",
                "--seeds",
                "1",
                "--workers",
                "1",
                *CLI_TINY,
                "--sampler-noise",
                "0.1",
                "--rollout-correction",
                "token:upper=2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rollout_k3_kl"] > 0 and 0 < r["rollout_is_ess"] < 1 for r in records[:-1])
    report = (out / "report.md").read_text()
    assert "Simulated sampler mismatch (relative weight noise 0.1), rollout correction `token:upper=2`" in report
    assert "![rollout_kl](rollout_kl.png)" in report and "![rollout_is_ess](rollout_is_ess.png)" in report
    assert (out / "rollout_kl.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["compare", "--steps", "0"], "--steps must be >= 1"),
        (["compare", "--seeds", "0"], "--seeds must be >= 1"),
        (["compare", "--workers", "0"], "--workers must be >= 1"),
        (["compare", "--algorithms", "grpo,nope"], "unknown algorithm 'nope'"),
        (
            ["compare", "--algorithms", "dapo:clip_hihg=0.3"],
            "no hyperparameter 'clip_hihg' \\(did you mean 'clip_high'\\?\\); valid: .*clip_high",
        ),
        (["compare", "--algorithms", "grpo", "sapo", "--loss-arg", "clip_high=0.3"], "sapo:clip_high=0.3: sapo has no"),
        (["compare", "--max-new-tokens", "5"], "--max-new-tokens must be >= 12"),
        (["train", "--algorithm", "grpo,dapo"], "train runs one algorithm"),
        (["compare", "--rollout-correction", "tokn"], "--rollout-correction 'tokn': the level must be"),
        (["train", "--algorithm", "vespo", "--rollout-correction", "token"], "vespo: .*takes no rollout_correction"),
        (["compare", "--sampler-temperature", "-1"], "--sampler-temperature must be > 0"),
    ],
)
def test_bad_arguments_fail_at_once_naming_the_argument(argv, message, tmp_path, capsys):
    start = time.time()
    assert cli.main([*argv, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and re.search(message, err), err
    assert time.time() - start < 10 and not (tmp_path / "out").exists()  # nothing trained, nothing written


def test_out_that_is_a_file_and_cuda_without_a_gpu_fail_at_once(tmp_path, capsys, monkeypatch):
    path = tmp_path / "file"
    path.write_text("x")
    assert cli.main(["compare", "--out", str(path)]) == 2
    assert "--out" in capsys.readouterr().err and path.read_text() == "x"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["compare", "--device", "cuda", "--out", str(tmp_path / "o")]) == 2
    assert "--device cuda" in capsys.readouterr().err


def test_a_failing_run_keeps_the_others(tmp_path, monkeypatch, capsys):
    real = trainer.train

    def flaky(cfg, warm_state=None, on_step=None, **kwargs):
        if not cfg.algorithm.startswith("dapo"):
            return real(cfg, warm_state, on_step, **kwargs)

        def fail_after_first(record):
            on_step(record)
            raise RuntimeError("boom after one step")

        return real(cfg, warm_state, fail_after_first, **kwargs)

    monkeypatch.setattr(trainer, "train", flaky)
    out = tmp_path / "run"
    assert (
        cli.main(
            [
                "compare",
                "--algorithms",
                "grpo",
                "dapo",
                "--steps",
                "2",
                "--seeds",
                "1",
                "--workers",
                "1",
                *CLI_TINY,
                "--out",
                str(out),
            ]
        )
        == 1
    )
    assert "failed: dapo seed 0" in capsys.readouterr().out
    report = (out / "report.md").read_text()
    assert "| grpo |" in report and "| dapo |" not in report
    assert "- dapo, seed 0: failed after 1 of 2 steps: RuntimeError: boom after one step" in report
    assert "RuntimeError: boom after one step" in (out / "errors.log").read_text()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sorted((r["algorithm"], r["step"]) for r in records) == [("dapo", 0), ("grpo", 0), ("grpo", 1), ("grpo", 2)]
    assert (out / "reward.png").exists()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_and_sigterm_stop_within_seconds_and_write_what_finished(tmp_path, sig):
    """Ctrl-C in a terminal and `timeout`/a scheduler (SIGTERM to the process group) end a run alike."""
    out = tmp_path / "run"
    cmd = [
        PGLOSS,
        "compare",
        "--algorithms",
        "grpo",
        "dapo",
        "gspo",
        "cispo",
        "sapo",
        "--steps",
        "30",
        "--seeds",
        "1",
        "--workers",
        "2",
        *CLI_TINY,
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:  # until the first run has made its last step
        if metrics.exists() and any(json.loads(line)["step"] == 30 for line in metrics.read_text().splitlines()):
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    time.sleep(0.5)
    os.killpg(proc.pid, sig)  # what Ctrl-C in a terminal, and timeout, do: signal the whole process group
    sent = time.time()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.time() - sent < 30, err[-3000:]
    assert "Traceback" not in err and "leaked semaphore" not in err
    ours = [line for line in err.splitlines() if line.startswith("pgloss compare")]
    assert len(ours) == 1 and re.match(r"pgloss compare: interrupted; [12] of 5 runs finished", ours[0]), err[-3000:]
    resume = f"pgloss compare {' '.join(cmd[2:-2])} --out {out} --resume"  # the command line, continued
    assert ours[0].endswith(f"; continue it with: {resume}"), ours[0]
    report = (out / "report.md").read_text()
    assert "was interrupted" in report and ": interrupted after" in report and ": not started" in report
    assert f"Continue it, each run from its last checkpoint: `{resume}`" in report
    finished = {
        r["algorithm"] for r in json.loads((out / "config.json").read_text())["runs"] if r["status"] == "finished"
    }
    assert all(f"| {a} |" in report for a in finished)
    assert (out / "reward.png").stat().st_size > 5000 and (out / "samples.md").exists()
    assert json.loads((out / "config.json").read_text())["status"] == "interrupted"


def test_help_lists_every_command():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0]
    text = parser.format_help()
    for action in commands._choices_actions:
        assert action.dest in text and action.help
    assert {"list", "losses", "train", "compare"} <= set(commands.choices)


def test_list_shows_no_made_up_norm_constant_for_dr_grpo(capsys):
    assert cli.main(["list"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("dr_grpo"))
    assert "norm_constant required" in row and "norm_constant=" not in row


def test_sigterm_to_train_alone_records_what_it_made(tmp_path):
    """`docker stop` signals the main process only: train ends as on Ctrl-C, its status recorded."""
    out = tmp_path / "run"
    cmd = [PGLOSS, "train", "--algorithms", "grpo", "--steps", "200", *CLI_TINY, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:  # until two steps are written
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert re.search(r"pgloss train: interrupted; 0 of 1 runs finished", err), err[-3000:]
    assert err.strip().splitlines()[-1].endswith(f"--out {out} --resume"), err[-3000:]
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "interrupted" and config["runs"][0]["status"] == "interrupted"
    assert config["runs"][0]["steps_done"] >= 2
    report = (out / "report.md").read_text()
    assert report.startswith("# pgloss lab: training run") and "This training run was interrupted" in report
