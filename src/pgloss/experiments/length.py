"""The length experiment: which losses lengthen responses when length is the policy's free choice?

Published claims under test (docs/experiments.md states each with its prediction and verdict):

- "OpenR1 in practice (6): sample-level vs token-level loss (2025-06-04)": a sample-level loss
  (one whole-sequence ratio per response, ``sample_grpo``) and BNPO's token mean lengthen the
  chain of thought and bring repetition of frequent tokens, while GRPO's per-sequence token
  mean keeps it short.
- Dr.GRPO (Liu et al. 2025, https://arxiv.org/abs/2503.20783, sec. 3.1): GRPO's 1/|y_i| gives a
  long wrong answer a smaller per-token penalty than a short one, so wrong answers grow longer
  (and right ones shorter) than under a constant divisor (``dr_grpo``).

Design: the lab's ``trace`` task (a times table answered after a free-length trace of digits,
lab/tasks.py), a warm start per seed shared by every algorithm of that seed, then RL with each
algorithm from it. Each step records, besides the lab's diagnostics, the mean length of right and
of wrong responses, the repetition of the traces (rep-4, the share of repeated 4-grams) and the
gradient weight g = ∂L/∂log π per token (`pgloss.diagnostics.inspect`) by response length and advantage
sign, at ratio one (the first minibatch of the step is on-policy).

``run`` writes one JSON line per (algorithm, seed, step) into ``OUT/runs/ALGORITHM-SEED.jsonl``
(and each seed's first batch into ``OUT/warm/batch-seedSEED.pt`` and each run's last into
``OUT/runs/ALGORITHM-SEED-end.pt``, for ``pgloss grads --batch``) as it
goes and skips runs already complete, so an interrupted experiment resumes where it stopped;
``length_report`` turns whatever is there into the report.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from .runs import check_counts, execute, lab_settings, run_path, warm_state, write_run

OWN = (
    "runs",
    "warm",
    "experiment.json",
    "seconds.json",
    "report.md",
    "length_reward.png",
    "length_length.png",
    "length_repetition.png",
    "length_entropy.png",
    "length_gradient.png",
)
"""The files and folders the experiment writes into its --out (what --overwrite sets aside)."""
LENGTH_BINS = (1, 8, 16, 32, 64)
"""Lower edges of the response-length bins (tokens, end token included) of the gradient weight."""


@dataclass(frozen=True)
class LengthExperiment:
    """The experiment's scale: algorithms, seeds and workers, and the lab's settings every run shares.

    The fields named as `LabConfig`'s (from ``steps`` to ``target_entropy``) are those settings, documented
    once there and passed on by name (`runs.lab_settings`); here they take the experiment's values: the
    ``trace`` task, where length is free (``chain``: a longer trace pays); a 128-token budget (the warm start
    shows responses of at most 35 tokens); 600 warm-start steps, enough that a trace no longer costs accuracy
    (about 0.9 either way); a learning rate above the lab's 2e-4, so that length can move within the run;
    and one entropy bonus (or target) for every algorithm, None: each algorithm's own."""

    algorithms: tuple[str, ...] = ("grpo", "bnpo", "dapo", "dr_grpo", "sample_grpo", "gspo")
    """Algorithms trained from each seed's warm start."""
    seeds: int = 5
    """Seeds 0..seeds-1 (each its own warm start, prompts and sampling)."""
    workers: int = 2
    """Runs trained at once, one process and one thread each."""
    steps: int = 100
    prompts_per_step: int = 16
    group_size: int = 8
    max_new_tokens: int = 128
    warm_steps: int = 600
    warm_batch: int = 32
    scratchpad_prob: float = 0.5
    d_model: int = 64
    lr: float = 5e-4
    eval_prompts: int = 16
    task: str = "trace"
    entropy_coef: float | None = None
    target_entropy: float | None = None

    def __post_init__(self) -> None:
        if not self.algorithms:
            raise ValueError("algorithms: need at least one algorithm name")
        check_counts(self, "seeds", "workers")
        if self.entropy_coef is not None and not (
            isinstance(self.entropy_coef, (int, float)) and self.entropy_coef >= 0
        ):
            raise ValueError(f"entropy_coef: need a number >= 0 or None, got {self.entropy_coef!r}")
        if self.target_entropy is not None and not (
            isinstance(self.target_entropy, (int, float)) and self.target_entropy > 0
        ):
            raise ValueError(f"target_entropy: need a number > 0 or None, got {self.target_entropy!r}")
        self.lab_config(self.algorithms[0], 0)  # the lab's settings, checked where the lab owns them

    def lab_config(self, algorithm: str, seed: int):
        """The lab's configuration of one run."""
        from ..lab.config import LabConfig

        return LabConfig(
            **lab_settings(self), algorithm=algorithm, seed=seed, samples=min(4, self.eval_prompts), threads=1
        )


