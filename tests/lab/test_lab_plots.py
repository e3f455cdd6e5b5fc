"""The plots with every algorithm: a readable overview, small multiples whose title covers nothing,
whole steps on the axis of a short run. Synthetic records, so no training is needed."""

import random

import pytest

import pgloss

matplotlib = pytest.importorskip("matplotlib", reason="the lab's plots need matplotlib (the lab extra)")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 (after the backend is chosen)

from pgloss.lab import plots  # noqa: E402 (plots imports matplotlib)


def _records(names, steps=2):
    rng = random.Random(0)
    return [
        {
            "algorithm": a,
            "seed": 0,
            "step": s,
            "reward": 0.4 + 0.01 * k * s + 0.01 * rng.random(),
            "accuracy": 0.5,
            "length": 6.0,
            "entropy": 0.4,
            "kl_ref": 0.01,
            "kept": 1.0,
            "clip_frac": None if s == steps else 0.01,
            "clip_frac_high": None if s == steps else 0.004,
            "clip_frac_low": None if s == steps else 0.006,
            "ppo_kl": None if s == steps else 0.002,
            "grad_norm": None if s == steps else 0.5,
            "eval_reward": 0.5 + 0.01 * k if s in (0, steps) else None,
        }
        for k, a in enumerate(names)
        for s in range(steps + 1)
    ]


def _drawn(tmp_path, monkeypatch, names):
    figures = {}
    monkeypatch.setattr(plt, "close", lambda fig: figures.setdefault(len(figures), fig))
    paths = plots.plot_all(_records(names), tmp_path, max_grad_norm=1.0)
    return dict(zip([p.stem for p in paths[1:]] + ["curves"], figures.values(), strict=True))


def test_every_algorithm_stays_readable(tmp_path, monkeypatch):
    names = pgloss.names()
    assert len(names) > plots.FEW
    figures = _drawn(tmp_path, monkeypatch, names)
    reward = figures["curves"].axes[0]
    coloured = [line for line in reward.get_lines() if line.get_color() != "0.8" and line.get_linestyle() != "None"]
    grey = [line for line in reward.get_lines() if line.get_color() == "0.8"]
    assert len(coloured) == plots.FEW and len(grey) == len(names) - plots.FEW
    assert len({line.get_color() for line in coloured}) == plots.FEW  # no colour used twice
    legend = [t.get_text() for t in figures["curves"].legends[0].get_texts()]
    assert legend == names[::-1][: plots.FEW]  # the highest final eval reward: the last names here

    fig = figures["reward"]  # small multiples: the figure's title ends above the first row's titles
    renderer = fig.canvas.get_renderer()
    title_bottom = fig._suptitle.get_window_extent(renderer).y0
    first_row_top = max(ax.title.get_window_extent(renderer).y1 for ax in fig.axes if ax.get_visible())
    assert title_bottom > first_row_top


def test_a_short_run_has_whole_steps(tmp_path, monkeypatch):
    figures = _drawn(tmp_path, monkeypatch, ["grpo", "dapo"])
    for fig in figures.values():
        for ax in fig.axes:
            if ax.get_visible():
                ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
                assert ticks and all(float(t).is_integer() for t in ticks), ticks
