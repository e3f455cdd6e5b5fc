"""One progress bar per command, on stderr, over every step it will make: warm-start steps, then RL steps.

A warm-start step (one supervised batch) costs a small fraction of an RL step (sampling, several
optimizer steps, a greedy evaluation), so tqdm's estimate, which assumes every unit costs the
same, is wrong by hours at a phase's boundary. The bar computes its own: for each phase, the steps
left times the mean seconds of that phase's steps so far, divided by the runs it makes at once.
A phase with no step timed yet is named, not guessed, so the estimate is honest from the first step.

The bar's fill is the share of the work done, each phase's steps weighed by their cost: the measured
mean seconds of a timed phase's steps; for a phase not timed yet, a timed phase's cost times the ratio
of their `prior` costs (``step_costs``: model calls and rows, a rough count, 0.6-1x of the measured ratio
on the lab's default and tiny models), so the warm start does not fill the bar as if its steps cost
what an RL step costs (the count of steps showed 87% at half the time).
"""

from __future__ import annotations

import sys

FORMAT = "{desc}: {percentage:3.0f}%|{bar}| [{elapsed}{postfix}]"  # postfix: ", " + Progress.postfix()
SCALE = 1000  # the bar counts thousandths of the work


def clock(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def step_costs(cfg) -> dict[str, float]:
    """The relative cost of a warm-start step and of an RL step of `cfg` (a LabConfig), before either is
    timed: model calls, each costing 1 + rows x positions x (d_model² x n_layer / 3e6 + 1 / 1000) (a call's
    fixed overhead, then its arithmetic and its per-token work), with responses of half ``max_new_tokens``
    (the constants fitted on one CPU: the ratio came out 0.6x the measured one on the default model, 1.0x
    on a tiny one). A warm-start step is one
    forward and backward (3 calls' worth) on ``warm_batch`` demonstrations; an RL step samples
    ``prompts_per_step x group_size`` rows token by token, scores them under the policy and the reference,
    makes ``epochs x minibatches`` optimizer steps and decodes the held-out prompts greedily."""
    from .runner import RL, WARM

    prompt, response = 10, max(1, cfg.max_new_tokens // 2)
    call = lambda rows, positions: 1 + rows * positions * (cfg.d_model**2 * cfg.n_layer / 3e6 + 1e-3)  # noqa: E731
    rows = cfg.prompts_per_step * cfg.group_size
    rl = (
        call(rows, prompt)
        + response * call(rows, 1)
        + 2 * call(rows, prompt + response)
        + cfg.epochs * cfg.minibatches * 3 * call(rows / cfg.minibatches, prompt + response)
        + call(cfg.eval_prompts, prompt)
        + response * call(cfg.eval_prompts, 1)
    )
    return {WARM: 3 * call(cfg.warm_batch, prompt + response), RL: rl}


class Progress:
    """`phases`: {name: (steps, parallel)}, in the order they run; ``advance(name, steps, seconds)``
    counts `steps` made in `seconds` of one worker's time. `prior`: {name: relative cost of a step}
    (``step_costs``; equal when not given), read only for phases not timed yet."""

    def __init__(
        self, desc: str, phases: dict[str, tuple[int, int]], file=None, prior: dict[str, float] | None = None
    ) -> None:
        from tqdm import tqdm

        self.left = {name: steps for name, (steps, _) in phases.items() if steps > 0}
        self.total = dict(self.left)
        self.parallel = {name: max(1, parallel) for name, (_, parallel) in phases.items()}
        self.prior = {name: (prior or {}).get(name, 1.0) for name in self.left}
        self.timed = {name: [0.0, 0] for name in self.left}  # seconds, steps
        self.bar = tqdm(
            total=SCALE, desc=desc, bar_format=FORMAT, dynamic_ncols=True, mininterval=1.0, file=file or sys.stderr
        )
        self.bar.set_postfix_str(self.postfix(), refresh=False)

    def advance(self, phase: str, steps: int = 1, seconds: float | None = None) -> None:
        if phase not in self.left:
            return
        self.left[phase] = max(0, self.left[phase] - steps)
        if seconds is not None:
            self.timed[phase][0] += seconds
            self.timed[phase][1] += steps
        self.bar.set_postfix_str(self.postfix(), refresh=False)
        self.bar.update(round(SCALE * self.fraction()) - self.bar.n)

    def cost(self, phase: str) -> float:
        """Wall seconds (or prior units, when nothing is timed) of one step of `phase`: measured, or from
        a timed phase by the ratio of the priors."""
        total, count = self.timed[phase]
        if count:
            cost = total / count
        else:
            timed = [p for p in self.timed if self.timed[p][1]]
            cost = self.prior[phase] * (
                self.timed[timed[0]][0] / self.timed[timed[0]][1] / self.prior[timed[0]] if timed else 1.0
            )
        return cost / self.parallel[phase]

    def fraction(self) -> float:
        """The share of the work done, each phase's steps weighed by their cost."""
        costs = {phase: self.cost(phase) for phase in self.total}
        whole = sum(self.total[p] * costs[p] for p in self.total)
        done = sum((self.total[p] - self.left[p]) * costs[p] for p in self.total)
        return done / whole if whole > 0 else 1.0

    def remaining(self) -> tuple[float, list[str]]:
        """(seconds left in the phases timed so far, the phases left that are not timed yet)."""
        seconds, untimed = 0.0, []
        for phase, left in self.left.items():
            if left == 0:
                continue
            total, count = self.timed[phase]
            if count == 0:
                untimed.append(phase)
            else:
                seconds += left * total / count / self.parallel[phase]
        return seconds, untimed

    def postfix(self) -> str:
        """Each phase's steps done and to do, then `eta`."""
        counts = ", ".join(f"{p} {self.total[p] - self.left[p]}/{self.total[p]}" for p in self.total)
        return f"{counts}; {self.eta()}" if counts else self.eta()

    def eta(self) -> str:
        current = next((p for p, left in self.left.items() if left), None)
        if current is None:
            return "done"
        seconds, untimed = self.remaining()
        if not untimed:
            return f"{current}, ETA {clock(seconds)}"
        if len(untimed) == len([p for p in self.left if self.left[p]]):
            return f"{current}, ETA from its first step"
        return f"{current}, ETA {clock(seconds)} + {' + '.join(untimed)} (timed from its first step)"

    def close(self) -> None:
        self.bar.close()