QUICK = LengthExperiment(seeds=2, steps=12)
"""``--quick``: every algorithm on two seeds for 12 steps (a check that it all runs, not a result)."""

GROWTH = LengthExperiment(
    algorithms=("grpo", "grpo:kl_coef=0", "bnpo", "dr_grpo", "sample_grpo"),
    task="chain",
    seeds=5,
    steps=120,
    max_new_tokens=256,
    warm_steps=1500,
    warm_batch=64,
    d_model=96,
    lr=2e-4,
    entropy_coef=0.02,
    workers=1,
)
"""``--task chain``: the claims where a longer trace raises the reward, so responses lengthen
(docs/experiments.md, "Where length grows"): the lab's ``chain`` task, where the scratchpad pays; the
algorithms of the claims with the control; a 256-token budget (the longest demonstration is 12 tokens,
so no response is cut off by the budget unless it runs on); the lab's default warm start (width 96,
1500 x 64 demonstrations); and the same entropy bonus for every algorithm, so the entropy does not
collapse within the run."""

LADDER = LengthExperiment(
    algorithms=("grpo", "grpo:kl_coef=0", "sample_grpo", "bnpo", "dr_grpo", "dapo", "gspo"),
    task="ladder",
    seeds=8,
    steps=200,
    max_new_tokens=128,
    warm_steps=1000,
    warm_batch=64,
    scratchpad_prob=1.0,
    d_model=96,
    lr=1e-5,
    target_entropy=0.1,
    workers=1,
)
"""``--task ladder``: the claims where length keeps growing over the whole run (docs/experiments.md, "Where
length keeps growing"): the lab's ``ladder`` task (chains of 2 to 16 terms of ``+1`` and ``*3`` whose warm
start learns the step at every position but writes a short prefix of the work, so each step RL adds
solves longer chains); every demonstration writes its scratchpad (the ladder's own prefixes include the
empty one); the claims' algorithms, the control and DAPO's token mean and GSPO; 8 seeds, each its own warm
start shared by every algorithm; 200 steps at 1e-5 (the pilots' length grew 4.5-5.1 times and was still
rising at the end; at 2e-5 it peaked near step 150, at 1e-4 and above it rose in 20 steps and fell back); a 128-token budget (the whole scratchpad is 32 tokens); and the
entropy steered toward 0.1 nats per token for every loss (`pgloss.AdaptiveEntropy`), so that it neither
runs away under one aggregation nor collapses under another, as one fixed bonus did on ``chain`` (held at
0.3, the pilots' length stopped growing at about 9 tokens: long exact work needs a surer policy)."""

EXPERIMENTS = {"trace": LengthExperiment(), "chain": GROWTH, "ladder": LADDER}
"""The experiment of each ``--task``."""


def quick(experiment: LengthExperiment) -> LengthExperiment:
    """``--quick``: `experiment` on two seeds for 12 steps (a check that it all runs, not a result)."""
    return dataclasses.replace(experiment, seeds=2, steps=12)


def repeated_ngrams(texts: list[str], n: int = 4) -> float:
    """rep-n (Welleck et al. 2019, https://arxiv.org/abs/1908.04319): 1 - unique/total n-grams of
    each text, pooled over the texts with at least n tokens (one character is one token); NaN if none."""
    if n < 1:
        raise ValueError(f"n: need >= 1, got {n}")
    unique = total = 0
    for text in texts:
        grams = [text[k : k + n] for k in range(len(text) - n + 1)]
        unique, total = unique + len(set(grams)), total + len(grams)
    return 1.0 - unique / total if total else math.nan


