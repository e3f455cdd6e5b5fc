"""``report.md``: the summary tables, the plots, and a rule-based reading of the curves.

Every column says its window: the warm start is step 0; a rollout statistic at the end is the
mean of the last ``TAIL`` steps (of every step after 0 in a shorter run); an update diagnostic
is the mean over every update of the run; the eval reward compares the warm-start policy with the
final one. A cell is the mean over seeds followed by each seed's value (two seeds) or by the
half-width of the 95% Student-t interval over seeds (three or more: ``intervals.py``).

The reading of clip fraction against ``ppo_kl`` follows "an article on the components of PG
losses in verl's conventions" and says which rule fired, with its thresholds:

- clip fraction high (>= 0.10) and ppo_kl high (>= 0.02): steps too large (learning rate,
  epochs, advantage scale);
- clip fraction high but ppo_kl low: the batch is reused too much (ratios pushed to the clip
  edge while the distribution as a whole moves little);
- clip fraction near zero (< 0.01): steps too small (or a KL/entropy term holding them back);
- otherwise: moderate, inside the usual range.

The rules assume a token ratio clipped to a band near 1 ± 0.2. They are not applied where the
clip means something else: GSPO's band of 3e-4/4e-4 on a sequence ratio clips many responses
by design, CISPO clips a weight and keeps the gradient, SAPO has no hard clip.
"""

from __future__ import annotations

import math
from pathlib import Path

from .intervals import interval
from .resume import resume_command

TAIL = 5  # rollout statistics at the end are means over the last TAIL steps (fewer in a shorter run)


def tail(steps: int) -> int:
    """The window of the end values of a run of `steps` RL steps: its last min(TAIL, steps) steps,
    so that the end never includes step 0 (the warm start)."""
    return max(1, min(TAIL, steps))


def last(window: int) -> str:
    return "last step" if window == 1 else f"last {window} steps"


HIGH_CLIP, LOW_CLIP, HIGH_PPO_KL = 0.10, 0.01, 0.02
NARROW_BAND = 0.01  # clip_low + clip_high below this: a band the article's thresholds were not made for

ROLLOUT = ("reward", "accuracy", "length", "entropy", "kl_ref", "scratchpad", "reward_scratchpad", "reward_direct")
UPDATE = (
    "clip_frac",
    "clip_frac_high",
    "clip_frac_low",
    "ppo_kl",
    "grad_norm",
    "grad_clipped",
    "kept",
    "groups",
    "entropy_coef",
)
# the sampler mismatch and its correction (a table only when the run simulates a mismatched sampler)
MISMATCH = (
    "rollout_kl",
    "rollout_k3_kl",
    "rollout_is_weight_mean",
    "rollout_is_weight_min",
    "rollout_is_weight_max",
    "rollout_is_ess",
    "rollout_is_bounded_frac",
    "rollout_rejected_frac",
)

VERL_ARTICLE = "an article on the components of PG losses in verl's conventions"
OPENR1_ARTICLE = '"OpenR1 in practice (6): sample-level vs token-level loss" (2025-06-04)'


def _mean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else float("nan")


def run_values(records: list[dict], window: int = TAIL) -> dict[str, float]:
    """One run's numbers: ``<metric>_start`` (step 0) and ``<metric>_end`` (last `window` steps) for the
    rollout statistics, whole-run means of the update diagnostics, eval reward before and after."""
    run = sorted(records, key=lambda r: r["step"])
    updates = run[:-1]  # the last record measures the final policy and makes no update
    values = {}
    for key in ROLLOUT:
        values[f"{key}_start"] = _mean([run[0].get(key)])
        values[f"{key}_end"] = _mean(r.get(key) for r in run[-window:])
    for key in (*UPDATE, *MISMATCH):
        values[key] = _mean(r.get(key) for r in updates)
    values["eval_start"] = _mean([run[0].get("eval_reward")])
    values["eval_end"] = _mean([run[-1].get("eval_reward")])
    values["beat"] = float(values["eval_end"] > values["eval_start"])
    return values


