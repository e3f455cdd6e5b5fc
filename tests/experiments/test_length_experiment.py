"""The length experiment: its measures, its statistics and verdicts, and a reduced run end to end."""

import dataclasses
import json
import math
import random

import pytest
import torch

import pgloss
from pgloss.cli import main
from pgloss.experiments import length, length_report
from pgloss.experiments.claims import Claim, growth, interval, run_mean, verdict
from pgloss.experiments.length_report import CLAIMS, write_report
from pgloss.experiments.runs import load
from pgloss.lab.grads import gradient_table, load_batch
from pgloss.lab.tasks import TraceTask, demonstration, make_task, reward


def test_trace_task_leaves_length_free():
    task = make_task("trace")
    rng = random.Random(0)
    problems = [task.sample(rng) for _ in range(200)]
    lengths = {len(demonstration(p, True)) for p in problems}
    assert min(lengths) == 3 and max(lengths) >= 30  # "d|a" up to a 16-item trace and "|ab"
    p = problems[0]
    a, b = map(int, p.prompt[:-1].split("*"))
    assert p.answer == str(a * b)
    for trace in ("", "1", "9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9,9"):
        assert reward(f"{trace}|{p.answer}", p) == 1.0  # any trace, any length
    assert reward(f"{p.answer}|", p) == 0.0
    assert task.max_response_chars + 1 == 35
    with pytest.raises(ValueError, match="max_trace_items"):
        TraceTask(0)


def test_repeated_ngrams():
    assert length.repeated_ngrams(["abcdabcd"], 4) == pytest.approx(1 - 4 / 5)  # abcd bcda cdab dabc abcd
    assert length.repeated_ngrams(["1,2,3", "aaaaaa"], 4) == pytest.approx(1 - (2 + 1) / (2 + 3))
    assert math.isnan(length.repeated_ngrams(["abc", ""], 4))
    with pytest.raises(ValueError, match="n: need >= 1"):
        length.repeated_ngrams(["a"], 0)


def test_response_lengths_count_the_end_token_and_cut_offs():
    assert length.response_lengths(["", "12|4", "x" * 10], 10).tolist() == [1.0, 5.0, 10.0]


@pytest.mark.parametrize("name", ["grpo", "bnpo", "dr_grpo", "sample_grpo", "gspo", "dapo"])
def test_gradient_weights_at_ratio_one_are_the_closed_forms(name):
    cfg = length.LengthExperiment(algorithms=(name,)).lab_config(name, 0)
    from pgloss.lab.trainer import make_algorithm

    algorithm = make_algorithm(cfg)
    rewards = torch.tensor([1, 0, 0, 1, 1, 1, 1, 1, 0, 1, 0, 0], dtype=torch.float64)  # last group: all 0
    rewards[8:] = 0
    lengths = torch.tensor([4, 9, 30, 12, 5, 5, 7, 40, 3, 3, 8, 8], dtype=torch.float64)
    got = length.gradient_weights(algorithm, rewards, lengths, group_size=4)
    ids = torch.arange(12) // 4
    adv = pgloss.advantages.group_advantages(rewards, ids, scale=pgloss.recipe(algorithm.name).scale_rewards).double()
    keep = torch.ones(12, dtype=torch.bool)
    if pgloss.recipe(algorithm.name).dynamic_sampling:  # DAPO drops the groups whose rewards are all equal
        keep = pgloss.advantages.dynamic_sampling_keep(rewards, ids)
    n, n_tok = float(keep.sum()), float(lengths[keep].sum())
    expected = {
        "grpo": -adv / lengths,
        "gspo": -adv / lengths,
        "bnpo": -adv * n / n_tok,
        "dapo": -adv * n / n_tok,
        "dr_grpo": -adv / cfg.max_new_tokens,
        "sample_grpo": -adv,
    }[name]
    torch.testing.assert_close(got[keep], expected[keep])
    assert got[~keep].isnan().all()


def test_interval_is_the_student_t_interval():
    mean, half = interval([1.0, 2.0, 3.0, None, float("nan")])
    assert mean == 2.0 and half == pytest.approx(4.303 * 1.0 / math.sqrt(3))
    assert math.isnan(interval([5.0])[1]) and math.isnan(interval([])[0])


def _runs(deltas_a, deltas_b, key="length", a="sample_grpo", b="grpo", steps=4):
    """Synthetic runs whose `key` rises linearly by the given total change per seed."""
    runs = {}
    for name, deltas in ((a, deltas_a), (b, deltas_b)):
        for seed, delta in enumerate(deltas):
            runs[(name, seed)] = [
                {"algorithm": name, "seed": seed, "step": s, key: 10 + delta * s / (steps - 1)} for s in range(steps)
            ]
    return runs