def response_lengths(texts: list[str], max_new_tokens: int) -> torch.Tensor:
    """Tokens each response holds in the loss's mask, `[N]`: the text and its end token, or the
    whole budget for a response cut off before its end token (its text fills the budget)."""
    return torch.tensor([min(len(t) + 1, max_new_tokens) for t in texts], dtype=torch.float64)


def gradient_weights(algorithm, rewards: torch.Tensor, lengths: torch.Tensor, group_size: int) -> torch.Tensor:
    """The per-token gradient weight g·N = N·∂L/∂log π of each response at ratio one, `[N]`, with the
    step's group advantages and dynamic sampling (dropped responses get NaN); N is the number of
    responses the loss sees, so that weights of different aggregations share one scale."""
    from ..advantages.group import dynamic_sampling_keep, group_advantages
    from ..algorithms import recipe
    from ..diagnostics.inspect import token_gradients

    group_ids = torch.arange(len(rewards)) // group_size
    paper = recipe(algorithm.name)
    advantages = group_advantages(rewards, group_ids, scale=paper.scale_rewards).to(torch.float64)
    keep = (
        dynamic_sampling_keep(rewards, group_ids)
        if paper.dynamic_sampling
        else torch.ones_like(rewards, dtype=torch.bool)
    )
    weights = torch.full((len(rewards),), math.nan, dtype=torch.float64)
    if not bool(keep.any()):
        return weights
    width = int(lengths.max())
    mask = torch.arange(width)[None, :] < lengths[keep, None]
    zeros = torch.zeros(mask.shape, dtype=torch.float64)  # log π = log π_old = log π_ref: ratio one
    extra = {"ref_log_prob": zeros} if algorithm.uses_reference else {}
    if algorithm.entropy_coef != 0:
        extra["entropy"] = zeros
    if "group_ids" in algorithm.needs:
        extra["group_ids"] = torch.unique(group_ids[keep], return_inverse=True)[1]
    grad = token_gradients(algorithm, zeros, zeros, advantages[keep], mask, **extra)
    # at ratio one every token of a response has the same weight for these losses: its mean
    weights[keep] = (grad.sum(1) / mask.sum(1)) * int(keep.sum())
    return weights


