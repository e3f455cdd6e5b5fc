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
- ``ladder``: chains of 2 to 16 terms, each step ``+1`` or ``*3`` modulo 10, padded with ``+0`` to one
  length (`LadderTask`), whose warm start learns the step at every position but writes only a short
  prefix of the scratchpad: each further step written solves the chains one term longer, so the length
  can keep growing under RL while the policy learns to write more of the work.

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
    teach_continue: bool = True
    """Whether the warm start learns where this demonstration's scratchpad goes on (its commas); False for
    a demonstration shown for its work alone, which goes on at every position it can (`taught`)."""
    teach_answer: bool = True
    """Whether the warm start learns this demonstration's answer; False where its scratchpad stops short of
    the work the answer needs, so that the warm start does not learn to guess it (`taught`)."""


def taught(problem: Problem, text: str) -> list[bool]:
    """Which characters of `text`, a demonstration of `problem` (`demonstration`), the warm start learns:
    all of them, less its commas (where the scratchpad goes on) where ``problem.teach_continue`` is False
    and less its answer (the characters after the last ``|``) where ``problem.teach_answer`` is False."""
    bar = text.rindex("|")
    return [(problem.teach_continue or ch != ",") and (problem.teach_answer or i <= bar) for i, ch in enumerate(text)]


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
        for op, d in zip(ops, digits[1:], strict=True):
            value = (value + d if op == "+" else value * d) % 10
            running.append(str(value))
        prompt = str(digits[0]) + "".join(op + str(d) for op, d in zip(ops, digits[1:], strict=True)) + "="
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


class LadderTask:
    """Chains of mixed length where each further written step solves more of them.

    ``ladder``: a start digit and 1 to ``max_terms`` - 1 operations (a chain of ``min_terms`` to ``max_terms``
    terms, uniform), each ``+1`` or ``*3`` (even odds), evaluated left to right modulo 10, then padded with
    ``+0`` to ``max_terms`` terms: ``3+1*3*3+1+0+0=`` (``max_terms`` 6) -> ``4,2,6,7,7,7|7``. Every prompt
    has the same length, so the operation of step j sits at the same position in every prompt and step j
    of the scratchpad at the same position in every response (the lab's model has learned absolute
    positions: with prompts of varying length it did not learn the steps at all). The scratchpad runs
    over the padding too, where the value stays (``+0``): a response that writes past its chain's end
    loses nothing, so how far to write is the only choice the work asks for.

    Each step is easy: one of three maps of a digit (``+1``, ``*3`` and the padding's ``+0``), a table
    of 30 entries that the warm start learns at every position, where the earlier form of the task (any
    digit added, any unit multiplied: 130 entries) was not learned (docs/experiments.md, "Where length
    keeps growing"). The answer cannot be had without the work: the two maps do not commute (``+1`` then
    ``*3`` is not ``*3`` then ``+1``), so the answer depends on their order, not only on how many of each
    there are (with sums, the counts of the addends give the answer), and both permute the ten digits, so
    the answer is uniform over 0-9 at every length: a guess earns 0.1.

    The response may stop its scratchpad after any number k of running values and then answer:
    ``4|7`` (k = 1) is as valid as ``4,2,6,7|7``. A chain of n terms needs n - 1 operations; a policy that
    answers with the last value it wrote answers the chains of at most k + 1 terms and 1 in 10 of the
    rest, so each further step written solves the chains one term longer, at every k up to
    ``max_terms`` - 1.

    The warm start writes a short prefix but learns the step at every position. A demonstration is,
    with probability ``work_prob``, the whole scratchpad over all ``max_terms`` - 1 positions shown for
    its work alone (its running values, its stop after the last position and its answer are learned,
    where it goes on is not: ``Problem.teach_continue``), and otherwise a prefix of k running values, k geometric,
    P(k) = (1 - p)^k p with p = ``stop_prob``, cut at ``max_terms`` - 1, whose answer is learned only where
    the prefix holds the chain's whole work (``Problem.teach_answer``): the warm policy stops as the
    prefixes do and answers with the last value it wrote, so RL starts from short responses and has to
    lengthen the work step by step. A problem carries its demonstration's running values in ``steps``;
    the reward reads only the answer.
    """

    name = "ladder"
    operations = ("+1", "*3")
    """The two maps of a digit a chain's steps apply (modulo 10); ``+0`` pads the prompt."""

    def __init__(
        self, min_terms: int = 2, max_terms: int = 16, stop_prob: float = 0.5, work_prob: float = 0.35
    ) -> None:
        if not 2 <= min_terms <= max_terms:
            raise ValueError(f"min_terms, max_terms: need 2 <= min_terms <= max_terms, got {min_terms}, {max_terms}")
        if not 0 < stop_prob <= 1:
            raise ValueError(
                f"stop_prob: need 0 < stop_prob <= 1 (the chance to stop after each written step), got {stop_prob!r}"
            )
        if not 0 <= work_prob <= 1:
            raise ValueError(
                f"work_prob: need 0 <= work_prob <= 1 (the share of demonstrations showing the whole "
                f"scratchpad for its work alone), got {work_prob!r}"
            )
        self.min_terms, self.max_terms, self.stop_prob, self.work_prob = min_terms, max_terms, stop_prob, work_prob

    @staticmethod
    def step(value: int, operation: str) -> int:
        """One step of the chain: `value` after `operation` (``+1``, ``*3`` or the padding ``+0``), modulo 10."""
        digit = int(operation[1])
        return (value + digit) % 10 if operation[0] == "+" else value * digit % 10

    def sample(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_terms, self.max_terms)
        operations = [rng.choice(self.operations) for _ in range(n - 1)] + ["+0"] * (self.max_terms - n)
        value = start = rng.randrange(10)
        running = []
        for operation in operations:
            value = self.step(value, operation)
            running.append(str(value))
        prompt = str(start) + "".join(operations) + "="
        if rng.random() < self.work_prob:
            return Problem(prompt, running[-1], tuple(running), teach_continue=False)
        k = 0
        while k < len(running) and rng.random() >= self.stop_prob:
            k += 1
        return Problem(prompt, running[-1], tuple(running[:k]), teach_answer=k >= n - 1)

    @property
    def max_response_chars(self) -> int:
        """Longest demonstration: the whole scratchpad over every position, the bar and the answer."""
        return 2 * (self.max_terms - 1) - 1 + 2


TASKS = {"sum": SumTask, "mul": MulTask, "chain": ChainTask, "trace": TraceTask, "ladder": LadderTask}


def make_task(name: str):
    """The task called `name` (one of ``TASKS``)."""
    if name not in TASKS:
        raise ValueError(f"task: unknown task {name!r}; valid names: {sorted(TASKS)}")
    return TASKS[name]()
