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

from __future__ import annotations

import random


class TraceTask:
    """A digit times a digit, answered after a free-length trace of digits and commas."""

    name = "trace"
    max_terms = 2  # the prompt's operands (the trainer sizes the prompt from this)

    def __init__(self, max_trace_items: int = 16) -> None:
        if not isinstance(max_trace_items, int) or max_trace_items < 1:
            raise ValueError(f"max_trace_items: need an int >= 1, got {max_trace_items!r}")
        self.max_trace_items = max_trace_items

    def sample(self, rng: random.Random):
        from .tasks import Problem  # here, not at the top: tasks.py imports this module

        a, b = rng.randint(1, 9), rng.randint(1, 9)
        trace = tuple(str(rng.randrange(10)) for _ in range(rng.randint(1, self.max_trace_items)))
        return Problem(f"{a}*{b}=", str(a * b), trace)

    @property
    def max_response_chars(self) -> int:
        """Longest demonstration: the longest trace (items and commas), the bar, a two-digit answer."""
        return 2 * self.max_trace_items - 1 + 1 + 2