def summarize(records: list[dict], window: int = TAIL) -> dict[str, dict]:
    """Per algorithm: ``seeds`` (sorted) and ``values`` {key: [one value per seed]} of `run_values`."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for r in records:
        runs.setdefault(r["algorithm"], {}).setdefault(r["seed"], []).append(r)
    rows = {}
    for algorithm, seeds in runs.items():
        per_seed = [run_values(seeds[s], window) for s in sorted(seeds)]
        rows[algorithm] = {"seeds": sorted(seeds), "values": {k: [v[k] for v in per_seed] for k in per_seed[0]}}
    return rows


def _fmt(value: float, digits: int) -> str:
    if value is None or math.isnan(value):
        return "–"
    text = f"{value:.{digits}f}"
    return text[1:] if text.startswith("-") and float(text) == 0 else text  # no "-0.000"


SEEDS_LISTED = 2
"""Up to this many seeds a cell lists each seed's value; beyond, it gives the 95% interval."""


def cell(values: list[float], digits: int = 3) -> str:
    """The mean over seeds, then each seed's value (``0.626 (0.612, 0.640)``) or, beyond
    `SEEDS_LISTED` seeds, the half-width of the 95% Student-t interval (``0.626 ± 0.014``)."""
    mean, half = interval(values)
    text = _fmt(mean, digits)
    if text == "–" or len(values) < 2:
        return text
    if len(values) <= SEEDS_LISTED:
        return text + " (" + ", ".join(_fmt(v, digits) for v in values) + ")"
    return text + " ± " + _fmt(half, digits)


def _span(row: dict, key: str, digits: int = 3) -> str:
    v = row["values"]
    return f"{_fmt(_mean(v[key + '_start']), digits)} → {cell(v[key + '_end'], digits)}"


