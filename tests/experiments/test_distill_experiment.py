"""The distillation experiment (`pgloss experiment distill`): its runs, its resumption and its report."""

import dataclasses
import json
import math

import pytest
import torch

from pgloss.cli import main
from pgloss.experiments import distill
from pgloss.experiments.claims import run_mean, verdict
from pgloss.experiments.distill_report import CLAIMS, steps_to_teacher, summary_rows, teacher_reward
from pgloss.experiments.runs import load

SMALL = dict(prompts_per_step=2, group_size=2, warm_steps=3, warm_batch=4, d_model=16, eval_prompts=2)


def test_each_run_is_a_lab_config_of_its_own():
    e = distill.DistillExperiment(**SMALL)
    teacher, grpo, opd, both = (e.lab_config(label, 1) for label in ("teacher", "grpo", "opd", "opd+reward"))
    assert (teacher.algorithm, teacher.reward_coef, teacher.steps) == ("grpo", 1.0, e.teacher_steps)
    assert (grpo.algorithm, grpo.reward_coef, grpo.steps) == ("grpo", 1.0, e.steps)
    assert (opd.algorithm, opd.reward_coef) == ("opd", 0.0) and (both.algorithm, both.reward_coef) == ("opd", 1.0)
    assert {c.seed for c in (teacher, grpo, opd, both)} == {1} and {c.d_model for c in (teacher, opd)} == {16}
    assert distill.quick(e) == dataclasses.replace(e, seeds=2, teacher_steps=12, steps=8)
    with pytest.raises(ValueError, match="students: unknown 'kd'"):
        distill.DistillExperiment(students=("grpo", "kd"))
    with pytest.raises(ValueError, match="--teacher-steps must be an int >= 1"):
        distill.DistillExperiment(teacher_steps=0)


def _records(rewards, kl=None, label="opd", seed=0):
    return [
        {
            "algorithm": label,
            "seed": seed,
            "step": k,
            "reward": r,
            "accuracy": r,
            "kl_teacher": None if kl is None else kl[k],
        }
        for k, r in enumerate(rewards)
    ]


def test_steps_to_the_teacher_read_the_smoothed_reward_against_the_teachers_end():
    runs = {("teacher", 0): _records([0.2, 0.4, 0.6, 0.7, 0.8, 0.84], label="teacher")}
    assert teacher_reward(runs, 0, window=3) == pytest.approx(0.78)
    assert math.isnan(teacher_reward(runs, 1, window=3))
    climbing = _records([0.2, 0.5, 0.8, 0.8, 0.8, 0.8, 0.8])
    # centred 5-step means: step 0 -> (0.2+0.5+0.8)/3 = 0.5, step 1 -> 0.575, step 2 -> 0.62, step 3 -> 0.74, step 4 -> 0.8
    assert steps_to_teacher(climbing, 0.78) == 4 and steps_to_teacher(climbing, 0.6) == 2
    assert steps_to_teacher(climbing, 0.9) is None
    (row,) = summary_rows({**runs, ("opd", 0): climbing}, ["opd"], window=3)
    assert row["reached"] == [4] and row["reward"][0][0] == pytest.approx(0.2)


def test_the_claims_compare_students_paired_by_seed():
    kl_fast, kl_slow = [0.5, 0.1, 0.05, 0.05], [0.5, 0.4, 0.3, 0.2]
    runs = {}
    for seed in range(3):
        shift = 0.01 * seed
        runs[("opd", seed)] = _records([0.3, 0.6, 0.7, 0.7], [k + shift for k in kl_fast], "opd", seed)
        runs[("grpo", seed)] = _records([0.3, 0.4, 0.5, 0.6], [k + shift for k in kl_slow], "grpo", seed)
    kl_claim, reward_claim = CLAIMS[0], CLAIMS[1]
    kl = verdict(kl_claim, runs, window=1, measure=run_mean)
    # run_mean: mean over steps 1-3 minus step 0; the same warm start, so the difference is of the means
    assert kl["mean"] == pytest.approx((0.2 / 3) - 0.3) and kl["verdict"] == "reproduced"
    assert verdict(reward_claim, runs, window=1, measure=run_mean)["verdict"] == "reproduced"
    assert verdict(CLAIMS[2], runs, window=1, measure=run_mean) is None  # no opd+reward run


