"""The tasks' problems and verifiable rewards."""

import itertools
import random

import pytest

from pgloss.lab.tasks import TASKS, ChainTask, MulTask, Problem, SumTask, demonstration, make_task, reward, taught
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
        for op, d in zip(text[1::2], text[2::2], strict=True):
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
    for op, d in zip(text[1::2], text[2::2], strict=True):
        value = (value + int(d)) % 10 if op == "+" else (value * int(d)) % 10
        running.append(value)
    return running


def _ladder_terms(prompt: str) -> int:
    """The chain's own terms: the prompt's terms less the trailing +0 padding."""
    text = prompt[:-1]
    while text.endswith("+0") and len(text) > 1:
        text = text[:-2]
    return len(text) // 2 + 1


def test_ladder_problem_is_a_chain_of_two_maps_with_its_running_values():
    from pgloss.lab.tasks import LadderTask

    rng, task = random.Random(0), LadderTask()
    terms, prefixes, work = [], [], 0
    for _ in range(3000):
        p = task.sample(rng)
        text = p.prompt[:-1]
        running = _ladder_running(p.prompt)
        assert len(p.prompt) == 2 * task.max_terms and p.prompt.endswith("=")  # one length for every chain
        n = _ladder_terms(p.prompt)
        ops = [op + d for op, d in zip(text[1::2], text[2::2], strict=True)]
        assert set(ops[: n - 1]) <= {"+1", "*3"} and set(ops[n - 1 :]) <= {"+0"}  # +0 only as the padding
        assert p.answer == str(running[-1]) == str(running[n - 2])  # the padding keeps the value
        assert list(p.steps) == [str(v) for v in running[: len(p.steps)]]  # a prefix, into the padding too
        if not p.teach_continue:  # shown for its work: every position, the answer taught
            assert len(p.steps) == task.max_terms - 1 and p.teach_answer
            work += 1
        else:  # a prefix: its answer is taught only where it holds the chain's whole work
            assert p.teach_answer == (len(p.steps) >= n - 1)
            prefixes.append(len(p.steps))
        terms.append(n)
    assert min(terms) == 2 and max(terms) == 16  # mixed difficulty, over the whole range
    assert work / 3000 == pytest.approx(0.35, abs=0.03)
    # the prefix is geometric with stop_prob 0.5, cut at the 15 positions
    assert sum(k == 0 for k in prefixes) / len(prefixes) == pytest.approx(0.5, abs=0.03)
    assert sum(prefixes) / len(prefixes) == pytest.approx(sum(0.5**j for j in range(1, 16)), abs=0.08)
    # the answer of a long chain is uniform over the digits: guessing earns 0.1 at any length
    long = [task.sample(rng).answer for _ in range(4000)]
    counts = [long.count(str(d)) / len(long) for d in range(10)]
    assert max(counts) < 0.13 and min(counts) > 0.07


def test_ladder_answer_depends_on_the_order_of_the_steps():
    """+1 and *3 do not commute: chains with the same start and the same operations in another order end
    on different digits, so counting the operations (which answers a chain of sums) does not answer them."""
    from pgloss.lab.tasks import LadderTask

    def end(start, ops):
        for op in ops:
            start = LadderTask.step(start, op)
        return start

    assert end(3, ["+1", "*3"]) == 2 and end(3, ["*3", "+1"]) == 0
    # over the orderings of four +1 and four *3 from each start, no digit is the answer of more than 3 in 10
    orders = [ops for ops in itertools.product(["+1", "*3"], repeat=8) if ops.count("+1") == 4]
    for start in range(10):
        ends = [end(start, ops) for ops in orders]
        assert max(ends.count(d) for d in range(10)) / len(ends) < 0.3


