"""The report's numbers, windows and readings, on hand-made records."""

import math

import pytest

from pgloss.lab.report import (
    TAIL,
    cell,
    mismatch_table,
    read_clipping,
    read_kept,
    run_values,
    summarize,
    tables,
    write_report,
)
from pgloss.lab.spec import parse_spec

STEPS = 8


def run(label, seed, clip=0.05, ppo_kl=0.005, kept=1.0, length=lambda step: 5.0 + step, groups=4.0, extra=None):
    """Records of steps 0..STEPS; the last one measures the final policy and has no update diagnostics."""
    records = []
    for step in range(STEPS + 1):
        update = step < STEPS
        records.append(
            {
                "algorithm": label,
                "seed": seed,
                "step": step,
                "reward": 0.1 * step,
                "accuracy": 0.5,
                "length": length(step),
                "entropy": 1.0 - 0.05 * step,
                "kl_ref": 0.01 * step,
                "scratchpad": 0.5,
                "reward_scratchpad": 0.6,
                "reward_direct": 0.3,
                "kept": kept if update else None,
                "clip_frac": (clip * (1 + step % 2)) if update and clip is not None else None,
                "clip_frac_high": (clip * (1 + step % 2)) if update and clip is not None else None,
                "clip_frac_low": 0.0 if update and clip is not None else None,
                "ppo_kl": ppo_kl if update else None,
                "grad_norm": float(step) if update else None,
                "grad_clipped": float(step >= 6) if update else None,
                "eval_reward": {0: 0.4, STEPS: 0.5 + 0.1 * seed}.get(step),
                "groups": groups if update else None,
                **{k: (f(step) if update else None) for k, f in (extra or {}).items()},
            }
        )
    return records


def test_run_values_use_the_stated_windows():
    v = run_values(run("grpo", 0))
    assert v["length_start"] == 5.0
    assert v["length_end"] == pytest.approx(sum(5.0 + s for s in range(STEPS + 1 - TAIL, STEPS + 1)) / TAIL)
    assert v["clip_frac"] == pytest.approx(sum(0.05 * (1 + s % 2) for s in range(STEPS)) / STEPS)  # every update
    assert v["grad_norm"] == pytest.approx(sum(range(STEPS)) / STEPS)
    assert v["grad_clipped"] == pytest.approx(2 / STEPS)  # steps 6 and 7
    assert (v["eval_start"], v["eval_end"], v["beat"]) == (0.4, 0.5, 1.0)


def test_cells_show_the_mean_then_each_seed():
    assert cell([0.4, 0.6]) == "0.500 (0.400, 0.600)"
    assert cell([0.4]) == "0.400"
    assert cell([float("nan"), float("nan")]) == "–"
    assert cell([-0.00001, 0.00001], 4) == "0.0000 (0.0000, 0.0000)"
    # beyond two seeds: the mean ± the half-width of the 95% Student-t interval, t_{0.975, 2} = 4.303
    half = 4.303 * math.sqrt(((0.4 - 0.5) ** 2 + (0.6 - 0.5) ** 2) / 2) / math.sqrt(3)
    assert cell([0.4, 0.5, 0.6]) == f"0.500 ± {half:.3f}" == "0.500 ± 0.248"
    assert cell([0.4, float("nan"), 0.5, 0.6]) == "0.500 ± 0.248"  # a seed without the value is left out
    rows = summarize(run("grpo", 0) + run("grpo", 1))
    assert rows["grpo"]["seeds"] == [0, 1] and rows["grpo"]["values"]["eval_end"] == [0.5, pytest.approx(0.6)]
    text = tables(rows)
    assert f"last {TAIL}" in text and "0.400 → 0.550 (0.500, 0.600) | 2/2" in text