def test_a_reduced_experiment_runs_resumes_and_reports(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(distill, "DESIGN", distill.DistillExperiment(**SMALL))
    out = tmp_path / "d"
    args = ["experiment", "distill", "--quick", "--teacher-steps", "3", "--steps", "2", "--out", str(out)]
    assert main(args) == 0
    runs = load(out)
    labels = ("teacher", "grpo", "opd", "opd+reward", "iw_opd")
    assert set(runs) == {(label, s) for label in labels for s in range(2)}
    assert [len(runs[(label, 0)]) for label in labels] == [4, 3, 3, 3, 3]
    for seed in range(2):
        teacher = torch.load(distill.teacher_path(out, seed))
        assert teacher.keys() and all(torch.isfinite(v).all() for v in teacher.values())
        # every student of a seed starts from its warm start on the same prompts and samples: step 0 is shared
        starts = {
            json.dumps({k: runs[(label, seed)][0][k] for k in ("reward", "length", "entropy", "kl_teacher")})
            for label in labels[1:]
        }
        assert len(starts) == 1
        assert all(r["kl_teacher"] >= 0 for label in labels[1:] for r in runs[(label, seed)])
    text = (out / "report.md").read_text()
    assert (
        "| opd+reward | 2 |" in text and "steps to the teacher's reward" in text and "A check run, not a result" in text
    )
    assert "On-Policy Distillation (Thinking Machines Lab, 2025)" in text and "(would read: " in text
    assert "kl_teacher(iw_opd) - kl_teacher(opd) < 0" in text
    assert (out / "distill.png").stat().st_size > 10_000
    assert json.loads((out / "experiment.json").read_text())["status"] == "finished"

    # resumed: complete runs and teachers are kept, a missing student is trained again
    kept = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.jsonl")}
    teacher_time = distill.teacher_path(out, 1).stat().st_mtime_ns
    (out / "runs" / "opd-1.jsonl").unlink()
    assert main(args) == 0
    again = {p.name: p.stat().st_mtime_ns for p in (out / "runs").glob("*.jsonl")}
    assert set(again) == set(kept) and all(again[n] == kept[n] for n in kept if n != "opd-1.jsonl")
    assert distill.teacher_path(out, 1).stat().st_mtime_ns == teacher_time
    assert load(out)[("opd", 1)] == runs[("opd", 1)]  # deterministic: the same run again
    capsys.readouterr()


def test_a_wider_teacher_runs_from_its_own_warm_start(tmp_path, monkeypatch, capsys):
    e = distill.DistillExperiment(**SMALL, teacher_d_model=24)
    assert [c.d_model for c in e.warm_configs(0)] == [24, 16]
    wide = distill.DistillExperiment(teacher_d_model=192)  # twice the students' width: half their warm-up rate
    assert (wide.lab_config("teacher", 0).warm_lr, wide.lab_config("opd", 0).warm_lr) == (1.5e-3, 3e-3)
    assert distill.DistillExperiment().lab_config("teacher", 0).warm_lr == 3e-3  # the lab's own, bit for bit
    assert [c.d_model for c in distill.DistillExperiment(**SMALL).warm_configs(0)] == [16]
    with pytest.raises(ValueError, match="--d-model must be >= 1 and a multiple of --n-head"):
        distill.DistillExperiment(**SMALL, teacher_d_model=25)
    monkeypatch.setattr(distill, "DESIGN", distill.DistillExperiment(**SMALL))
    out = tmp_path / "w"
    assert (
        main(
            [
                "experiment",
                "distill",
                "--quick",
                "--seeds",
                "1",
                "--teacher-steps",
                "2",
                "--steps",
                "1",
                "--students",
                "opd",
                "--teacher-d-model",
                "24",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    teacher = torch.load(distill.teacher_path(out, 0))
    assert teacher["tok.weight"].shape[1] == 24
    assert len(list((out / "warm").iterdir())) == 2  # the teacher's warm start and the students'
    assert all(r["kl_teacher"] > 0 for r in load(out)[("opd", 0)])
    assert (
        "The teacher is GRPO from a warm start of its own, 24 wide (the students 16)" in (out / "report.md").read_text()
    )
    capsys.readouterr()


def test_options_of_the_other_experiment_are_refused(tmp_path, capsys):
    assert main(["experiment", "distill", "--task", "chain", "--out", str(tmp_path / "x")]) == 2
    assert "--task is an option of another experiment, not of distill" in capsys.readouterr().err
    assert main(["experiment", "length", "--teacher-steps", "3", "--out", str(tmp_path / "y")]) == 2
    assert "--teacher-steps is an option of another experiment, not of length" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()