def test_verdicts():
    claim = Claim("src", "a lengthens more than b", "length", "sample_grpo", "grpo", +1, "tokens")
    up = verdict(claim, _runs([5, 6, 7], [0, 1, 0]), window=1)
    assert up["verdict"] == "reproduced" and up["mean"] == pytest.approx(17 / 3) and up["low"] > 0
    down = verdict(claim, _runs([0, 1, 0], [5, 6, 7]), window=1)
    assert down["verdict"].startswith("refuted")
    unclear = verdict(claim, _runs([1, -1, 2], [0, 0, 0]), window=1)
    assert unclear["verdict"] == "not resolved at this scale" and unclear["low"] < 0 < unclear["high"]
    assert verdict(claim, _runs([1], [0]), window=1)["verdict"].startswith("not resolved (fewer")
    assert verdict(claim, {}, window=1) is None
    # the whole-run reading: the mean of steps 1..3 minus step 0 (linear rise: 2/3 of the total change)
    whole = verdict(claim, _runs([6, 6, 6], [3, 3, 3]), window=1, measure=run_mean)
    assert whole["mean"] == pytest.approx(2.0) and whole["verdict"] == "reproduced"
    assert {c.a for c in CLAIMS} >= {"sample_grpo", "bnpo", "grpo"}


def test_config_checks():
    with pytest.raises(ValueError, match="seeds"):
        length.LengthExperiment(seeds=0)
    with pytest.raises(ValueError, match="algorithms"):
        length.LengthExperiment(algorithms=())
    with pytest.raises(ValueError, match="group-size"):
        length.LengthExperiment(group_size=1)


REDUCED = dict(
    algorithms=("grpo", "sample_grpo"),
    seeds=2,
    steps=2,
    prompts_per_step=2,
    group_size=2,
    max_new_tokens=36,
    warm_steps=3,
    warm_batch=4,
    d_model=16,
    eval_prompts=2,
    workers=1,
)


def test_reduced_run_end_to_end(tmp_path):
    """The experiment's whole path in seconds: warm starts, runs, records, report, resume."""
    experiment = length.LengthExperiment(**REDUCED)
    length.run(experiment, tmp_path, progress=False)
    runs = load(tmp_path)
    assert set(runs) == {(a, s) for a in REDUCED["algorithms"] for s in range(2)}
    for records in runs.values():
        assert [r["step"] for r in records] == [0, 1, 2]
        for r in records:
            assert len(r["grad_pos"]) == len(length.LENGTH_BINS) and 0 <= r["truncated"] <= 1
    batch = load_batch(tmp_path / "warm" / "batch-seed0.pt")  # the first step's batch, for pgloss grads
    assert batch["mask"].shape[0] == 4 and gradient_table(["grpo"], batch)["grpo"]["grad"].shape == batch["mask"].shape
    # the same seed starts both algorithms from one warm start: their first rollouts are identical
    assert runs[("grpo", 0)][0]["length"] == runs[("sample_grpo", 0)][0]["length"]
    report = write_report(
        runs, list(REDUCED["algorithms"]), tmp_path, command="pgloss experiment length", seconds=1.0, window=1
    )
    text = report.read_text()
    assert "| grpo | 2 |" in text and "sample-level loss lengthens" in text
    for name in ("reward", "length", "repetition", "gradient"):
        assert (tmp_path / f"length_{name}.png").read_bytes()[:4] == b"\x89PNG"
    before = (tmp_path / "runs" / "grpo-0.jsonl").stat().st_mtime_ns
    length.run(experiment, tmp_path, progress=False)  # resumes: nothing left to run
    assert (tmp_path / "runs" / "grpo-0.jsonl").stat().st_mtime_ns == before


def test_command(tmp_path, capsys):
    args = ["experiment", "length", "--out", str(tmp_path), "--report-only"]
    assert main(args) == 2 and "no complete run" in capsys.readouterr().err
    assert main(["experiment", "length", "--out", str(tmp_path), "--algorithms", "grpo,nope"]) == 2
    assert "nope" in capsys.readouterr().err
    records = [
        {
            "algorithm": "grpo",
            "seed": 0,
            "step": s,
            "reward": 0.5,
            "length": 10.0,
            "length_right": 9.0,
            "length_wrong": 11.0,
            "rep4": 0.1,
            "truncated": 0.0,
            "grad_pos": [0.1] * 5,
            "grad_neg": [0.2] * 5,
        }
        for s in range(3)
    ]
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "grpo-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(args + ["--algorithms", "grpo"]) == 0
    assert "| grpo | 1 |" in (tmp_path / "report.md").read_text()


