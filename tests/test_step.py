"""`pgloss.Step`: one optimizer step counted once, whose micro-batches' calls add up to one call on the
whole step, in loss, gradient and metrics; the object the TRL and verl adapters run their calls through."""

import pytest
import torch
from conftest import log_probs
from properties.micro_batches import parts_of

import pgloss
from pgloss.correction.rejection import Rejection

ROWS, WIDTH = 9, 10
PARTS = parts_of([2, 4, 3])  # uneven micro-batches


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(ROWS, WIDTH, generator=g) < 0.8
    mask[4] = False  # an empty row
    old = -torch.rand(ROWS, WIDTH, generator=g, dtype=torch.float64) * 2
    return dict(
        log_prob=log_probs(old + 0.1 * torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)),
        old_log_prob=old,
        advantages=torch.randn(ROWS, generator=g, dtype=torch.float64),
        mask=mask,
        ref_log_prob=log_probs(old + 0.2 * torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)),
        rollout_log_prob=log_probs(old + 0.3 * torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)),
        group_ids=torch.arange(ROWS) // 3,
    )


ALGORITHMS = {
    "dapo": pgloss.get("dapo"),
    "grpo, group-mean-token-mean": pgloss.get("grpo", loss_agg_mode="group-mean-token-mean"),
    "dr_grpo": pgloss.get("dr_grpo", norm_constant=float(WIDTH)),
    "dapo, rejection": pgloss.get(
        "dapo", rollout_correction=pgloss.RolloutCorrection(rejection=(Rejection("token_k3", upper=0.05),))
    ),
}


def rows(data, part):
    return {name: value[part] for name, value in data.items()}


@pytest.mark.parametrize("name", ALGORITHMS)
def test_micro_batches_through_a_step_add_up_to_one_call(name):
    """Σ of the micro-batches' losses and gradients is the whole call's; the step's metrics are the whole
    call's metrics (a mean over the step's tokens, the loss terms summed)."""
    algorithm = ALGORITHMS[name]
    data = batch()
    leaf = data.pop("log_prob").requires_grad_(True)
    whole = algorithm(leaf, **data)
    (grad_whole,) = torch.autograd.grad(whole.loss, leaf)
    alone = pgloss.StepMetrics()
    alone.add(whole)

    step = pgloss.Step(algorithm, [rows(data, part) for part in PARTS])
    total = sum(step(log_prob=leaf[part], **micro).loss for part, micro in zip(PARTS, step.micro_batches, strict=True))
    (grad_split,) = torch.autograd.grad(total, leaf)
    torch.testing.assert_close(total.detach(), whole.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-14)
    mine, theirs = step.metrics.as_floats(), alone.as_floats()
    assert mine.keys() == theirs.keys()
    assert mine == pytest.approx(theirs, rel=1e-6, abs=1e-9)  # fractions are float32 means


def test_the_step_is_counted_once(monkeypatch):
    algorithm = pgloss.get("dapo")
    counted = []
    count_step = pgloss.Algorithm.count_step

    def counting(self, *args, **kwargs):
        counted.append(1)
        return count_step(self, *args, **kwargs)

    monkeypatch.setattr(pgloss.Algorithm, "count_step", counting)
    data = batch()
    data.pop("rollout_log_prob")  # counted through count_step itself (no rollout correction to count)
    step = pgloss.Step(algorithm, [rows(data, part) for part in PARTS])
    assert len(counted) == 1
    for micro in step.micro_batches:
        step(**micro)
    assert len(counted) == 1


def test_a_step_from_counts_the_trainer_made():
    """`normalizer=`: the trainer's own counts (verl's global_batch_info), passed to every call."""
    algorithm = pgloss.get("dapo")
    data = batch()
    tokens = 2 * data["mask"].sum().double()  # the trainer's, over a step twice this batch
    normalizer = pgloss.Normalizer(tokens=tokens, sequences=torch.tensor(16.0, dtype=torch.float64))
    step = pgloss.Step(algorithm, normalizer=normalizer)
    assert step.normalizer is normalizer and step.micro_batches == ()
    torch.testing.assert_close(step(**data).loss, algorithm(**data, normalizer=normalizer).loss)