@pytest.mark.parametrize(
    "label, clip, ppo_kl, expected, absent",
    [
        ("grpo", 0.2, 0.001, "the batch is reused a lot", "by design"),
        ("grpo", 0.2, 0.05, "the steps are large", "reused"),
        ("grpo", 0.002, 0.001, "the steps are small", "reused"),
        ("grpo", 0.05, 0.001, "moderate clip fraction", "reused"),
        ("gspo", 0.2, 0.001, "high by design, not a sign of batch reuse: the band is 0.0003/0.0004", "reused a lot"),
        ("cispo", 0.2, 0.001, "CISPO clips the importance weight", "reused"),
        ("sapo", None, 0.001, "no clip fraction was recorded", "reused"),
        ("sample_grpo", 0.2, 0.001, "a clipped response clips all its tokens", "by design"),
    ],
)
def test_clip_reading_follows_the_rules_unless_the_clip_means_something_else(label, clip, ppo_kl, expected, absent):
    rows = summarize(run(label, 0, clip=clip / 1.5 if clip else None, ppo_kl=ppo_kl))
    text = read_clipping(label, rows[label], parse_spec(label).build(24))
    assert expected in text and absent not in text
    assert "clipped on 25% of the optimizer steps" in text


def test_kept_fraction_is_reported_for_dynamic_sampling_only():
    rows = summarize(run("grpo", 0) + run("dapo", 0, kept=0.25, groups=1) + run("dapo", 1, kept=0.5, groups=2))
    lines = read_kept(rows, {"prompts_per_step": 4})
    assert len(lines) == 1 and "**dapo** trained on 38% of the sampled responses" in lines[0]
    assert "(per seed: 0.25, 0.50), a batch of 1.5 of 4 groups" in lines[0]
    assert "did not refill it (--max-refill-rounds 0), so its updates saw fewer responses" in lines[0]
    rows = summarize(run("dapo", 0, kept=0.5, groups=4))
    (line,) = read_kept(rows, {"prompts_per_step": 4, "max_refill_rounds": 2})
    assert "a batch of 4.0 of 4 groups" in line and "refilled it with up to 2 extra rounds" in line
    assert "fewer responses" not in line


def test_the_mismatch_table_shows_only_for_a_simulated_mismatch():
    extra = {
        "rollout_kl": lambda s: 0.001 * s,
        "rollout_is_ess": lambda s: 0.9,
        "rollout_is_weight_mean": lambda s: 1.0,
    }
    rows = summarize(run("grpo", 0, extra=extra) + run("grpo", 1, extra=extra))
    base = {
        "temperature": 1.0,
        "sampler_temperature": None,
        "sampler_noise": 0.0,
        "rollout_correction": "token:upper=2",
    }
    assert mismatch_table(rows, base) == [] and mismatch_table(rows, {**base, "sampler_temperature": 1.0}) == []
    text = "\n".join(mismatch_table(rows, {**base, "sampler_noise": 0.05, "sampler_temperature": 1.2}))
    assert "(sampler temperature 1.2 (loss: 1), relative weight noise 0.05), rollout correction `token:upper=2`" in text
    # rollout_kl: mean over the updates 0..STEPS-1 of 0.001 * step
    assert f"| grpo | {sum(range(STEPS)) / STEPS * 0.001:.5f} (" in text and "| 0.9000 (0.9000, 0.9000) |" in text
    assert "| 1.000 (–, –) |" in text


def test_report_of_an_interrupted_comparison_lists_the_unfinished_runs(tmp_path):
    def outcome(label, status, steps_done, records=(), error=None):
        return {
            "algorithm": label,
            "seed": 0,
            "status": status,
            "steps_done": steps_done,
            "error": error,
            "metrics": list(records),
        }

    runs = [
        outcome("grpo", "finished", STEPS + 1, run("grpo", 0)),
        outcome("dapo", "failed", 3, error="RuntimeError: boom"),
        outcome("gspo", "interrupted", 2),
        outcome("cispo", "not started", 0),
    ]
    config = {
        "command": "pgloss compare",
        "versions": {"pgloss": "0.1.0", "torch": "2.13.0", "git": None},
        "status": "interrupted",
        "seeds": [0],
        "base": {
            "task": "chain",
            "steps": STEPS,
            "prompts_per_step": 4,
            "group_size": 4,
            "epochs": 2,
            "minibatches": 2,
            "eval_prompts": 4,
            "max_new_tokens": 24,
        },
    }
    report = write_report(tmp_path, runs, config, []).read_text()
    assert "This comparison was interrupted: 1 of 4 runs finished." in report
    assert "- dapo, seed 0: failed after 3 of 8 steps: RuntimeError: boom" in report
    assert "- gspo, seed 0: interrupted after 2 of 8 steps" in report and "- cispo, seed 0: not started" in report
    assert "| grpo |" in report and "| dapo |" not in report
