"""Synthetic tasks with verifiable rewards, where the response length varies and matters.

Every response ends in ``|ANSWER``. Before the bar the policy may write a scratchpad of
running results, one per step of the problem, so the scratchpad's length depends on the
problem. The reward is 1 when the answer after the last bar is right and 0 otherwise; the
scratchpad itself is not graded, so whether to write it (and how long) is the policy's choice.

- ``sum``: add 2 to 6 single digits. ``3+5+2+7=`` -> ``8,10,17|17`` (or ``|17``).
  Summing six digits in one token is hard for a tiny model, so the scratchpad pays.
- ``mul``: a digit times a digit by repeated addition. ``7*4=`` -> ``7,14,21,28|28`` (or ``|28``).
  The times table can be memorised, so here the short answer can be as good as the long one.
- ``chain``: digits joined by ``+`` and ``*``, left to right modulo 10. ``3+5*2+7=`` -> ``8,6,3|3``.
  The order matters, so a direct answer is hard and the scratchpad pays.
- ``trace``: a digit times a digit after a free-length trace that the reward ignores (`TraceTask`):
  whatever length the policy settles on comes from the loss, not from the task.

The warm start shows both forms (with and without scratchpad), so RL starts from a policy
that can write either and learns which one pays.

Adding a task: a class with a ``name``, ``sample(rng) -> Problem``, the ``max_response_chars``
of its longest demonstration (``LabConfig`` refuses a ``max_new_tokens`` shorter than that) and
``max_terms``, the operands of its longest prompt (the trainer sizes the model's context from
it); then one entry in ``TASKS``. ``--task`` and its help, ``LabConfig``'s checks and the task
tests read ``TASKS``, so nothing else changes (``trace.py`` is an example in its own file).
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Problem:
    """One prompt with its answer and the running results its scratchpad lists."""

    prompt: str
    answer: str
    steps: tuple[str, ...]


def reward(response: str, problem: Problem) -> float:
    """1.0 when the text after the response's last ``|`` is the answer, else 0.0."""
    if "|" not in response:
        return 0.0
    return float(response.rsplit("|", 1)[1] == problem.answer)


def demonstration(problem: Problem, scratchpad: bool) -> str:
    """The target response of the warm start: with the scratchpad, or the bare answer."""
    pad = ",".join(problem.steps) if scratchpad else ""
    return f"{pad}|{problem.answer}"


class SumTask:
    """Sum of `min_terms` to `max_terms` digits; the scratchpad lists the running sums."""

    name = "sum"

    def __init__(self, min_terms: int = 2, max_terms: int = 6) -> None:
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"min_terms, max_terms: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        self.min_terms, self.max_terms = min_terms, max_terms

    def sample(self, rng: random.Random) -> Problem:
        terms = [rng.randrange(10) for _ in range(rng.randint(self.min_terms, self.max_terms))]
        running = [sum(terms[: i + 1]) for i in range(1, len(terms))]
        return Problem("+".join(map(str, terms)) + "=", str(running[-1]), tuple(map(str, running)))

    @property
    def max_response_chars(self) -> int:
        """Longest demonstration: running sums (up to 2 digits) with commas, bar, answer."""
        return 3 * (self.max_terms - 1) - 1 + 1 + 2


class MulTask:
    """A digit times a digit (1-9 each); the scratchpad counts up by the first factor."""

    name = "mul"
    max_terms = 2

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return Problem(f"{a}*{b}=", str(a * b), tuple(str(a * k) for k in range(1, b + 1)))

    @property
    def max_response_chars(self) -> int:
        return 3 * 9 - 1 + 1 + 2


class ChainTask:
    """Digits joined by ``+`` and ``*``, evaluated left to right modulo 10; the scratchpad lists
    the running value. ``3+5*2+7=`` -> ``8,6,3|3`` (or ``|3``). The order of the operations
    matters, so the answer cannot be read off an average of the digits: here the scratchpad pays."""

    name = "chain"

    def __init__(self, min_terms: int = 3, max_terms: int = 6) -> None:
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"min_terms, max_terms: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        self.min_terms, self.max_terms = min_terms, max_terms

    def sample(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_terms, self.max_terms)
        digits = [rng.randrange(10) for _ in range(n)]
        ops = [rng.choice("+*") for _ in range(n - 1)]
        value, running = digits[0], []
        for op, d in zip(ops, digits[1:]):
            value = (value + d if op == "+" else value * d) % 10
            running.append(str(value))
        prompt = str(digits[0]) + "".join(op + str(d) for op, d in zip(ops, digits[1:])) + "="
        return Problem(prompt, running[-1], tuple(running))

    @property
    def max_response_chars(self) -> int:
        return 2 * (self.max_terms - 1) - 1 + 2


class TraceTask:
    """A task where the response's length is the policy's choice: a free trace, then the answer.

    ``trace``: a digit times a digit, ``7*4=`` -> ``<trace>|28``. Before the bar the policy may write
    a trace of any length (digits and commas, up to the response budget); the reward reads only
    the text after the last bar, so a trace neither earns nor costs reward by itself. The times
    table can be answered directly, so no trace length is needed for the answer: whatever length
    the policy settles on comes from the loss, not from the task.

    The warm start shows the bare answer (``|28``) or a trace of uniformly random length
    ``1..max_trace_items`` items of random digits (``5,0,9|28``), so RL starts from a policy that
    writes short and long traces alike. A problem carries its demonstration trace in ``steps``
    (the field the other tasks use for their scratchpad), so the lab's ``demonstration`` applies
    unchanged; the trace does not enter the reward.
    """

    name = "trace"
    max_terms = 2  # the prompt's operands (the trainer sizes the prompt from this)

    def __init__(self, max_trace_items: int = 16) -> None:
        if not isinstance(max_trace_items, int) or max_trace_items < 1:
            raise ValueError(f"max_trace_items: need an int >= 1, got {max_trace_items!r}")
        self.max_trace_items = max_trace_items

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        trace = tuple(str(rng.randrange(10)) for _ in range(rng.randint(1, self.max_trace_items)))
        return Problem(f"{a}*{b}=", str(a * b), trace)

    @property
    def max_response_chars(self) -> int:
        """Longest demonstration: the longest trace (items and commas), the bar, a two-digit answer."""
        return 2 * self.max_trace_items - 1 + 1 + 2


TASKS = {"sum": SumTask, "mul": MulTask, "chain": ChainTask, "trace": TraceTask}


def make_task(name: str):
    """The task called `name` (one of ``TASKS``)."""
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; valid names: {sorted(TASKS)}")
    return TASKS[name]()
