"""The length experiment's report: curves with 95% intervals over seeds, the table, the verdicts.

Every interval is a Student-t interval over seeds of one number per seed (a curve: per step; a table
cell: the run's mean over its last `window` steps); the claims are paired comparisons (claims.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

from .claims import Claim, fmt, growth, interval, interval_curve, nanmean, run_mean, scale_caveat, verdict, window_mean
from .length import LENGTH_BINS, LengthExperiment

CLAIMS: tuple[Claim, ...] = (
    Claim(
        "OpenR1 in practice (6): sample-level vs token-level loss (2025-06-04)",
        "the sample-level loss lengthens responses more than GRPO's per-sequence token mean",
        "length",
        "sample_grpo",
        "grpo",
        +1,
        "tokens",
    ),
    Claim(
        "OpenR1 in practice (6): sample-level vs token-level loss (2025-06-04)",
        "BNPO's token mean lengthens responses more than GRPO's per-sequence token mean",
        "length",
        "bnpo",
        "grpo",
        +1,
        "tokens",
    ),
    Claim(
        "OpenR1 in practice (6): sample-level vs token-level loss (2025-06-04)",
        "the sample-level loss brings more repetition (rep-4 of the traces) than GRPO",
        "rep4",
        "sample_grpo",
        "grpo",
        +1,
        "rep-4",
    ),
    Claim(
        "Dr.GRPO (arXiv 2503.20783, sec. 3.1)",
        "GRPO's 1/length lets wrong answers grow longer than Dr.GRPO's constant divisor does",
        "length_wrong",
        "grpo",
        "dr_grpo",
        +1,
        "tokens",
    ),
    Claim(
        "Dr.GRPO (arXiv 2503.20783, sec. 3.1)",
        "GRPO's 1/length keeps right answers shorter than Dr.GRPO's constant divisor does",
        "length_right",
        "grpo",
        "dr_grpo",
        -1,
        "tokens",
    ),
)
CONTROL = "grpo:kl_coef=0"
"""GRPO without its KL term (kl_coef 0.04 in the paper, 0 in the other losses here): run beside the
others, it separates the aggregation's effect from the KL term's. Each claim about `grpo` is also
stated against it when its runs are present."""
CLAIMS = CLAIMS + tuple(
    dataclasses.replace(c, a=CONTROL if c.a == "grpo" else c.a, b=CONTROL if c.b == "grpo" else c.b) for c in CLAIMS
)


def summary_rows(runs: dict, algorithms: list[str], window: int) -> list[dict]:
    """Per algorithm: start and end means of each measure with their intervals over seeds."""
    rows = []
    for a in algorithms:
        seeds = sorted(s for (name, s) in runs if name == a)
        if not seeds:
            continue
        row = {"algorithm": a, "seeds": len(seeds)}
        row["growth"] = interval([growth(runs[(a, s)], "length") for s in seeds])
        row["growth_end"] = interval([growth(last_quarter(runs[(a, s)]), "length") for s in seeds])
        # the entropy coefficient the loss applied (fixed, or steered to a target): mean over the updates
        row["entropy_coef"] = interval(
            [window_mean(runs[(a, s)], "entropy_coef", range(runs[(a, s)][-1]["step"])) for s in seeds]
        )
        for key in ("reward", "length", "length_right", "length_wrong", "rep4", "entropy", "truncated"):
            starts, ends = [], []
            for s in seeds:
                records = runs[(a, s)]
                last = records[-1]["step"]
                starts.append(window_mean(records, key, range(1)))
                ends.append(window_mean(records, key, range(last - window + 1, last + 1)))
            row[key] = (interval(starts), interval(ends))
        rows.append(row)
    return rows


def last_quarter(records: list[dict]) -> list[dict]:
    """The records of the run's last quarter of steps (its end: is the length still growing there?)."""
    last = records[-1]["step"]
    return [r for r in records if r["step"] >= last - last // 4]


def gradient_by_length(runs: dict, algorithm: str, key: str) -> list[tuple[float, float]]:
    """Per length bin: the interval over seeds of the run's mean gradient weight (`grad_pos` or `grad_neg`)."""
    seeds = sorted(s for (a, s) in runs if a == algorithm)
    out = []
    for b in range(len(LENGTH_BINS)):
        per_seed = [nanmean(r[key][b] for r in runs[(algorithm, s)] if r.get(key)) for s in seeds]
        out.append(interval(per_seed))
    return out


SMOOTH = 5
"""Steps in the moving average of each seed's curve before the interval over seeds is drawn."""


def plot(runs: dict, algorithms: list[str], out: Path) -> list[Path]:
    """The report's PNGs in `out`: reward, lengths of right and wrong answers, repetition, gradient weight by length."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..lab.plots import styles

    style = styles(algorithms)  # a distinct colour and line style per algorithm
    colors = {a: color for a, (color, _, _) in style.items()}
    legend = dict(
        fontsize=7,
        loc="upper left",
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0,
        ncol=1 if len(algorithms) <= 14 else 2,
    )  # beside the data, never over it
    paths = []

    def curves(ax, key: str, title: str) -> None:
        for a in algorithms:
            interval_curve(ax, runs, a, key, SMOOTH, color=colors[a], ls=style[a][1])
        if key in ("rep4", "scratchpad"):  # shares: an interval of few values may reach outside [0, 1]
            ax.set_ylim(0, 1)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)

    for name, panels in (
        ("reward", [("reward", f"sampled reward (mean of {SMOOTH} steps, 95% CI over seeds)")]),
        (
            "length",
            [
                ("length_right", "length of right answers (tokens)"),
                ("length_wrong", "length of wrong answers (tokens)"),
            ],
        ),
        (
            "repetition",
            [
                ("rep4", "repeated 4-grams in the traces (rep-4)"),
                ("scratchpad", "share of responses that write a trace"),
            ],
        ),
        (
            "entropy",
            [
                ("entropy", "entropy of the sampling policy (nats per token)"),
                ("entropy_coef", "entropy coefficient the loss applied"),
            ],
        ),
    ):
        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels) + 2.2, 3.6), squeeze=False)
        for ax, (key, title) in zip(axes[0], panels, strict=True):
            curves(ax, key, title)
        axes[0][-1].legend(**legend)
        fig.tight_layout()
        paths.append(out / f"length_{name}.png")
        fig.savefig(paths[-1], dpi=90)
        plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(12.6, 3.6), sharey=True)
    centers = list(range(len(LENGTH_BINS)))
    labels = [f"{lo}-{hi - 1}" for lo, hi in itertools.pairwise(LENGTH_BINS)] + [f"{LENGTH_BINS[-1]}+"]
    for ax, key, title in ((axes[0], "grad_pos", "Â > 0"), (axes[1], "grad_neg", "Â < 0")):
        positive = False
        for k, a in enumerate(algorithms):
            if not any(name == a for name, _ in runs):
                continue
            stats = gradient_by_length(runs, a, key)
            positive = positive or any(m > 0 for m, _ in stats)
            shift = (k - (len(algorithms) - 1) / 2) * min(0.12, 0.7 / len(algorithms))
            half = [0.0 if math.isnan(h) else h for _, h in stats]
            ax.errorbar(
                [c + shift for c in centers],
                [m for m, _ in stats],
                yerr=[[min(h, m) if m == m else 0.0 for (m, _), h in zip(stats, half, strict=True)], half],
                fmt=style[a][2],
                ls=style[a][1],
                ms=3,
                lw=1,
                capsize=2,
                color=colors[a],
                label=a,
            )
        ax.set_xticks(centers, labels)
        if positive:  # the weights span decades; an empty panel (no such response) stays linear
            ax.set_yscale("log")
        ax.set_xlabel("response length (tokens)")
        ax.set_title(f"per-token gradient weight |∂L/∂log π|·N, {title}", fontsize=10)
        ax.grid(alpha=0.3)
    axes[1].legend(**legend)
    fig.tight_layout()
    paths.append(out / "length_gradient.png")
    fig.savefig(paths[-1], dpi=90)
    plt.close(fig)
    return paths


def write_report(
    runs: dict, algorithms: list[str], out: Path, *, command: str, seconds: float | None, window: int, design=None
) -> Path:
    """report.md with the table, the verdicts and the plots, in `out`; returns its path. `design` is the
    experiment the runs belong to (its seeds and steps decide whether they are a check run)."""
    plots = plot(runs, algorithms, out)
    rows = summary_rows(runs, algorithms, window)
    caveat = scale_caveat(runs, LengthExperiment() if design is None else design)
    lines = [
        "# The length experiment",
        "",
        f"Command: `{command}`" + (f" ({seconds / 60:.1f} min)" if seconds else ""),
        "",
        *([f"**{caveat}**", ""] if caveat else []),
        f"Start: step 0 (the warm-start policy); end: mean of the last {window} steps; ± the 95% interval over seeds.",
        "",
        "| algorithm | seeds | reward start → end | length start → end | right answers | wrong answers | "
        "rep-4 start → end | entropy start → end | entropy coefficient (mean) | cut off at end | "
        "length growth (tokens/100 steps) | the same over the last quarter |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:

        def arrow(key, digits=2, row=row):
            start, end = row[key]
            return f"{fmt(start, digits)} → {fmt(end, digits)}"

        lines.append(
            f"| {row['algorithm']} | {row['seeds']} | {arrow('reward')} | {arrow('length', 1)} | "
            f"{arrow('length_right', 1)} | {arrow('length_wrong', 1)} | {arrow('rep4', 3)} | "
            f"{arrow('entropy', 3)} | {fmt(row['entropy_coef'], 4)} | {fmt(row['truncated'][1], 3)} | "
            f"{fmt(row['growth'], 2)} | {fmt(row['growth_end'], 2)} |"
        )
    lines += [
        "",
        "## Claims",
        "",
        "Paired by seed: the change (end minus step 0) under the first algorithm minus under the second, "
        "its 95% interval over seeds, and the verdict it gives. The last column compares the mean over "
        "every RL step instead of the end (how fast, not only how far), as a secondary reading; the growth "
        "column compares the least-squares slope of the measure against the step, per 100 steps.",
        "",
        "| source | claim | predicts | measured at the end (95% CI) | verdict | over the whole run (95% CI) | "
        "growth rate per 100 steps (95% CI) |",
        "|---|---|---|---|---|---|---|",
    ]
    for claim in CLAIMS:
        v = verdict(claim, runs, window)
        whole = verdict(claim, runs, window, measure=run_mean)
        rate = verdict(claim, runs, window, measure=growth)
        if v is None or whole is None or rate is None:  # None alike: no seed ran both algorithms
            continue
        side = ">" if claim.sign > 0 else "<"
        if caveat:  # a verdict of a check run is shown as what it would read, not as a finding
            v, whole, rate = (
                {**x, "verdict": f"(would read: {x['verdict']}; not a result at this scale)"} for x in (v, whole, rate)
            )
        lines.append(
            f"| {claim.source} | {claim.statement} | Δ{claim.key}({claim.a}) - Δ{claim.key}({claim.b}) "
            f"{side} 0 | {v['mean']:+.3f} [{v['low']:+.3f}, {v['high']:+.3f}] {claim.unit}, "
            f"{v['seeds']} seeds | {v['verdict']} | {whole['mean']:+.3f} [{whole['low']:+.3f}, "
            f"{whole['high']:+.3f}]: {whole['verdict']} | {rate['mean']:+.3f} [{rate['low']:+.3f}, "
            f"{rate['high']:+.3f}]: {rate['verdict']} |"
        )
    lines += [""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    path = out / "report.md"
    path.write_text("\n".join(lines))
    return path
