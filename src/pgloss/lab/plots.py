"""Curves over steps, one line per algorithm (mean over seeds), seeds shaded (min to max).

matplotlib is imported here, lazily, so that ``import pgloss`` needs only torch.
"""

from __future__ import annotations

from pathlib import Path

PLOTS = {
    "reward": "reward per sampled response (circles: held-out eval reward)",
    "length": "response length (tokens)",
    "entropy": "entropy (nats per token)",
    "clip_frac": "clip fraction",
    "kl_ref": "KL to the reference (k3, per token)",
    "accuracy": "greedy accuracy (held-out prompts)",
}
SMOOTH = 5


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (step i averages steps i-window+1..i), ignoring missing values."""
    out = []
    for i in range(len(values)):
        part = [v for v in values[max(0, i - window + 1): i + 1] if v is not None and v == v]
        out.append(sum(part) / len(part) if part else float("nan"))
    return out


def curves(records: list[dict]) -> dict[str, dict[str, list[list[float]]]]:
    """{metric: {algorithm: [per-seed list of values by step]}}."""
    table: dict[str, dict[str, dict[int, list]]] = {}
    for r in records:
        for metric in PLOTS:
            runs = table.setdefault(metric, {}).setdefault(r["algorithm"], {})
            runs.setdefault(r["seed"], []).append(r.get(metric))
    return {m: {a: list(seeds.values()) for a, seeds in algs.items()} for m, algs in table.items()}


def plot_all(records: list[dict], out: Path, smooth: int = SMOOTH) -> list[Path]:
    """Write one PNG per metric of ``PLOTS`` and an overview grid; returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(records)
    evals: dict[str, list[tuple[int, float]]] = {}
    for step in sorted({r["step"] for r in records}):
        for algorithm in data["reward"]:
            values = [r["eval_reward"] for r in records if r["algorithm"] == algorithm and r["step"] == step
                      and r.get("eval_reward") is not None]
            if values:
                evals.setdefault(algorithm, []).append((step, sum(values) / len(values)))
    paths = []

    def draw(ax, metric):
        for k, (algorithm, seeds) in enumerate(data[metric].items()):
            runs = [_smooth(s, smooth) for s in seeds]
            steps = range(min(len(s) for s in runs))
            cols = [[run[i] for run in runs] for i in steps]
            mean = [sum(c) / len(c) for c in cols]
            color = f"C{k}"
            ax.plot(list(steps), mean, color=color, label=algorithm, lw=1.6)
            if len(runs) > 1:
                ax.fill_between(list(steps), [min(c) for c in cols], [max(c) for c in cols], color=color, alpha=0.18, lw=0)
            if metric == "reward" and algorithm in evals:  # held-out eval reward before and after RL
                ax.plot(*zip(*evals[algorithm]), ls="none", marker="o", ms=6, mfc="white", color=color)
        ax.set_xlabel("RL step")
        ax.set_title(PLOTS[metric], fontsize=10)
        ax.grid(alpha=0.3)

    for metric in PLOTS:
        fig, ax = plt.subplots(figsize=(6, 3.8))
        draw(ax, metric)
        ax.legend(fontsize=8)
        fig.tight_layout()
        path = out / f"{metric}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    for ax, metric in zip(axes.flat, PLOTS):
        draw(ax, metric)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"mean over seeds (shaded: min to max), trailing {smooth}-step moving average", fontsize=10)
    fig.tight_layout()
    path = out / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return [path, *paths]