def test_ladder_a_policy_that_writes_k_steps_answers_the_chains_of_up_to_k_plus_1_terms():
    """The task's property: a policy that writes the first k running values and answers with the last one
    it wrote (a guess, 0, when it wrote none) answers exactly the chains of at most k + 1 terms, and of the
    rest only those whose answer its guess hits; over the task's mixed lengths its reward rises at every k
    up to the longest chain's 15 steps, where it answers every chain."""
    from pgloss.lab.tasks import LadderTask

    rng, task = random.Random(2), LadderTask()
    problems = [task.sample(rng) for _ in range(3000)]

    def solver(p, k):
        written = [str(v) for v in _ladder_running(p.prompt)[:k]]
        return ",".join(written) + "|" + (written[-1] if written else "0")

    means = []
    for k in range(task.max_terms):
        right = [reward(solver(p, k), p) == 1.0 for p in problems]
        short = [_ladder_terms(p.prompt) <= k + 1 for p in problems]
        assert all(r for r, s in zip(right, short, strict=True) if s)  # every chain of at most k + 1 terms
        beyond = [r for r, s in zip(right, short, strict=True) if not s]
        if beyond:
            assert sum(beyond) / len(beyond) < 0.15  # and about 1 in 10 of the longer ones
        means.append(sum(right) / len(right))
    assert all(b > a + 0.04 for a, b in itertools.pairwise(means))  # each further step solves more
    assert means[0] < 0.15 and means[-1] == 1.0
    # more work is a longer response: k >= 1 steps take 2k + 1 characters, none takes 2
    assert [len(solver(problems[0], k)) for k in range(4)] == [2, 3, 5, 7]


def test_ladder_settings_are_checked():
    from pgloss.lab.tasks import LadderTask

    with pytest.raises(ValueError, match="stop_prob"):
        LadderTask(stop_prob=0.0)
    with pytest.raises(ValueError, match="min_terms"):
        LadderTask(min_terms=1)
    with pytest.raises(ValueError, match="work_prob"):
        LadderTask(work_prob=1.5)


def test_taught_leaves_out_the_commas_or_the_answer_as_the_problem_says():
    p = Problem("3+1*3=", "2", ("4", "2"))
    assert taught(p, "4,2|2") == [True] * 5  # by default every character
    work = Problem("3+1*3=", "2", ("4", "2"), teach_continue=False)
    assert taught(work, "4,2|2") == [True, False, True, True, True]  # not where it goes on
    prefix = Problem("3+1*3=", "2", ("4",), teach_answer=False)
    assert taught(prefix, "4|2") == [True, True, False]  # not the answer it cannot compute
    assert taught(prefix, "4|12") == [True, True, False, False]


def test_the_warm_start_learns_only_the_taught_tokens():
    """A warm start on one demonstration, ``4|7``, learns its answer 7 where the problem teaches it and not
    where it does not (the answer's probability stays near where it started), while learning the rest."""
    import torch

    from pgloss.lab.config import LabConfig
    from pgloss.lab.sampling import response_log_probs, teacher_forced
    from pgloss.lab.trainer import build, warm_start

    class Fixed:
        name, max_terms, max_response_chars = "fixed", 3, 8

        def __init__(self, teach_answer):
            self.problem = Problem("3+1*3=", "7", ("4",), teach_answer=teach_answer)

        def sample(self, rng):
            return self.problem

    cfg = LabConfig(
        task="chain", warm_steps=60, warm_batch=4, warm_lr=1e-2, d_model=16, n_layer=1, n_head=2, scratchpad_prob=1.0
    )
    probs = {}
    for teach in (True, False):
        tokenizer, _, model = build(cfg)
        warm_start(model, Fixed(teach), tokenizer, cfg)
        batch = teacher_forced([tokenizer.encode("3+1*3=")], [tokenizer.encode("4|7")])
        with torch.no_grad():
            probs[teach] = response_log_probs(model, batch, temperature=1.0)[0][0].exp()  # 4, |, 7, end
    assert probs[True][2] > 0.9 and probs[False][2] < 0.2  # the answer: learned, or not
    assert probs[True][:2].min() > 0.9 and probs[False][:2].min() > 0.9  # the work: learned either way
