"""``report.md``: the summary table, the plots, and a reading of the curves in seed 004's terms.

The reading is rule-based and says which rule fired, with its thresholds:

- clip fraction high (>= 0.10) and ppo_kl high (>= 0.02): steps too large (learning rate,
  epochs, advantage scale);
- clip fraction high but ppo_kl low: the batch is reused too much (ratios pushed to the clip
  edge while the distribution as a whole moves little);
- clip fraction near zero (< 0.01): steps too small (or a KL/entropy term holding them back);
- otherwise: moderate, inside the usual range.
"""

from __future__ import annotations

import math
from pathlib import Path

TAIL = 5  # final values are means over the last TAIL steps

HIGH_CLIP, LOW_CLIP, HIGH_PPO_KL = 0.10, 0.01, 0.02


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def summarize(records: list[dict]) -> dict[str, dict[str, float]]:
    """Per algorithm (averaged over seeds): start (step 0) and final (last TAIL steps) values."""
    by_alg: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        by_alg.setdefault(r["algorithm"], {}).setdefault(r["seed"], []).append(r)
    rows = {}
    for algorithm, seeds in by_alg.items():
        runs = [sorted(rs, key=lambda r: r["step"]) for rs in seeds.values()]
        row = {"seeds": len(runs)}
        for key in ("reward", "accuracy", "length", "entropy", "kl_ref", "scratchpad", "reward_scratchpad",
                    "reward_direct"):
            row[f"{key}_start"] = _mean(run[0][key] for run in runs)
            row[f"{key}_end"] = _mean(_mean(r[key] for r in run[-TAIL:]) for run in runs)
            row[f"{key}_end_min"] = min(_mean(r[key] for r in run[-TAIL:]) for run in runs)
            row[f"{key}_end_max"] = max(_mean(r[key] for r in run[-TAIL:]) for run in runs)
        for key in ("clip_frac", "ppo_kl", "grad_norm"):
            row[key] = _mean(r[key] for run in runs for r in run)
        row["eval_start"] = _mean(run[0]["eval_reward"] for run in runs)
        row["eval_end"] = _mean(run[-1]["eval_reward"] for run in runs)
        row["seeds_beat"] = sum(run[-1]["eval_reward"] > run[0]["eval_reward"] for run in runs)
        row["beat_warm_start"] = row["seeds_beat"] == len(runs)
        rows[algorithm] = row
    return rows


