"""One progress bar per command, on stderr, over every step it will make: warm-start steps, then RL steps.

A warm-start step (one supervised batch) costs a small fraction of an RL step (sampling, several
optimizer steps, a greedy evaluation), so tqdm's estimate, which assumes every unit costs the
same, is wrong by hours at a phase's boundary. The bar computes its own: for each phase, the steps
left times the mean seconds of that phase's steps so far, divided by the runs it makes at once.
A phase with no step timed yet is named, not guessed, so the estimate is honest from the first step.
"""

from __future__ import annotations

import sys

FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]"


def clock(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """`phases`: {name: (steps, parallel)}, in the order they run; ``advance(name, steps, seconds)``
    counts `steps` made in `seconds` of one worker's time."""

    def __init__(self, desc: str, phases: dict[str, tuple[int, int]], file=None) -> None:
        from tqdm import tqdm

        self.left = {name: steps for name, (steps, _) in phases.items() if steps > 0}
        self.parallel = {name: max(1, parallel) for name, (_, parallel) in phases.items()}
        self.timed = {name: [0.0, 0] for name in self.left}  # seconds, steps
        self.bar = tqdm(total=sum(self.left.values()), desc=desc, bar_format=FORMAT, dynamic_ncols=True,
                        mininterval=1.0, file=file or sys.stderr)
        self.bar.set_postfix_str(self.eta(), refresh=False)

    def advance(self, phase: str, steps: int = 1, seconds: float | None = None) -> None:
        if phase not in self.left:
            return
        self.left[phase] = max(0, self.left[phase] - steps)
        if seconds is not None:
            self.timed[phase][0] += seconds
            self.timed[phase][1] += steps
        self.bar.set_postfix_str(self.eta(), refresh=False)
        self.bar.update(steps)

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