def test_from_hidden_through_a_step_is_the_algorithm_s_with_the_step_s_counts():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(ROWS, WIDTH, 6, generator=g, dtype=torch.float64)
    weight = torch.randn(11, 6, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 11, (ROWS, WIDTH), generator=g)
    data = batch()
    micro = dict(old_log_prob=None, advantages=data["advantages"], mask=data["mask"])
    algorithm = pgloss.get("dapo")
    step = pgloss.Step(algorithm, [micro])
    mine = step.from_hidden(hidden, weight, targets, **micro)
    theirs = algorithm.from_hidden(hidden, weight, targets, **micro, normalizer=step.normalizer)
    torch.testing.assert_close(mine.loss, theirs.loss)
    assert step.metrics.names == sorted(theirs.stats)


def test_rollout_is_weight_multiplies_the_policy_term_before_the_aggregation():
    """A trainer's importance weight (verl's rollout_is_weights) is an input of the call: the step's loss is the
    aggregation of the weighted policy term, with the step's counts."""
    algorithm = pgloss.get("dapo")
    data = batch()
    data.pop("rollout_log_prob")
    weight = torch.rand(ROWS, WIDTH, generator=torch.Generator().manual_seed(1), dtype=torch.float64) + 0.5
    step = pgloss.Step(algorithm, [data])
    weighted = step(**data, rollout_is_weight=weight)
    plain = algorithm(**data, normalizer=step.normalizer)
    expected = algorithm.aggregate(plain.per_token * weight, data["mask"], step.normalizer)
    torch.testing.assert_close(weighted.loss, expected, rtol=1e-12, atol=1e-14)


def test_metrics_may_go_to_a_step_metrics_of_the_caller():
    """`metrics=`: the calls' metrics are added to the caller's StepMetrics (kept across steps, or reduced
    otherwise than the counts)."""
    algorithm = pgloss.get("dapo")
    data = batch()
    kept = pgloss.StepMetrics(reduce=False)
    for _ in range(2):
        step = pgloss.Step(algorithm, [data], reduce=False, metrics=kept)
        step(**data)
    assert step.metrics is kept and len(kept._calls) == 2


@pytest.mark.parametrize(
    ("build", "error", "match"),
    [
        (lambda a, d: pgloss.Step(a), ValueError, "micro_batches .* or its normalizer"),
        (
            lambda a, d: pgloss.Step(a, [d], normalizer=pgloss.Normalizer.count(d["mask"])),
            ValueError,
            "not both",
        ),
        (lambda a, d: pgloss.Step(a, d), TypeError, "sequence of mappings"),
        (lambda a, d: pgloss.Step("dapo", [d]), TypeError, "pgloss.Algorithm"),
        (lambda a, d: pgloss.Step(a, [{**d, "mask": None}]), ValueError, "needs its mask"),
        (lambda a, d: pgloss.Step(a, [{**d, "rollout_logprob": d["old_log_prob"]}]), TypeError, "rollout_log_prob"),
        (
            lambda a, d: pgloss.Step(a, [rows(d, PARTS[0]), {**rows(d, PARTS[1]), "rollout_log_prob": None}]),
            ValueError,
            "rollout_log_prob is given in some micro-batches",
        ),
        (lambda a, d: pgloss.Step(a, [d])(**d, normalizer=None), TypeError, "step's normalizer"),
    ],
    ids=["neither", "both", "a dict", "a name", "no mask", "misspelt", "partly given", "a normalizer"],
)
def test_refusals(build, error, match):
    with pytest.raises(error, match=match):
        build(pgloss.get("dapo"), batch())
