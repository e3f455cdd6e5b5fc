"""The distillation experiment's report: the students' curves against their teachers, the table, the verdicts.

A table cell is the interval over seeds (claims.py) of one number per seed: step 0 (the warm start,
the same for every student of a seed), the mean of steps 1-`EARLY` (how fast), the mean of the last
`window` steps (how far). "Steps to the teacher" is the first step at which a student's reward,
averaged over a centred window of `SMOOTH` steps, reaches its teacher's final reward (the mean of the
teacher's last `window` steps).
"""

from __future__ import annotations

import math
from pathlib import Path

from .claims import Claim, fmt, interval, interval_curve, run_mean, verdict, window_mean
from .distill import STUDENTS, TEACHER

SOURCE = "On-Policy Distillation (Thinking Machines Lab, 2025)"
IW_OPD = "On the Position Bias of On-Policy Distillation (arXiv 2606.22600)"
CLAIMS = (
    Claim(
        SOURCE,
        "on-policy distillation brings the student's reverse KL to the teacher down faster than RL on "
        "the task's reward",
        "kl_teacher",
        "opd",
        "grpo",
        -1,
        "nats/token",
    ),
    Claim(
        SOURCE,
        "on-policy distillation raises the reward faster than RL on the task's reward",
        "reward",
        "opd",
        "grpo",
        +1,
        "reward",
    ),
    Claim(
        SOURCE,
        "the teacher's per-token grade added to the task's reward lowers the reverse KL to the teacher "
        "faster than the reward alone",
        "kl_teacher",
        "opd+reward",
        "grpo",
        -1,
        "nats/token",
    ),
    Claim(
        IW_OPD,
        "IW-OPD's position weights bring the reverse KL to the teacher down faster than on-policy "
        "distillation's uniform token mean",
        "kl_teacher",
        "iw_opd",
        "opd",
        -1,
        "nats/token",
    ),
    Claim(
        IW_OPD, "IW-OPD raises the reward faster than on-policy distillation", "reward", "iw_opd", "opd", +1, "reward"
    ),
)
EARLY = 10
"""The first RL steps, whose mean reward says how fast a student learns."""
SMOOTH = 5
"""Steps in the centred moving average of each seed's curve."""


def teacher_reward(runs: dict, seed: int, window: int) -> float:
    """The teacher's final reward of `seed`: the mean of its last `window` steps (NaN without its run)."""
    records = runs.get((TEACHER, seed))
    if records is None:
        return math.nan
    last = records[-1]["step"]
    return window_mean(records, "reward", range(last - window + 1, last + 1))