def table(rows: dict[str, dict[str, float]]) -> str:
    """Markdown summary table."""
    head = ("| algorithm | eval reward start -> end | beat warm start (seeds) | train reward start -> end "
            "| greedy acc. start -> end | length start -> end | entropy start -> end | KL to ref end | clip frac. "
            "| ppo_kl |\n|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for a, r in rows.items():
        lines.append(
            f"| {a} | {r['eval_start']:.3f} -> {r['eval_end']:.3f} | {r['seeds_beat']}/{r['seeds']} "
            f"| {r['reward_start']:.3f} -> {r['reward_end']:.3f} | {r['accuracy_start']:.3f} -> {r['accuracy_end']:.3f} "
            f"| {r['length_start']:.2f} -> {r['length_end']:.2f} | {r['entropy_start']:.3f} -> {r['entropy_end']:.3f} "
            f"| {r['kl_ref_end']:.3f} | {r['clip_frac']:.3f} | {r['ppo_kl']:.4f} |")
    return head + "\n".join(lines) + "\n"


def read_clipping(algorithm: str, r: dict[str, float]) -> str:
    """Seed 004's reading of clip fraction against KL, for one algorithm."""
    clip, kl = r["clip_frac"], r["ppo_kl"]
    if clip >= HIGH_CLIP and kl >= HIGH_PPO_KL:
        verdict = "high clip fraction with high ppo_kl: the steps are large (learning rate, epochs or advantage scale)"
    elif clip >= HIGH_CLIP:
        verdict = ("high clip fraction with low ppo_kl: the batch is reused a lot, ratios reach the clip edge while "
                   "the distribution as a whole moves little")
    elif clip < LOW_CLIP:
        verdict = "clip fraction near zero: the steps are small, clipping hardly acts"
    else:
        verdict = "moderate clip fraction: clipping acts on a minority of tokens, the usual regime"
    return (f"- **{algorithm}**: clip fraction {clip:.3f}, ppo_kl {kl:.4f}, KL to the reference at the end "
            f"{r['kl_ref_end']:.3f}, entropy {r['entropy_start']:.3f} -> {r['entropy_end']:.3f}: {verdict}.")


def read_length(rows: dict[str, dict[str, float]]) -> str:
    """Whether seed 003's effects appeared: sample-level loss lengthening, token-level GRPO keeping short."""
    if "sample_grpo" not in rows or "grpo" not in rows:
        return "Seed 003's comparison needs both grpo and sample_grpo in the run; it was not made here."
    s, g = rows["sample_grpo"], rows["grpo"]
    ds, dg = s["length_end"] - s["length_start"], g["length_end"] - g["length_start"]
    apart = s["length_end_min"] > g["length_end_max"]
    lengthened = ds > 0.5 and apart
    text = (f"sample_grpo's responses went from {s['length_start']:.2f} to {s['length_end']:.2f} tokens "
            f"({ds:+.2f}), grpo's from {g['length_start']:.2f} to {g['length_end']:.2f} ({dg:+.2f}); "
            f"at the end the seeds span {s['length_end_min']:.2f}-{s['length_end_max']:.2f} for sample_grpo and "
            f"{g['length_end_min']:.2f}-{g['length_end_max']:.2f} for grpo. ")
    text += (f"At the start, {s['scratchpad_start']:.0%} of the responses wrote a scratchpad; those earned "
             f"{s['reward_scratchpad_start']:.3f} on average and the direct answers {s['reward_direct_start']:.3f}, "
             f"so the reward itself favoured {'long' if s['reward_scratchpad_start'] > s['reward_direct_start'] else 'short'} "
             f"responses. At the end {s['scratchpad_end']:.0%} (sample_grpo) and {g['scratchpad_end']:.0%} (grpo) "
             "wrote one. ")
    if lengthened and dg <= 0.5:
        text += "Seed 003's effect appeared: the sample-level loss lengthened responses, token-level GRPO kept them short."
    elif lengthened:
        text += ("The sample-level loss ended longer than token-level GRPO, but GRPO's responses grew too, so only "
                 "half of seed 003's effect appeared.")
    else:
        text += ("Seed 003's effect did not appear at this scale: the sample-level loss did not end with clearly "
                 "(every seed) longer responses than token-level GRPO.")
    return text


def write_report(out: Path, records: list[dict], config: dict, plots: list[Path], samples: dict, command: str) -> Path:
    """Write ``report.md`` into `out` and return its path."""
    rows = summarize(records)
    lines = [
        "# pgloss lab: comparison",
        "",
        f"Command: `{command}`",
        "",
        f"Task `{config['base']['task']}`, {config['base']['steps']} RL steps of {config['base']['prompts_per_step']} prompts "
        f"x {config['base']['group_size']} completions, {config['base']['epochs']} epochs x "
        f"{config['base']['minibatches']} minibatches per batch, seeds {config['seeds']}. Start = the warm-start policy "
        f"(step 0); end = mean of the last {TAIL} steps; both averaged over seeds. *Eval reward* is the sampled "
        f"reward on {config['base']['eval_prompts']} fixed held-out prompts x {config['base']['group_size']} samples, "
        "drawn with the same random numbers before RL and after it: a seed beats its warm start when its eval "
        "reward rises. *Train reward* is the sampled reward of each step's fresh prompts; greedy accuracy is on the "
        "held-out prompts. Lengths count response tokens, the end token included. Full config: `config.json`.",
        "",
        "## Summary",
        "",
        table(rows),
        "## Curves",
        "",
        *[f"![{p.stem}]({p.name})" for p in plots],
        "",
        "## Reading the curves (seed 004: clip fraction against KL)",
        "",
        "Rules: clip fraction >= 0.10 with ppo_kl >= 0.02 means steps too large; >= 0.10 with lower ppo_kl means "
        "too much reuse of the batch; < 0.01 means steps too small. Sequence-level ratios (gspo, sample_grpo) clip "
        "whole responses, so their clip fraction counts all tokens of a clipped response and is not directly "
        "comparable with the token-level methods'.",
        "",
        *[read_clipping(a, r) for a, r in rows.items()],
        "",
        "## Response length (seed 003)",
        "",
        read_length(rows),
        "",
        "## Samples",
        "",
        "See `samples.md` for completions at the start and at the end of every run.",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path


def write_samples(out: Path, samples: dict) -> Path:
    """``samples.md``: per run, prompts with a sampled completion at the start and at the end."""
    lines = ["# Sample completions", ""]
    for (algorithm, seed), run in samples.items():
        lines += [f"## {algorithm}, seed {seed}", "", "| prompt | start (reward) | end (reward) |", "|---|---|---|"]
        for (prompt, start, r0), (_, end, r1) in zip(run["start"], run["end"]):
            lines.append(f"| `{prompt}` | `{start}` ({r0:g}) | `{end}` ({r1:g}) |")
        lines.append("")
    path = out / "samples.md"
    path.write_text("\n".join(lines))
    return path