def measure(problems, texts: list[str], algorithm, group_size: int, max_new_tokens: int) -> dict:
    """One step's length, repetition and gradient measures from its sampled responses."""
    from ..lab.tasks import reward

    lengths = response_lengths(texts, max_new_tokens)
    finished = lengths < max_new_tokens
    rewards = torch.tensor(
        [
            reward(t, problems[i // group_size]) if done else 0.0
            for i, (t, done) in enumerate(zip(texts, finished.tolist(), strict=True))
        ],
        dtype=torch.float64,
    )
    right, wrong = rewards > 0.5, rewards <= 0.5
    weights = gradient_weights(algorithm, rewards, lengths, group_size)
    advantages_sign = rewards - rewards.view(-1, group_size).mean(1).repeat_interleave(group_size)
    bins = torch.bucketize(lengths, torch.tensor(LENGTH_BINS[1:], dtype=torch.float64), right=True)

    def mean(values: torch.Tensor, where: torch.Tensor) -> float | None:
        where = where & ~values.isnan()
        return float(values[where].mean()) if bool(where.any()) else None

    traces = [t.rsplit("|", 1)[0] if "|" in t else t for t in texts]
    return {
        "length_right": mean(lengths, right),
        "length_wrong": mean(lengths, wrong),
        "truncated": float((~finished).double().mean()),
        "rep4": None if math.isnan(r := repeated_ngrams(traces, 4)) else r,
        "grad_pos": [mean(weights.abs(), (bins == b) & (advantages_sign > 0)) for b in range(len(LENGTH_BINS))],
        "grad_neg": [mean(weights.abs(), (bins == b) & (advantages_sign < 0)) for b in range(len(LENGTH_BINS))],
    }


def lab_batch(problems, texts: list[str], group_size: int, max_new_tokens: int) -> dict[str, torch.Tensor]:
    """One step's responses as a batch for ``pgloss grads --batch``: their mask, GRPO's group
    advantages of their rewards (with the rewards and group ids), and log π = log π_old = 0 (the
    step's first, on-policy update)."""
    from ..advantages.group import group_advantages
    from ..lab.tasks import reward

    lengths = response_lengths(texts, max_new_tokens)
    rewards = torch.tensor(
        [
            reward(t, problems[i // group_size]) if n < max_new_tokens else 0.0
            for i, (t, n) in enumerate(zip(texts, lengths.tolist(), strict=True))
        ],
        dtype=torch.float64,
    )
    mask = torch.arange(int(lengths.max()))[None, :] < lengths[:, None]
    zeros = torch.zeros(mask.shape, dtype=torch.float64)
    group_ids = torch.arange(len(texts)) // group_size
    advantages = group_advantages(rewards, group_ids).double()
    return {
        "log_prob": zeros,
        "old_log_prob": zeros.clone(),
        "advantages": advantages,
        "mask": mask,
        "scores": rewards,
        "group_ids": group_ids,
    }


def end_batch_path(run_file: str | Path) -> Path:
    """Where the run kept in `run_file` (``OUT/runs/ALGORITHM-SEED.jsonl``) saves the batch its trained
    policy sampled at the last step: ``OUT/runs/ALGORITHM-SEED-end.pt``, for ``pgloss grads --batch``."""
    run_file = Path(run_file)
    return run_file.with_name(run_file.name.removesuffix(".jsonl") + "-end.pt")


def _warm(experiment: LengthExperiment, seed: int, cache: str) -> None:
    warm_state(experiment.lab_config(experiment.algorithms[0], seed), cache)


def _run(experiment: LengthExperiment, algorithm: str, seed: int, cache: str, path: str) -> tuple[str, int]:
    from ..lab import trainer

    cfg = experiment.lab_config(algorithm, seed)
    loss = trainer.make_algorithm(cfg)
    extra: dict[int, dict] = {}

    def on_rollout(step, problems, texts):
        extra[step] = measure(problems, texts, loss, cfg.group_size, cfg.max_new_tokens)
        batch_path = Path(cache) / f"batch-seed{seed}.pt"  # step 0 is the same for every algorithm
        if step == 0 and not batch_path.exists():
            torch.save(lab_batch(problems, texts, cfg.group_size, cfg.max_new_tokens), f"{batch_path}.{algorithm}")
            Path(f"{batch_path}.{algorithm}").rename(batch_path)
        if step == cfg.steps:  # the trained policy's last batch: its per-token gradient (pgloss grads --batch)
            torch.save(lab_batch(problems, texts, cfg.group_size, cfg.max_new_tokens), end_batch_path(path))

    write_run(cfg, path, cache, extra=extra.pop, on_rollout=on_rollout)
    return algorithm, seed


def check(experiment: LengthExperiment) -> None:
    """Fail before any training on an algorithm the lab cannot build (ValueError/TypeError)."""
    from ..lab.tasks import make_task
    from ..lab.trainer import make_algorithm

    for a in experiment.algorithms:
        make_algorithm(experiment.lab_config(a, 0))
    make_task(experiment.task)


def jobs(experiment: LengthExperiment, out: Path) -> list[tuple]:
    """The (algorithm, seed) runs not yet complete in `out`, as arguments of `_run`."""
    return [
        (experiment, a, s, str(out / "warm"), str(run_path(out, a, s)))
        for s in range(experiment.seeds)
        for a in experiment.algorithms
        if not run_path(out, a, s).exists()
    ]


def run(experiment: LengthExperiment, out: Path, progress: bool = True) -> float:
    """Warm-start every seed a run still needs (kept in ``out/warm``, keyed by its settings), then
    train every (algorithm, seed) not yet complete in `out`, ``experiment.workers`` at a time, with
    one progress bar on stderr (`progress`); returns the seconds taken. A KeyboardInterrupt (Ctrl-C,
    SIGTERM) stops the workers and propagates: complete runs stay, the next call resumes."""
    from ..lab import warm

    check(experiment)
    (out / "warm").mkdir(parents=True, exist_ok=True)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    todo = jobs(experiment, out)
    seeds = sorted({job[2] for job in todo})
    cold = [s for s in seeds if not warm.cached(experiment.lab_config(experiment.algorithms[0], s), out / "warm")]
    return execute(
        "length",
        [(_warm, [(experiment, s, str(out / "warm")) for s in seeds]), (_run, todo)],
        workers=min(experiment.workers, max(1, len(todo))),
        warm_starts=len(cold),
        warm_steps=experiment.warm_steps,
        rl_steps=len(todo) * (experiment.steps + 1),
        progress=progress,
    )