def test_quick_is_a_reduced_form_of_the_full_experiment():
    full = length.LengthExperiment()
    assert dataclasses.replace(length.QUICK, seeds=full.seeds, steps=full.steps) == full
    assert len(full.algorithms) >= 6 and full.seeds >= 5 and full.max_new_tokens >= 128


def test_a_check_run_carries_a_caveat_and_no_band_goes_below_zero(tmp_path, monkeypatch):
    """--quick's 2 seeds x 12 steps: the report says it is no result; intervals of a few seeds
    reach below zero, the drawn bands stop at zero."""
    import matplotlib.pyplot as plt

    runs = _runs([5, -3], [0, 1], steps=13)
    for records in runs.values():
        for r in records:
            r.update(
                reward=0.5,
                length_right=r["length"],
                length_wrong=0.2 * r["seed"],
                rep4=0.01 * r["seed"],
                truncated=0.0,
                grad_pos=[0.1] * 5,
                grad_neg=[0.2] * 5,
                entropy=0.3,
            )
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figures to read what was drawn
    text = write_report(
        runs, ["sample_grpo", "grpo"], tmp_path, command="pgloss experiment length --quick", seconds=None, window=3
    ).read_text()
    assert "A check run, not a result: 2 seeds x 12 steps against the experiment's 5 x 100" in text
    assert "(would read: " in text and "| reproduced |" not in text and "| not resolved at this scale |" not in text
    bands = [
        path
        for fig in figures
        for ax in fig.axes
        for c in ax.collections
        if hasattr(c, "get_paths")
        for path in c.get_paths()
        if len(path.vertices)
    ]
    assert bands and min(float(path.vertices[:, 1].min()) for path in bands) >= 0.0