def tables(rows: dict[str, dict], window: int = TAIL) -> str:
    """The outcome table and the update table (Markdown), each column with its window (the end:
    the last `window` steps)."""
    end = last(window)
    out = [
        "| algorithm | eval reward: warm start → final policy | beat warm start (seeds) "
        f"| train reward: step 0 → {end} | greedy accuracy: step 0 → {end} "
        f"| length (tokens): step 0 → {end} | entropy: step 0 → {end} | KL to ref.: {end} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for a, row in rows.items():
        v = row["values"]
        out.append(
            f"| {a} | {_fmt(_mean(v['eval_start']), 3)} → {cell(v['eval_end'])} "
            f"| {int(sum(v['beat']))}/{len(row['seeds'])} | {_span(row, 'reward')} | {_span(row, 'accuracy')} "
            f"| {_span(row, 'length', 2)} | {_span(row, 'entropy')} | {cell(v['kl_ref_end'])} |"
        )
    out += [
        "",
        "Update diagnostics, each a mean over every update of the run:",
        "",
        "| algorithm | clip fraction | clipped high | clipped low | ppo_kl | gradient norm "
        "| steps with the gradient clipped | kept (share of responses trained on) | entropy coefficient |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for a, row in rows.items():
        v = row["values"]
        out.append(
            f"| {a} | {cell(v['clip_frac'])} | {cell(v['clip_frac_high'], 4)} | {cell(v['clip_frac_low'], 4)} "
            f"| {cell(v['ppo_kl'], 4)} | {cell(v['grad_norm'], 2)} | {cell(v['grad_clipped'], 2)} "
            f"| {cell(v['kept'], 2)} | {cell(v['entropy_coef'], 4)} |"
        )
    return "\n".join(out) + "\n"


def _algorithm(label: str, config: dict):
    """The pgloss algorithm behind a run's label, or None when it cannot be built here."""
    from .spec import parse_spec

    try:
        return parse_spec(label).build(config["base"]["max_new_tokens"])
    except (ValueError, TypeError):
        return None


def read_clipping(label: str, row: dict, algorithm=None) -> str:
    """The article's reading of clip fraction against ppo_kl for one algorithm, unless its clip
    means something else (see the module docstring), with the gradient norm beside it."""
    v = row["values"]
    clip, kl = _mean(v["clip_frac"]), _mean(v["ppo_kl"])
    level = getattr(algorithm, "ratio_level", "token")
    low, high = getattr(algorithm, "clip_low", None), getattr(algorithm, "clip_high", None)
    family = type(algorithm).__name__
    if math.isnan(clip):
        verdict = (
            "no clip fraction was recorded (the loss has no hard clip, e.g. SAPO's soft gate, or no update "
            "was made), so the rules do not apply"
        )
    elif family == "CISPO":
        verdict = (
            "CISPO clips the importance weight, not the gradient: a clipped token still trains with the capped "
            "weight, so the rules for PPO's clip do not apply"
        )
    elif level in ("sequence", "sequence_token") and low is not None and high is not None and low + high < NARROW_BAND:
        verdict = (
            f"high by design, not a sign of batch reuse: the band is {low:g}/{high:g} on a length-normalised "
            "sequence ratio, so after the first optimizer step of a batch many responses sit outside it; the "
            "article's thresholds assume a token band near 0.2 and do not apply"
        )
    else:
        if clip >= HIGH_CLIP and kl >= HIGH_PPO_KL:
            verdict = (
                "high clip fraction with high ppo_kl: the steps are large (learning rate, epochs or advantage scale)"
            )
        elif clip >= HIGH_CLIP:
            verdict = (
                "high clip fraction with low ppo_kl: the batch is reused a lot, ratios reach the clip edge while "
                "the distribution as a whole moves little"
            )
        elif clip < LOW_CLIP:
            verdict = "clip fraction near zero: the steps are small, clipping hardly acts"
        else:
            verdict = "moderate clip fraction: clipping acts on a minority of tokens, the usual regime"
        if level == "sequence_product":
            verdict += " (its ratio is a whole response's: a clipped response clips all its tokens)"
    return (
        f"- **{label}**: clip fraction {_fmt(clip, 3)} (high {_fmt(_mean(v['clip_frac_high']), 4)}, "
        f"low {_fmt(_mean(v['clip_frac_low']), 4)}), ppo_kl {_fmt(kl, 4)}: {verdict}. Gradient norm "
        f"{_fmt(_mean(v['grad_norm']), 2)}, clipped on {_fmt(100 * _mean(v['grad_clipped']), 0)}% of the optimizer "
        f"steps; KL to the reference at the end {_fmt(_mean(v['kl_ref_end']), 3)}; entropy "
        f"{_span(row, 'entropy')}."
    )


def read_kept(rows: dict[str, dict], base: dict) -> list[str]:
    """One line per algorithm that trained on part of what it sampled (DAPO's dynamic sampling)."""
    lines, rounds, size = [], base.get("max_refill_rounds", 0), base["prompts_per_step"]
    for label, row in rows.items():
        kept = _mean(row["values"]["kept"])
        if kept < 1:
            groups = _mean(row["values"]["groups"])
            refill = (
                f"the lab refilled it with up to {rounds} extra rounds of fresh prompts per step"
                if rounds
                else "the lab did not refill it (--max-refill-rounds 0)"
            )
            lines.append(
                f"- **{label}** trained on {kept:.0%} of the sampled responses on average "
                f"(per seed: {', '.join(_fmt(k, 2) for k in row['values']['kept'])}), a batch of "
                f"{_fmt(groups, 1)} of {size} groups: dynamic sampling drops the groups whose rewards are all "
                f"equal and {refill}"
                + (", so its updates saw fewer responses than the others'." if groups < size else ".")
            )
    return lines


def mismatch_table(rows: dict[str, dict], base: dict) -> list[str]:
    """The sampler mismatch and the rollout correction's weight, means over every update (empty
    when the run does not simulate a mismatched sampler)."""
    from .config import mismatched

    if not mismatched(base):
        return []
    sampler = ", ".join(
        filter(
            None,
            [
                f"sampler temperature {base['sampler_temperature']:g} (loss: {base['temperature']:g})"
                if base.get("sampler_temperature") is not None
                else "",
                f"relative weight noise {base['sampler_noise']:g}" if base["sampler_noise"] else "",
            ],
        )
    )
    out = [
        "",
        f"Simulated sampler mismatch ({sampler}), rollout correction `{base.get('rollout_correction', 'default')}`; "
        "means over every update:",
        "",
        "| algorithm | rollout_kl (k1) | rollout_k3_kl | IS weight mean (min, max) | IS weight ESS "
        "| bounded share | rejected share |",
        "|---|---|---|---|---|---|---|",
    ]
    for a, row in rows.items():
        v = row["values"]
        out.append(
            f"| {a} | {cell(v['rollout_kl'], 5)} | {cell(v['rollout_k3_kl'], 5)} "
            f"| {_fmt(_mean(v['rollout_is_weight_mean']), 3)} ({_fmt(_mean(v['rollout_is_weight_min']), 3)}, "
            f"{_fmt(_mean(v['rollout_is_weight_max']), 3)}) | {cell(v['rollout_is_ess'], 4)} "
            f"| {cell(v['rollout_is_bounded_frac'], 3)} | {cell(v['rollout_rejected_frac'], 3)} |"
        )
    return out


def read_length(rows: dict[str, dict]) -> str:
    """Whether the effects of the OpenR1 article appeared: the sample-level loss lengthening
    responses while token-level GRPO keeps them short."""
    if "sample_grpo" not in rows or "grpo" not in rows:
        return f"The comparison of {OPENR1_ARTICLE} needs both grpo and sample_grpo in the run; it was not made here."
    s, g = rows["sample_grpo"]["values"], rows["grpo"]["values"]
    s0, s1, g0, g1 = _mean(s["length_start"]), _mean(s["length_end"]), _mean(g["length_start"]), _mean(g["length_end"])
    ds, dg = s1 - s0, g1 - g0
    lengthened = ds > 0.5 and min(s["length_end"]) > max(g["length_end"])
    text = (
        f"sample_grpo's responses went from {s0:.2f} to {s1:.2f} tokens ({ds:+.2f}), grpo's from {g0:.2f} to "
        f"{g1:.2f} ({dg:+.2f}); at the end the seeds span {min(s['length_end']):.2f}-{max(s['length_end']):.2f} "
        f"for sample_grpo and {min(g['length_end']):.2f}-{max(g['length_end']):.2f} for grpo. "
    )
    pad, direct = _mean(s["reward_scratchpad_start"]), _mean(s["reward_direct_start"])
    text += (
        f"At the start, {_mean(s['scratchpad_start']):.0%} of the responses wrote a scratchpad; those earned "
        f"{pad:.3f} on average and the direct answers {direct:.3f}, so the reward itself favoured "
        f"{'long' if pad > direct else 'short'} responses. At the end {_mean(s['scratchpad_end']):.0%} "
        f"(sample_grpo) and {_mean(g['scratchpad_end']):.0%} (grpo) wrote one. "
    )
    if lengthened and dg <= 0.5:
        text += "The article's effect appeared: the sample-level loss lengthened responses, token-level GRPO kept them short."
    elif lengthened:
        text += (
            "The sample-level loss ended longer than token-level GRPO, but GRPO's responses grew too, so only "
            "half of the article's effect appeared."
        )
    else:
        text += (
            "The article's effect did not appear at this scale: the sample-level loss did not end with clearly "
            "(every seed) longer responses than token-level GRPO."
        )
    return text


def unfinished(runs: list[dict]) -> list[str]:
    """One line per run that did not finish, saying why."""
    steps = lambda r: f"after {r['steps_done']} of {r['steps']} steps"  # noqa: E731
    reasons = {
        "failed": lambda r: f"failed {steps(r)}: {r['error']} (traceback in `errors.log`)",
        "interrupted": lambda r: (
            f"interrupted {steps(r)}" + (" (its steps are in `metrics.jsonl`)" if r["steps_done"] else "")
        ),
        "not started": lambda r: "not started",
    }
    return [f"- {r['algorithm']}, seed {r['seed']}: {reasons[r['status']](r)}" for r in runs if r["status"] in reasons]


def write_report(out: Path, runs: list[dict], config: dict, plots: list[Path], title: str = "comparison") -> Path:
    """Write ``report.md`` for `runs` (dicts with algorithm, seed, status, steps_done, error, metrics;
    only finished runs enter the tables and plots) into `out`, titled "pgloss lab: `title`";
    returns its path."""
    base = config["base"]
    window = tail(base["steps"])
    finished = [r for r in runs if r["status"] == "finished"]
    rows = summarize([m for r in finished for m in r["metrics"]], window)
    lost = unfinished([{**r, "steps": base["steps"], "steps_done": min(r["steps_done"], base["steps"])} for r in runs])
    lines = [
        f"# pgloss lab: {title}",
        "",
        f"Command: `{config['command']}`",
        "",
        f"pgloss {config['versions']['pgloss']}, torch {config['versions']['torch']}, git "
        f"{config['versions']['git'] or 'unknown'}"
        + (f", on {config['versions']['machine']}" if config["versions"].get("machine") else "")
        + (f"; warm starts {config['warm_start']}" if config.get("warm_start") else "")
        + ". Full config: `config.json`.",
        "",
    ]
    if lost:
        status = "was interrupted" if config.get("status") == "interrupted" else "did not finish every run"
        lines += [
            f"**This {title} {status}: {len(finished)} of {len(runs)} runs "
            "finished.** The tables and "
            "plots show the finished runs only.",
            "",
        ]
        resume = resume_command(config, out) if config.get("status") == "interrupted" else None
        if resume and config.get("command", "").startswith(("pgloss train", "pgloss compare")):
            lines += [f"Continue it, each run from its last checkpoint: `{resume}`", ""]
        lines += [
            *lost,
            "",
        ]
    lines += [
        f"Task `{base['task']}`, {base['steps']} RL steps of {base['prompts_per_step']} prompts x {base['group_size']} "
        f"completions, {base['epochs']} epochs x {base['minibatches']} minibatches per batch, seeds {config['seeds']}.",
        "",
        "Windows: *warm start* and *step 0* are the warm-start policy before any update; *"
        f"{last(window)}* is "
        + (
            "the final policy's rollout; "
            if window == 1
            else f"the mean of the last {window} steps (the final policy's rollout and the {window - 1} before it); "
        )
        + "the *update diagnostics* are means over every update of the run. *Eval reward* is the sampled reward on "
        f"{base['eval_prompts']} fixed held-out prompts x {base['group_size']} samples, drawn with the same random "
        "numbers for the warm-start policy and the final one: a seed beats its warm start when it rises. *Train "
        "reward* is the sampled reward of each step's fresh prompts; greedy accuracy is on the held-out prompts. "
        "Lengths count response tokens, the end token included. Each cell is the mean over seeds, then "
        + (
            "each seed's value in parentheses."
            if max((len(r["seeds"]) for r in rows.values()), default=0) <= SEEDS_LISTED
            else "± the half-width of its 95% Student-t interval over the seeds (mean ± t·sd/√n)."
        ),
        "",
        "## Summary",
        "",
    ]
    if rows:
        lines += [tables(rows, window), *read_kept(rows, base), *mismatch_table(rows, base), ""]
    else:
        lines += ["No run finished.", ""]
    lines += ["## Curves", "", *[f"![{p.stem}]({p.name})" for p in plots], ""]
    if rows:
        lines += [
            f"## Reading the curves (clip fraction against KL, after {VERL_ARTICLE})",
            "",
            f"Rules: clip fraction >= {HIGH_CLIP} with ppo_kl >= {HIGH_PPO_KL} means steps too large; >= {HIGH_CLIP} "
            f"with lower ppo_kl means too much reuse of the batch; < {LOW_CLIP} means steps too small. They assume "
            "a token ratio clipped near 1 ± 0.2 and are not applied where the clip means something else (GSPO's "
            "narrow sequence band, CISPO's clipped weight, SAPO's soft gate).",
            "",
            *[read_clipping(a, r, _algorithm(a, config)) for a, r in rows.items()],
            "",
            f"## Response length ({OPENR1_ARTICLE})",
            "",
            read_length(rows),
            "",
        ]
    lines += [
        "## Samples",
        "",
        "See `samples.md` for completions at the start and at the end of every finished run.",
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
        for (prompt, start, r0), (_, end, r1) in zip(run["start"], run["end"], strict=True):
            lines.append(f"| `{prompt}` | `{start}` ({r0:g}) | `{end}` ({r1:g}) |")
        lines.append("")
    path = out / "samples.md"
    path.write_text("\n".join(lines))
    return path
