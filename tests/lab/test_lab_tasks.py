"""The tasks' problems and verifiable rewards."""

import random

import pytest

from pgloss.lab.tasks import TASKS, ChainTask, MulTask, Problem, SumTask, demonstration, make_task, reward
from pgloss.lab.tokenizer import EOS, Tokenizer


def test_sum_problem_is_consistent():
    rng = random.Random(0)
    for _ in range(200):
        p = SumTask().sample(rng)
        terms = [int(t) for t in p.prompt[:-1].split("+")]
        assert 2 <= len(terms) <= 6 and p.prompt.endswith("=")
        assert p.answer == str(sum(terms))
        assert [int(s) for s in p.steps] == [sum(terms[: i + 1]) for i in range(1, len(terms))]


def test_mul_problem_is_consistent():
    rng = random.Random(0)
    for _ in range(100):
        p = MulTask().sample(rng)
        a, b = map(int, p.prompt[:-1].split("*"))
        assert p.answer == str(a * b) and len(p.steps) == b and p.steps[-1] == p.answer


def test_chain_problem_is_evaluated_left_to_right_mod_10():
    rng = random.Random(0)
    for _ in range(200):
        p = ChainTask().sample(rng)
        text = p.prompt[:-1]
        value = int(text[0])
        expected = []
        for op, d in zip(text[1::2], text[2::2]):
            value = eval(f"{value}{op}{d}") % 10
            expected.append(str(value))
        assert 3 <= len(text) // 2 + 1 <= 6 and list(p.steps) == expected and p.answer == expected[-1]


def test_reward_reads_the_answer_after_the_last_bar():
    p = Problem("3+5+2=", "10", ("8", "10"))
    assert reward("8,10|10", p) == 1.0
    assert reward("|10", p) == 1.0
    assert reward("7,9|10", p) == 1.0  # the scratchpad is not graded
    assert reward("8,10|11", p) == 0.0
    assert reward("10", p) == 0.0  # no bar, no answer
    assert reward("|1|10", p) == 1.0 and reward("|10|1", p) == 0.0
    assert reward("", p) == 0.0


@pytest.mark.parametrize("name", sorted(TASKS))
def test_demonstrations_earn_full_reward_and_length_depends_on_the_problem(name):
    task, rng = make_task(name), random.Random(1)
    problems = [task.sample(rng) for _ in range(100)]
    assert all(reward(demonstration(p, s), p) == 1.0 for p in problems for s in (True, False))
    assert max(len(p.prompt) for p in problems) <= 2 * task.max_terms  # the context the trainer sizes from it
    lengths = {len(demonstration(p, True)) for p in problems}
    assert len(lengths) > 3 and max(lengths) <= task.max_response_chars
    assert all(len(demonstration(p, False)) < len(demonstration(p, True)) for p in problems if len(p.steps) > 1)


def test_unknown_task_is_named():
    with pytest.raises(ValueError, match="sum"):
        make_task("nope")


def test_tokenizer_round_trip_and_stops_at_end():
    tok = Tokenizer()
    ids = tok.encode("12+3=|15")
    assert tok.decode(ids) == "12+3=|15"
    assert tok.decode(ids + [EOS] + tok.encode("99")) == "12+3=|15"
    with pytest.raises(ValueError, match="x"):
        tok.encode("x")


def _ladder_running(prompt: str) -> list[int]:
    """The running values of a ladder prompt, from the definition: left to right, modulo 10."""
    text = prompt[:-1]
    value, running = int(text[0]), []
    for op, d in zip(text[1::2], text[2::2]):
        value = (value + int(d)) % 10 if op == "+" else (value * int(d)) % 10
        running.append(value)
    return running


def _ladder_terms(prompt: str) -> int:
    """The chain's own terms: the prompt's terms less the trailing +0 padding."""
    text = prompt[:-1]
    while text.endswith("+0") and len(text) > 1:
        text = text[:-2]
    return len(text) // 2 + 1


def test_ladder_problem_is_a_chain_with_unit_factors_and_a_prefix_of_its_running_values():
    from pgloss.lab.tasks import LadderTask

    rng, task = random.Random(0), LadderTask()
    terms, prefixes = [], []
    for _ in range(2000):
        p = task.sample(rng)
        text = p.prompt[:-1]
        running = _ladder_running(p.prompt)
        assert len(p.prompt) == 2 * task.max_terms and p.prompt.endswith("=")  # one length for every chain
        n = _ladder_terms(p.prompt)
        own = list(zip(text[1::2], text[2::2]))[: n - 1]
        assert all(d in "1379" if op == "*" else d != "0" for op, d in own)  # units modulo 10; no +0 but the padding
        assert p.answer == str(running[-1])
        assert list(p.steps) == [str(v) for v in running[: len(p.steps)]]  # the demonstration's prefix
        assert text.endswith("+0" * (task.max_terms - n)) and len(p.steps) <= n - 1  # never into the padding
        terms.append(n)
        prefixes.append(len(p.steps))
    assert min(terms) == 2 and max(terms) == 16  # mixed difficulty, over the whole range
    # the prefix is geometric with stop_prob 0.4, cut at the chain's whole scratchpad
    assert sum(k == 0 for k in prefixes) / len(prefixes) == pytest.approx(0.4, abs=0.03)
    expected = sum(sum(0.6 ** j for j in range(1, n)) for n in range(2, 17)) / 15  # E[min(geometric, n - 1)]
    assert sum(prefixes) / len(prefixes) == pytest.approx(expected, abs=0.1)
    # the answer of a long chain is uniform over the digits: guessing earns 0.1 at any length
    long = [task.sample(rng).answer for _ in range(4000)]
    counts = [long.count(str(d)) / len(long) for d in range(10)]
    assert max(counts) < 0.13 and min(counts) > 0.07


def test_ladder_each_further_written_step_solves_more_chains():
    """A solver that writes the first k running values and can then do one operation of the chain in the
    answer's token (a guess of 0 beyond that) solves the chains of at most k + 2 terms, and 1 in 10 of the
    rest: over the task's mixed lengths, its reward rises at every k up to the longest chain's."""
    from pgloss.lab.tasks import LadderTask

    rng, task = random.Random(2), LadderTask()
    problems = [task.sample(rng) for _ in range(3000)]

    def solver(p, k):
        running = _ladder_running(p.prompt)
        written = [str(v) for v in running[:k]]
        answer = running[-1] if _ladder_terms(p.prompt) - 1 - len(written) <= 1 else 0
        return ",".join(written) + f"|{answer}"

    means = []
    for k in range(task.max_terms):
        rewards = [reward(solver(p, k), p) for p in problems]
        means.append(sum(rewards) / len(rewards))
    assert all(b > a + 0.02 for a, b in zip(means, means[1:-1]))  # each step up to 14 solves more
    assert means[0] < 0.25 and means[task.max_terms - 2] == 1.0 and means[-1] == 1.0
    # and more work is a longer response: k >= 1 steps take 2k + 1 characters, none takes 2
    p = next(p for p in problems if len(p.prompt) >= 7)
    assert [len(solver(p, k)) for k in range(3)] == [2, 3, 5]


def test_ladder_settings_are_checked():
    from pgloss.lab.tasks import LadderTask

    with pytest.raises(ValueError, match="stop_prob"):
        LadderTask(stop_prob=0.0)
    with pytest.raises(ValueError, match="min_terms"):
        LadderTask(min_terms=1)
