"""Published claims as paired comparisons over seeds: a measure of each run, the difference between two
algorithms per seed (both start from that seed's warm start), its 95% Student-t interval and the verdict.

Every interval is mean ± t_{0.975, n-1}·sd/√n of one number per seed. A claim is reproduced when the
interval of the difference lies on the predicted side of 0, refuted when it lies on the other side, not
resolved when it holds 0. The length and the distillation experiments read their claims with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..lab.intervals import interval


def nanmean(values) -> float:
    values = [v for v in values if v is not None and not math.isnan(v)]
    return sum(values) / len(values) if values else math.nan


def window_mean(records: list[dict], key: str, steps: range) -> float:
    """Mean of `key` over the records of `steps` (None values left out)."""
    return nanmean(r.get(key) for r in records if r["step"] in steps)


@dataclass(frozen=True)
class Claim:
    """A published claim as a paired comparison: `sign` · (Δ_a - Δ_b) > 0 is what it predicts."""

    source: str
    statement: str
    key: str
    a: str
    b: str
    sign: int
    unit: str


def change(records: list[dict], key: str, window: int) -> float:
    """End minus start of `key` in one run: the mean over the last `window` steps minus step 0's value
    (the warm-start policy, the same for every algorithm of a seed)."""
    last = records[-1]["step"]
    return window_mean(records, key, range(last - window + 1, last + 1)) - window_mean(records, key, range(1))


def run_mean(records: list[dict], key: str) -> float:
    """Mean of `key` over the RL steps (1 to the last) minus step 0's: the area between the curve and its start."""
    return window_mean(records, key, range(1, records[-1]["step"] + 1)) - window_mean(records, key, range(1))


def growth(records: list[dict], key: str) -> float:
    """The growth rate of `key` in one run, per 100 steps: 100 times the least-squares slope of its
    values against the step over every recorded step (0 to the last; None values left out)."""
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None and not math.isnan(r[key])]
    if len(points) < 2:
        return math.nan
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return 100 * sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else math.nan


def verdict(claim: Claim, runs: dict, window: int, measure=change) -> dict | None:
    """The paired difference of the claim's `measure` (by default the end-minus-start change) over the
    seeds both algorithms ran; None if none."""
    seeds = sorted(s for (a, s) in runs if a == claim.a and (claim.b, s) in runs)
    if not seeds:
        return None
    args = (window,) if measure is change else ()
    diffs = [
        measure(runs[(claim.a, s)], claim.key, *args) - measure(runs[(claim.b, s)], claim.key, *args) for s in seeds
    ]
    mean, half = interval(diffs)
    low, high = mean - half, mean + half
    if math.isnan(half):
        result = "not resolved (fewer than two seeds)"
    elif claim.sign * low > 0 and claim.sign * high > 0:
        result = "reproduced"
    elif claim.sign * low < 0 and claim.sign * high < 0:
        result = "refuted (the opposite holds)"
    else:
        result = "not resolved at this scale"
    return {"claim": claim, "seeds": len(seeds), "mean": mean, "low": low, "high": high, "verdict": result}


def fmt(pair: tuple[float, float], digits: int = 2) -> str:
    mean, half = pair
    if math.isnan(mean):
        return "-"
    return f"{mean:.{digits}f}" + ("" if math.isnan(half) else f" ± {half:.{digits}f}")


def interval_curve(ax, runs: dict, label: str, key: str, smooth: int, **style) -> None:
    """Draw `key` of `label`'s runs against the step on `ax`: each seed's values averaged over a centred
    window of `smooth` steps, then their mean over seeds with its 95% interval shaded (never below 0:
    every measure drawn this way is >= 0). Nothing when `label` has no run."""
    seeds = sorted(s for (name, s) in runs if name == label)
    if not seeds:
        return
    steps = [r["step"] for r in runs[(label, seeds[0])]]
    stats = [
        interval([window_mean(runs[(label, s)], key, range(step - smooth // 2, step + smooth // 2 + 1)) for s in seeds])
        for step in steps
    ]
    mean = [m for m, _ in stats]
    half = [0.0 if math.isnan(h) else h for _, h in stats]
    ax.plot(steps, mean, label=f"{label} (n={len(seeds)})", lw=1.4, **style)
    ax.fill_between(
        steps,
        [max(0.0, m - h) for m, h in zip(mean, half, strict=True)],
        [m + h for m, h in zip(mean, half, strict=True)],
        color=style.get("color"),
        alpha=0.15,
        lw=0,
    )


def scale_caveat(runs: dict, design) -> str | None:
    """A warning when the runs are smaller than the experiment's `design` (its ``seeds`` and ``steps``):
    their intervals are wide and their verdicts are no result (``--quick`` checks that it all runs)."""
    seeds = max((sum(1 for (b, _) in runs if b == a) for a, _ in runs), default=0)
    steps = max((records[-1]["step"] for records in runs.values()), default=0)
    if seeds >= design.seeds and steps >= design.steps:
        return None
    return (
        f"A check run, not a result: {seeds} seed{'s' if seeds != 1 else ''} x {steps} steps against the "
        f"experiment's {design.seeds} x {design.steps}. With so few seeds and steps the intervals are wide and "
        "the verdicts below say only what the numbers would read; docs/experiments.md has the full run."
    )
