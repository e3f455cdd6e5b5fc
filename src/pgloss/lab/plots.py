"""Curves over steps, one line per algorithm (mean over seeds), seeds shaded (min to max).

Every panel has a y-axis label and a legend; the curves are trailing moving averages, and an
update diagnostic is drawn only at steps that made an update. The clip fraction is drawn with
its high and low split on a symmetric log scale, so that 0.001 and 0.3 are both readable. The
held-out eval reward is marked at the first and last step with one marker shape per algorithm,
shifted sideways so that equal values do not hide each other.

matplotlib is imported here, lazily, so that ``import pgloss`` needs only torch.
"""

from __future__ import annotations

from pathlib import Path

# metric -> (title, y-axis label); the overview grid shows them in this order, three per row
PANELS = {
    "reward": ("reward per sampled response (markers: held-out eval reward)", "mean reward"),
    "accuracy": ("greedy accuracy on the held-out prompts", "share correct"),
    "length": ("response length", "tokens per response"),
    "entropy": ("entropy of the sampling policy", "nats per token"),
    "kl_ref": ("KL to the reference (k3)", "nats per token"),
    "kept": ("share of the batch trained on (1 without dynamic sampling)", "share of responses"),
    "clip_frac": ("clip fraction: all (solid), high (dashed), low (dotted)", "share of tokens (symlog)"),
    "ppo_kl": ("ppo_kl: mean of log π_old - log π_θ over the update", "nats per token"),
    "grad_norm": ("gradient norm before clipping", "L2 norm"),
}
# drawn only when the run simulates a mismatched sampler (``--sampler-noise``, ``--sampler-temperature``)
MISMATCH_PANELS = {
    "rollout_kl": ("sampler mismatch: KL(π_rollout‖π_old) (k1)", "nats per token"),
    "rollout_is_ess": ("rollout correction: effective sample size of its weight", "ESS / n"),
}
CLIP_PARTS = {"clip_frac": "-", "clip_frac_high": "--", "clip_frac_low": ":"}
MARKERS = "osD^vP*Xh<>p"
SMOOTH = 5


def plot_names(mismatch: bool = False) -> list[str]:
    """The stems of the PNG files `plot_all` writes."""
    return ["curves", *_panels(mismatch)]


def _panels(mismatch: bool) -> dict[str, tuple[str, str]]:
    return {**PANELS, **MISMATCH_PANELS} if mismatch else PANELS


def _smooth(values: list, window: int) -> list[float]:
    """Trailing moving average (step i averages steps i-window+1..i, ignoring missing values);
    NaN where the step itself has no value."""
    out = []
    for i, value in enumerate(values):
        part = [v for v in values[max(0, i - window + 1): i + 1] if v is not None and v == v]
        out.append(sum(part) / len(part) if part and value is not None and value == value else float("nan"))
    return out


def curves(records: list[dict]) -> dict[str, dict[str, list[list]]]:
    """{metric: {algorithm: [per-seed list of values by step]}} for every metric drawn."""
    table: dict[str, dict[str, dict[int, list]]] = {}
    for r in sorted(records, key=lambda r: r["step"]):
        for metric in dict.fromkeys((*PANELS, *MISMATCH_PANELS, *CLIP_PARTS)):
            table.setdefault(metric, {}).setdefault(r["algorithm"], {}).setdefault(r["seed"], []).append(r.get(metric))
    return {m: {a: list(seeds.values()) for a, seeds in algs.items()} for m, algs in table.items()}


