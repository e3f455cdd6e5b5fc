"""Curves over steps, one line per algorithm (mean over seeds), seeds shaded (min to max).

Every panel has a y-axis label and a legend outside the data; each algorithm has its own colour
and line style (`styles`), and with more than `FEW` algorithms each panel's PNG shows small
multiples, one plot per algorithm with the others in grey, so that 25 stay readable; the overview
``curves.png`` then draws the `FEW` with the highest final eval reward in colour and the rest in grey.
Steps are whole numbers on every axis. The curves
are trailing moving averages, and an update diagnostic is drawn only at steps that made an update.
The clip fraction is drawn with its high and low split on a symmetric log scale, so that 0.001
and 0.3 are both readable. The held-out eval reward is marked at the first and last step with one
marker shape per algorithm, shifted sideways so that equal values do not hide each other.

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
LINESTYLES = ("-", "--", "-.", ":")
SMOOTH = 5
FEW = 6  # up to this many algorithms a panel is one plot; beyond, small multiples


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
        part = [v for v in values[max(0, i - window + 1) : i + 1] if v is not None and v == v]
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


def styles(labels: list[str]) -> dict[str, tuple]:
    """A distinct (colour, line style, marker) per algorithm: tab10's ten colours with solid lines,
    then the same colours dashed, dash-dotted, dotted; markers cycle separately. 40 distinct lines."""
    import matplotlib

    palette = matplotlib.colormaps["tab10"]
    return {
        a: (palette(k % 10), LINESTYLES[(k // 10) % len(LINESTYLES)], MARKERS[k % len(MARKERS)])
        for k, a in enumerate(labels)
    }


def plot_all(
    records: list[dict], out: Path, smooth: int = SMOOTH, max_grad_norm: float | None = None, mismatch: bool = False
) -> list[Path]:
    """Write one PNG per panel of ``PANELS`` (and ``MISMATCH_PANELS`` when `mismatch`) and the overview
    grid ``curves.png``; returns the paths (the grid first). `max_grad_norm` draws the gradient
    clipping threshold. Up to `FEW` algorithms, a panel is one plot with its legend beside the data;
    beyond, small multiples: one plot per algorithm, the others in grey behind it. The overview has
    one legend for all panels, outside them."""
    panels = _panels(mismatch)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    data = curves(records)
    algorithms = list(data["reward"])
    style = styles(algorithms)
    split_clip = len(algorithms) <= 10  # the clip parts' line styles are free only while every line is solid
    last = max(r["step"] for r in records)
    evals: dict[str, list[tuple[float, float]]] = {}
    for k, algorithm in enumerate(algorithms):  # mean eval reward over seeds, shifted sideways per algorithm
        shift = (k - (len(algorithms) - 1) / 2) * max(last, 1) * (0.012 if len(algorithms) <= FEW else 0.0)
        for step in sorted(
            {r["step"] for r in records if r["algorithm"] == algorithm and r.get("eval_reward") is not None}
        ):
            values = [
                r["eval_reward"]
                for r in records
                if r["algorithm"] == algorithm and r["step"] == step and r.get("eval_reward") is not None
            ]
            evals.setdefault(algorithm, []).append((step + shift, sum(values) / len(values)))

    def line(ax, algorithm, seeds, ls=None, label=None, grey=False, own_style=True):
        steps, mean, low, high = _band(seeds, smooth)
        color, own, _ = style[algorithm]
        if grey:
            ax.plot(steps, mean, color="0.8", lw=0.8, zorder=1)
            return
        ax.plot(steps, mean, color=color, ls=ls or (own if own_style else "-"), lw=1.5, label=label, zorder=3)
        if len(seeds) > 1 and ls is None:  # the seeds' spread of the main line only
            ax.fill_between(steps, low, high, color=color, alpha=0.15, lw=0, zorder=2)

    def draw(ax, metric, shown, grey=(), split=split_clip):
        """`shown` in colour (with labels), `grey` behind them; one algorithm shown alone is drawn solid."""
        own_style = len(shown) > 1
        for algorithm in grey:
            line(ax, algorithm, data[metric][algorithm], grey=True)
        for algorithm in shown:
            if metric == "clip_frac":
                drawn = any(v is not None for s in data["clip_frac"][algorithm] for v in s)
                label = algorithm if drawn else f"{algorithm}: no clipping"
                line(ax, algorithm, data["clip_frac"][algorithm], label=label, own_style=own_style)
                if split:
                    for part in ("clip_frac_high", "clip_frac_low"):
                        line(ax, algorithm, data[part][algorithm], ls=CLIP_PARTS[part])
            else:
                line(ax, algorithm, data[metric][algorithm], label=algorithm, own_style=own_style)
            if metric == "reward" and algorithm in evals:
                ax.plot(
                    *zip(*evals[algorithm], strict=True),
                    ls="none",
                    marker=style[algorithm][2],
                    ms=6,
                    mfc="white",
                    mew=1.4,
                    color=style[algorithm][0],
                    zorder=5,
                )
        if metric == "clip_frac":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)
        if metric == "grad_norm" and max_grad_norm is not None:
            ax.axhline(max_grad_norm, color="black", lw=0.8, ls="--", zorder=4)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps: no 0.5 on a 2-step run
        ax.grid(alpha=0.3)

    def title(metric, split=split_clip):
        text = panels[metric][0]
        if metric == "clip_frac" and not split:
            text = "clip fraction (high and low: clip_frac.png)"
        if metric == "grad_norm" and max_grad_norm is not None:
            text += f" (dashed: clipped above {max_grad_norm:g})"
        return text

    note = f"mean over seeds (shaded: min to max), trailing {smooth}-step moving average"
    paths = []
    for metric in panels:
        if len(algorithms) <= FEW:
            fig, ax = plt.subplots(figsize=(8.4, 4.2))
            draw(ax, metric, algorithms)
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
            ax.set_xlabel("RL step")
            ax.set_ylabel(panels[metric][1])
            ax.set_title(title(metric), fontsize=10)
            fig.subplots_adjust(left=0.09, right=0.76, bottom=0.14, top=0.92)  # fixed margins: tight_layout is slow
            fig.text(0.99, 0.005, note, ha="right", va="bottom", fontsize=7, color="gray")
        else:  # small multiples, every plot on one scale
            cols = 5
            rows = -(-len(algorithms) // cols)
            height = 2.3 * rows + 1.0
            fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, height), sharex=True, sharey=True, squeeze=False)
            for ax, algorithm in zip(axes.flat, algorithms, strict=False):  # the grid's last row may have spare panels
                draw(ax, metric, [algorithm], grey=[a for a in algorithms if a != algorithm], split=True)
                empty = metric == "clip_frac" and not any(v is not None for s in data[metric][algorithm] for v in s)
                ax.set_title(algorithm + (" (no clipping)" if empty else ""), fontsize=9)
            for ax in list(axes.flat)[len(algorithms) :]:
                ax.set_visible(False)
            for ax in axes[:, 0]:
                ax.set_ylabel(panels[metric][1], fontsize=8)
            for ax in axes[-1, :]:
                ax.set_xlabel("RL step", fontsize=8)
            # the two-line title in the top 0.6 inch, the first row's titles below it (margins in inches)
            fig.suptitle(
                f"{title(metric, split=True)}\neach algorithm in colour, the others in grey; {note}",
                fontsize=10,
                y=1 - 0.12 / height,
                va="top",
            )
            fig.subplots_adjust(
                left=0.06, right=0.99, bottom=0.5 / height, top=1 - 1.0 / height, wspace=0.08, hspace=0.35
            )
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=110 if len(algorithms) <= FEW else 80)
        plt.close(fig)
        paths.append(path)
    rows = -(-len(panels) // 3)
    fig, axes = plt.subplots(rows, 3, figsize=(19, 4.6 * rows))
    shown, legend_title = algorithms, "algorithm (markers: eval reward)"
    if len(algorithms) > FEW:  # the best few in colour, the others grey: 33 coloured lines are unreadable
        final = {a: evals[a][-1][1] if a in evals else float("-inf") for a in algorithms}
        shown = sorted(algorithms, key=lambda a: -final[a])[:FEW]
        style.update(styles(shown))  # a few lines: solid, in distinct colours
        legend_title = (
            f"the {FEW} of {len(algorithms)} algorithms with the highest\nfinal eval reward (markers); "
            "the others grey.\nEach one alone: the panel's own PNG"
        )
    for ax, metric in zip(axes.flat, panels, strict=False):  # the grid's last row may have spare panels
        draw(ax, metric, shown, grey=[a for a in algorithms if a not in shown])
        ax.set_xlabel("RL step")
        ax.set_ylabel(panels[metric][1])
        ax.set_title(title(metric), fontsize=10)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    handles, labels = axes.flat[0].get_legend_handles_labels()  # one legend for every panel, outside them
    fig.legend(
        handles,
        labels,
        loc="upper left",
        bbox_to_anchor=(0.865, 0.94),
        fontsize=8,
        ncol=1,
        title=legend_title,
        title_fontsize=8,
    )
    fig.suptitle(note, fontsize=10)
    fig.subplots_adjust(left=0.04, right=0.855, bottom=0.05, top=0.94, wspace=0.22, hspace=0.32)
    path = out / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return [path, *paths]