def steps_to_teacher(records: list[dict], target: float) -> int | None:
    """The first step whose centred `SMOOTH`-step mean reward reaches `target`; None if none does."""
    for r in records:
        step = r["step"]
        if window_mean(records, "reward", range(step - SMOOTH // 2, step + SMOOTH // 2 + 1)) >= target:
            return step
    return None


def summary_rows(runs: dict, labels: list[str], window: int) -> list[dict]:
    """Per run label: its measures with their intervals over seeds."""
    rows = []
    for label in labels:
        seeds = sorted(s for (name, s) in runs if name == label)
        if not seeds:
            continue
        row = {"label": label, "seeds": len(seeds)}
        for key in ("reward", "kl_teacher", "accuracy"):
            start, early, end = [], [], []
            for s in seeds:
                records = runs[(label, s)]
                last = records[-1]["step"]
                start.append(window_mean(records, key, range(1)))
                early.append(window_mean(records, key, range(1, EARLY + 1)))
                end.append(window_mean(records, key, range(last - window + 1, last + 1)))
            row[key] = (interval(start), interval(early), interval(end))
        reached = [steps_to_teacher(runs[(label, s)], teacher_reward(runs, s, window)) for s in seeds]
        row["reached"] = [r for r in reached if r is not None]
        rows.append(row)
    return rows


def plot(runs: dict, labels: list[str], out: Path, window: int) -> Path:
    """distill.png in `out`: the students' reward (the teachers' final reward dashed) and reverse KL to the teacher."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..lab.plots import styles

    style = styles(labels)
    fig, axes = plt.subplots(1, 2, figsize=(12.6, 3.8))
    for label in labels:
        color, ls, _ = style[label]
        for ax, key in zip(axes, ("reward", "kl_teacher"), strict=True):
            interval_curve(ax, runs, label, key, SMOOTH, color=color, ls=ls)
    seeds = sorted(s for (name, s) in runs if name == TEACHER)
    if seeds:
        mean = sum(teacher_reward(runs, s, window) for s in seeds) / len(seeds)
        axes[0].axhline(mean, color="black", ls="--", lw=1, label=f"teachers' final reward ({mean:.3f})")
    axes[0].set_title(f"sampled reward (mean of {SMOOTH} steps, 95% CI over seeds)", fontsize=10)
    axes[1].set_title("reverse KL to the teacher per token (k3, on the student's samples)", fontsize=10)
    axes[1].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[0].legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path = out / "distill.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def write_report(
    runs: dict,
    labels: list[str],
    out: Path,
    *,
    command: str,
    seconds: float | None,
    window: int,
    caveat: str | None = None,
    teacher: str = "GRPO from the same warm start",
) -> Path:
    """report.md (table, verdicts, plot) in `out`; returns its path. `caveat`: a line that says the runs are
    a check, not a result; `teacher`: what the teacher is."""
    students = [label for label in labels if label in STUDENTS]
    image = plot(runs, students, out, window)
    rows = summary_rows(runs, [TEACHER, *students], window)
    lines = [
        "# The distillation experiment",
        "",
        f"Command: `{command}`" + (f" ({seconds / 60:.1f} min)" if seconds else ""),
        "",
        *([f"**{caveat}**", ""] if caveat else []),
        f"Step 0 is the warm start (every run of a seed starts there); early: the mean of steps 1-{EARLY}; end: "
        f"the mean of the last {window} steps; ± the 95% interval over seeds. The teacher is {teacher}; its KL "
        "column is to itself, 0 by definition, and not shown.",
        "",
        "| run | seeds | reward: start → early → end | reverse KL to the teacher: start → early → end | "
        "greedy accuracy: start → end | steps to the teacher's reward |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:

        def arrow(key, digits=3, early=True, row=row):
            start, mid, end = row[key]
            return " → ".join(fmt(v, digits) for v in ((start, mid, end) if early else (start, end)))

        kl = "-" if row["label"] == TEACHER else arrow("kl_teacher")
        reached = row["reached"]
        to_teacher = (
            "-"
            if row["label"] == TEACHER
            else (
                f"{sum(reached) / len(reached):.1f} ({len(reached)} of {row['seeds']} seeds)"
                if reached
                else f"not within the run (0 of {row['seeds']})"
            )
        )
        lines.append(
            f"| {row['label']} | {row['seeds']} | {arrow('reward')} | {kl} | {arrow('accuracy', early=False)} "
            f"| {to_teacher} |"
        )
    lines += [
        "",
        "## Claims",
        "",
        "Paired by seed: the mean over the student's RL steps minus step 0 (how fast) under the first run "
        "minus under the second, its 95% interval over seeds and the verdict it gives; the last column "
        f"compares the end (the last {window} steps) instead.",
        "",
        "| source | claim | predicts | over the run (95% CI) | verdict | at the end (95% CI) |",
        "|---|---|---|---|---|---|",
    ]
    for claim in CLAIMS:
        whole = verdict(claim, runs, window, measure=run_mean)
        end = verdict(claim, runs, window)
        if whole is None or end is None:  # None alike: no seed ran both
            continue
        if caveat:
            whole, end = (
                {**x, "verdict": f"(would read: {x['verdict']}; not a result at this scale)"} for x in (whole, end)
            )
        side = ">" if claim.sign > 0 else "<"
        lines.append(
            f"| {claim.source} | {claim.statement} | {claim.key}({claim.a}) - {claim.key}({claim.b}) {side} 0 "
            f"| {whole['mean']:+.3f} [{whole['low']:+.3f}, {whole['high']:+.3f}] {claim.unit}, "
            f"{whole['seeds']} seeds | {whole['verdict']} | {end['mean']:+.3f} [{end['low']:+.3f}, "
            f"{end['high']:+.3f}]: {end['verdict']} |"
        )
    lines += ["", f"![distill]({image.name})", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