def _band(seeds: list[list], smooth: int) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps, mean, min and max over seeds of the smoothed curves (NaN where a seed has no value)."""
    runs = [_smooth(s, smooth) for s in seeds]
    steps = list(range(min(len(s) for s in runs)))
    mean, low, high = [], [], []
    for i in steps:
        column = [run[i] for run in runs if run[i] == run[i]]
        mean.append(sum(column) / len(column) if column else float("nan"))
        low.append(min(column) if column else float("nan"))
        high.append(max(column) if column else float("nan"))
    return steps, mean, low, high


def plot_all(records: list[dict], out: Path, smooth: int = SMOOTH, max_grad_norm: float | None = None,
             mismatch: bool = False) -> list[Path]:
    """Write one PNG per panel of ``PANELS`` (and ``MISMATCH_PANELS`` when `mismatch`) and the overview
    grid ``curves.png``; returns the paths (the grid first). `max_grad_norm` draws the gradient
    clipping threshold."""
    panels = _panels(mismatch)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(records)
    algorithms = list(data["reward"])
    colors = {a: (f"C{k}" if len(algorithms) <= 10 else plt.get_cmap("tab20")(k % 20)) for k, a in enumerate(algorithms)}
    last = max(r["step"] for r in records)
    evals: dict[str, list[tuple[float, float]]] = {}
    for k, algorithm in enumerate(algorithms):  # mean eval reward over seeds, shifted sideways per algorithm
        shift = (k - (len(algorithms) - 1) / 2) * max(last, 1) * 0.012
        for step in sorted({r["step"] for r in records if r["algorithm"] == algorithm and r.get("eval_reward") is not None}):
            values = [r["eval_reward"] for r in records if r["algorithm"] == algorithm and r["step"] == step
                      and r.get("eval_reward") is not None]
            evals.setdefault(algorithm, []).append((step + shift, sum(values) / len(values)))

    def line(ax, algorithm, seeds, style="-", label=None):
        steps, mean, low, high = _band(seeds, smooth)
        ax.plot(steps, mean, color=colors[algorithm], ls=style, lw=1.5, label=label)
        if len(seeds) > 1 and style == "-":  # the seeds' spread of the main line only
            ax.fill_between(steps, low, high, color=colors[algorithm], alpha=0.15, lw=0)

    def draw(ax, metric):
        for k, algorithm in enumerate(algorithms):
            if metric == "clip_frac":
                drawn = any(v is not None for s in data["clip_frac"][algorithm] for v in s)
                for part, style in CLIP_PARTS.items():
                    line(ax, algorithm, data[part][algorithm], style, (algorithm if drawn else f"{algorithm}: no clipping")
                         if part == "clip_frac" else None)
            else:
                line(ax, algorithm, data[metric][algorithm], label=algorithm)
            if metric == "reward" and algorithm in evals:
                ax.plot(*zip(*evals[algorithm]), ls="none", marker=MARKERS[k % len(MARKERS)], ms=6, mfc="white",
                        mew=1.4, color=colors[algorithm], zorder=5)
        if metric == "clip_frac":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)  # the title says which line style is which part
        if metric == "grad_norm" and max_grad_norm is not None:
            ax.axhline(max_grad_norm, color="black", lw=0.8, ls="--", label=f"clipped above {max_grad_norm:g}")
        ax.legend(fontsize=7, ncol=2 if len(algorithms) > 6 else 1, loc="best")
        ax.set_xlabel("RL step")
        ax.set_ylabel(panels[metric][1])
        ax.set_title(panels[metric][0], fontsize=10)
        ax.grid(alpha=0.3)

    note = f"mean over seeds (shaded: min to max), trailing {smooth}-step moving average"
    paths = []
    for metric in panels:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        draw(ax, metric)
        fig.text(0.99, 0.005, note, ha="right", va="bottom", fontsize=7, color="gray")
        fig.subplots_adjust(left=0.12, right=0.97, bottom=0.14, top=0.92)  # fixed margins: tight_layout is slow
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(17, 4.6 * rows))
    for ax, metric in zip(axes.flat, panels):
        draw(ax, metric)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(note, fontsize=10)
    fig.subplots_adjust(left=0.05, right=0.985, bottom=0.05, top=0.94, wspace=0.22, hspace=0.32)
    path = out / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path, *paths]
