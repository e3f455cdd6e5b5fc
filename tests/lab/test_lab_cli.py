"""``pgloss compare`` end to end, run as a user runs it, on a tiny model and a few steps."""

import json
import subprocess
import sys
from pathlib import Path

PGLOSS = str(Path(sys.executable).parent / "pgloss")


def test_compare_writes_metrics_plots_samples_report_and_config(tmp_path):
    out = tmp_path / "run"
    cmd = [PGLOSS, "compare", "--algorithms", "grpo,sample_grpo", "--steps", "2", "--seeds", "2", "--workers", "1",
           "--warm-steps", "5", "--d-model", "16", "--n-layer", "1", "--n-head", "2", "--prompts-per-step", "4",
           "--group-size", "4", "--eval-prompts", "4", "--samples", "2", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 2 * 3  # algorithms x seeds x (steps + final measurement)
    keys = {"algorithm", "seed", "step", "reward", "accuracy", "length", "entropy", "kl_ref", "clip_frac", "ppo_kl",
            "grad_norm"}
    assert all(keys <= set(r) for r in records)
    assert {(r["algorithm"], r["seed"]) for r in records} == {(a, s) for a in ("grpo", "sample_grpo") for s in (0, 1)}
    for name in ("reward", "length", "entropy", "clip_frac", "curves"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    report = (out / "report.md").read_text()
    assert "| grpo |" in report and "| sample_grpo |" in report and "![reward](reward.png)" in report
    assert "OpenR1 in practice (6)" in report and "clip fraction" in report
    assert "## grpo, seed 1" in (out / "samples.md").read_text()
    config = json.loads((out / "config.json").read_text())
    assert config["base"]["steps"] == 2 and config["algorithms"] == ["grpo", "sample_grpo"]
    assert config["command"].startswith("pgloss compare")


def test_unknown_algorithm_fails_before_training(tmp_path):
    done = subprocess.run([PGLOSS, "compare", "--algorithms", "grpo,nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "nope" in done.stderr
