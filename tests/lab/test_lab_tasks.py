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