def test_the_experiment_resumes_its_own_out_and_refuses_another(tmp_path, capsys):
    from pgloss.experiments.command import claim_out

    experiment = length.LengthExperiment(**REDUCED)
    out = tmp_path / "exp"
    assert claim_out(str(out), "unused", experiment, overwrite=False) == out  # new
    out.mkdir()
    (out / "experiment.json").write_text(
        json.dumps({**dataclasses.asdict(experiment), "workers": 2, "status": "interrupted"})
    )
    assert claim_out(str(out), "unused", experiment, overwrite=False) == out  # the same experiment: resumed
    older = {k: v for k, v in dataclasses.asdict(experiment).items() if k != "target_entropy"}
    (out / "experiment.json").write_text(json.dumps({**older, "workers": 2, "status": "interrupted"}))
    assert claim_out(str(out), "unused", experiment, overwrite=False) == out  # saved before the setting existed
    with pytest.raises(ValueError, match=r"target_entropy None there, 0.3 here"):
        claim_out(str(out), "unused", dataclasses.replace(experiment, target_entropy=0.3), overwrite=False)
    other = dataclasses.replace(experiment, steps=5)
    with pytest.raises(ValueError, match=r"holds an experiment with other settings \(steps 2 there, 5 here\)"):
        claim_out(str(out), "unused", other, overwrite=False)
    assert claim_out(None, str(out), other, overwrite=False) == tmp_path / "exp-2"  # the default: beside it
    (out / "runs").mkdir()
    (out / "notes.txt").write_text("mine")
    assert claim_out(str(out), "unused", other, overwrite=True, own=length.OWN) == out
    assert not (out / "runs").exists() and not (out / "experiment.json").exists() and (out / "notes.txt").exists()
    assert (out / "replaced" / "runs").is_dir() and (
        out / "replaced" / "experiment.json"
    ).exists()  # set aside, not deleted
    assert main(["experiment", "length", "--quick", "--steps", "5", "--out", str(out / "notes.txt")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_growth_is_the_least_squares_slope_per_100_steps():
    records = [{"step": s, "length": 10 + 0.05 * s + (0.3 if s % 2 else -0.3)} for s in range(0, 41)]
    # a loop of the textbook formula: slope = Σ(x - x̄)(y - ȳ) / Σ(x - x̄)²
    xs, ys = [r["step"] for r in records], [r["length"] for r in records]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    assert growth(records, "length") == pytest.approx(100 * slope)
    assert growth([{"step": s, "length": 3.0 - 0.02 * s} for s in range(5)], "length") == pytest.approx(-2.0)
    assert math.isnan(growth([{"step": 0, "length": 3.0}, {"step": 1, "length": None}], "length"))
    rate = verdict(CLAIMS[0], _runs([4, 5, 6], [1, 1, 1], steps=11), window=1, measure=growth)
    assert rate["mean"] == pytest.approx(100 * 4 / 10) and rate["verdict"] == "reproduced"  # 4 tokens over 10 steps


def test_the_table_gives_the_growth_over_the_whole_run_and_over_its_last_quarter():
    """A length that rises by 0.2 a step up to step 30, then by 0.05 (seed 0) or 0.15 (seed 1) to step 40: the
    whole run's slope is the least-squares one, the last quarter's (steps 30-40) the later rate."""
    flat = {key: 1.0 for key in ("reward", "length_right", "length_wrong", "rep4", "entropy", "truncated")}
    runs = {
        ("grpo", seed): [
            {"step": s, "seed": seed, "entropy_coef": 0.0, **flat, "length": 0.2 * min(s, 30) + late * max(s - 30, 0)}
            for s in range(41)
        ]
        for seed, late in ((0, 0.05), (1, 0.15))
    }
    (row,) = length_report.summary_rows(runs, ["grpo"], window=5)
    whole = [growth(records, "length") for records in runs.values()]
    assert row["growth"] == pytest.approx(interval(whole))
    mean, half = row["growth_end"]
    assert mean == pytest.approx(10.0) and half == pytest.approx(12.706 * 5.0, rel=1e-4)  # t(0.975, 1) x 7.07 / √2


def test_the_growth_experiment_is_the_claims_where_length_is_free_to_grow():
    g = length.EXPERIMENTS["chain"]
    assert g.task == "chain" and g.max_new_tokens >= 256 and g.seeds >= 5
    assert {"grpo", "grpo:kl_coef=0", "bnpo", "dr_grpo", "sample_grpo"} <= set(g.algorithms)
    assert g.entropy_coef and g.entropy_coef > 0
    configs = [g.lab_config(a, 0) for a in g.algorithms]
    assert {c.entropy_coef for c in configs} == {g.entropy_coef} and {c.task for c in configs} == {"chain"}
    from pgloss.lab.trainer import make_algorithm

    assert {make_algorithm(c).entropy_coef for c in configs} == {g.entropy_coef}  # the same bonus for every loss
    assert length.quick(g) == dataclasses.replace(g, seeds=2, steps=12)
    assert length.EXPERIMENTS["trace"] == length.LengthExperiment() and length.LengthExperiment().entropy_coef is None
    with pytest.raises(ValueError, match="task"):
        length.LengthExperiment(task="nope")
    with pytest.raises(ValueError, match="entropy_coef"):
        length.LengthExperiment(entropy_coef=-1.0)


def test_reduced_growth_run_through_the_command(tmp_path, capsys, monkeypatch):
    """``--task chain --quick`` at a reduced scale: chain runs with the entropy bonus, the
    report carries the growth column and the check-run caveat of the chain design."""
    small = dataclasses.replace(
        length.EXPERIMENTS["chain"],
        algorithms=("grpo", "sample_grpo"),
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=24,
        warm_steps=3,
        warm_batch=4,
        d_model=16,
        eval_prompts=2,
    )
    monkeypatch.setitem(length.EXPERIMENTS, "chain", small)
    out = tmp_path / "g"
    assert main(["experiment", "length", "--task", "chain", "--quick", "--steps", "2", "--out", str(out)]) == 0
    settings = json.loads((out / "experiment.json").read_text())
    assert settings["task"] == "chain" and settings["entropy_coef"] == small.entropy_coef and settings["steps"] == 2
    runs = load(out)
    assert set(runs) == {(a, s) for a in ("grpo", "sample_grpo") for s in range(2)}
    assert all(r["entropy"] is not None for records in runs.values() for r in records)
    text = (out / "report.md").read_text()
    assert "--task chain --quick --steps 2" in text and "length growth (tokens/100 steps)" in text
    assert f"against the experiment's 5 x {small.steps}" in text and "growth rate per 100 steps" in text


def test_report_command_writes_an_experiments_report_again(tmp_path, capsys):
    """`pgloss report RUN_DIR` finds the experiment in experiment.json and writes its report from the
    complete runs, keeping the earlier one in replaced/."""
    experiment = length.LengthExperiment(**{**REDUCED, "algorithms": ("grpo",)})
    (tmp_path / "experiment.json").write_text(
        json.dumps(
            {**dataclasses.asdict(experiment), "status": "running", "command": "pgloss experiment length --seeds 2"}
        )
    )
    records = [
        {
            "algorithm": "grpo",
            "seed": 0,
            "step": s,
            "reward": 0.5,
            "length": 10.0,
            "length_right": 9.0,
            "length_wrong": 11.0,
            "rep4": 0.1,
            "truncated": 0.0,
            "grad_pos": [0.1] * 5,
            "grad_neg": [0.2] * 5,
        }
        for s in range(3)
    ]
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "grpo-0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "report.md").write_text("an earlier report")
    assert main(["report", str(tmp_path)]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| grpo | 1 |" in text and "pgloss experiment length --seeds 2" in text
    assert (tmp_path / "replaced" / "report.md").read_text() == "an earlier report"
    assert (tmp_path / "length_reward.png").read_bytes()[:4] == b"\x89PNG"


def test_the_ladder_experiment_is_the_claims_where_length_keeps_growing():
    g = length.EXPERIMENTS["ladder"]
    assert g.task == "ladder" and g.seeds >= 8 and g.max_new_tokens >= 4 * (make_task("ladder").max_response_chars + 1)
    assert {"grpo", "grpo:kl_coef=0", "sample_grpo", "bnpo", "dr_grpo", "dapo"} <= set(g.algorithms)
    assert g.target_entropy and g.target_entropy > 0
    from pgloss.lab.trainer import make_algorithm, make_entropy_control

    configs = [g.lab_config(a, 0) for a in g.algorithms]
    assert {c.target_entropy for c in configs} == {g.target_entropy} and {c.task for c in configs} == {"ladder"}
    controls = [make_entropy_control(c, make_algorithm(c)) for c in configs]  # the same controller for every loss
    assert {(c.coef, c.target, c.delta) for c in controls} == {(0.0, g.target_entropy, 0.005)}
    with pytest.raises(ValueError, match="target_entropy"):
        length.LengthExperiment(target_entropy=0.0)


def test_reduced_ladder_run_through_the_command_resumes(tmp_path, capsys, monkeypatch):
    """``--task ladder --quick`` at a reduced scale: the runs steer the entropy (the coefficient is in the
    records and the report), keep each trained policy's last batch for ``pgloss grads``, and a second call
    resumes with nothing left to run."""
    small = dataclasses.replace(
        length.EXPERIMENTS["ladder"],
        algorithms=("grpo", "dapo"),
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=40,
        warm_steps=3,
        warm_batch=4,
        d_model=16,
        eval_prompts=2,
    )
    monkeypatch.setitem(length.EXPERIMENTS, "ladder", small)
    out = tmp_path / "l"
    command = ["experiment", "length", "--task", "ladder", "--quick", "--steps", "2", "--out", str(out)]
    assert main(command) == 0
    settings = json.loads((out / "experiment.json").read_text())
    assert settings["task"] == "ladder" and settings["target_entropy"] == small.target_entropy
    runs = load(out)
    assert set(runs) == {(a, s) for a in ("grpo", "dapo") for s in range(2)}
    # the tiny policy's entropy is far above the target: the bonus stays off (None: no update, as when DAPO
    # drops every group, and at the last record, which measures the final policy)
    assert all(r["entropy_coef"] in (0.0, None) for records in runs.values() for r in records)
    assert runs[("grpo", 0)][0]["entropy_coef"] == 0.0 and runs[("grpo", 0)][-1]["entropy_coef"] is None
    batch = load_batch(length.end_batch_path(out / "runs" / "grpo-0.jsonl"))
    assert batch["mask"].shape[0] == 4 and gradient_table(["grpo"], batch)["grpo"]["grad"].shape == batch["mask"].shape
    text = (out / "report.md").read_text()
    assert "--task ladder --quick --steps 2" in text and "entropy coefficient (mean)" in text
    assert f"against the experiment's 8 x {small.steps}" in text
    assert (out / "length_entropy.png").read_bytes()[:4] == b"\x89PNG"
    before = (out / "runs" / "grpo-0.jsonl").stat().st_mtime_ns
    capsys.readouterr()
    assert main(command) == 0  # the same experiment: resumed, nothing left to run
    assert (out / "runs" / "grpo-0.jsonl").stat().st_mtime_ns == before
    assert "4 of 4 runs complete" in capsys.readouterr().out
