"""No host sync inside a loss call, proven without an accelerator.

`meta` tensors have shapes and no values: any `.item()`, `bool(tensor)`, `int(tensor)`, `.tolist()`
or Python-level indexing by a tensor raises there, exactly where an accelerator would wait for
the host. Every name runs end to end, forward and backward, on them: with each kind of rollout
correction, as a whole step and as a micro-batch of a step counted by `step_normalizer`, from
hidden states, and with the exact full-vocabulary KL; `detect_anomaly` is off (its checks are the
opt-in syncs). Then `torch.compile(fullgraph=True)` (CPU inductor) of a loss call, forward and
backward, for every name: a host read would be a graph break, which fullgraph refuses.
"""

import dataclasses

import pytest
import torch

import pgloss
from pgloss.core.inputs import OPTIONAL_INPUTS
from pgloss.core.checks import anomaly_enabled
from pgloss.losses.ppo import ClippedPolicy
from pgloss.correction.rollout import Rejection, RolloutCorrection
from pgloss.vocab.fused import PASSED_INPUTS as PASSED_TO_FROM_HIDDEN

CORRECTIONS = {
    "none": None,
    "token TIS": RolloutCorrection(upper=2.0),
    "k3 rejection": RolloutCorrection(rejection=(Rejection("token_k3", upper=0.05),)),
    "batch-normalised": RolloutCorrection(upper=2.0, batch_normalize=True),
    "off-policy mask": RolloutCorrection(weight_level=None, off_policy_mask=0.1),
}
ROWS, WIDTH, HIDDEN, VOCAB = 6, 5, 4, 7
META = torch.device("meta")
TERMS = {  # configurations no name has by default: the terms and aggregations beside the policy loss
    "dapo+positive_nll": ("dapo", dict(positive_nll_coef=0.5)),
    "grpo+delta-l-norm": ("grpo", dict(loss_agg_mode="delta-l-norm", delta_l_alpha=0.5)),
    "opd+trainer-options": ("opd", dict(opd_advantage_policy="current", opd_trust_region=0.2, opd_discount=0.9)),
}
NAMES = [*pgloss.names(), *TERMS]


def cases():
    for name in NAMES:
        for kind, correction in CORRECTIONS.items():
            if correction is not None and build(name).consumes_rollout_log_prob:
                continue  # VESPO weighs by the rollout log-probs itself (its own case: "none" with them)
            yield pytest.param(name, kind, id=f"{name}-{kind}")


def build(name, kind="none", **hyperparameters):
    name, term = TERMS.get(name, (name, {}))
    return pgloss.get(name, generation_budget=WIDTH, rollout_correction=CORRECTIONS[kind], **term, **hyperparameters)


def meta_inputs(rows=ROWS):
    """Every optional input a call may take, on `meta`; each algorithm reads what it needs."""
    def empty(spec):
        shape = (rows, WIDTH) if spec.per == "token" else (rows,)
        return torch.empty(shape, dtype={"integer": torch.long, "bool": torch.bool}.get(spec.kind, torch.float32), device=META)

    optional = {name: empty(spec) for name, spec in OPTIONAL_INPUTS.items() if name != "full_kl"}
    return dict(old_log_prob=torch.empty(rows, WIDTH, device=META), advantages=torch.empty(rows, device=META),
                mask=torch.empty(rows, WIDTH, dtype=torch.bool, device=META), **optional)


def test_meta_tensors_catch_a_host_read():
    """The harness can fail: a family that reads a value on the host raises on meta tensors."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Syncing(ClippedPolicy):
        def policy_terms(self, batch):
            terms = super().policy_terms(batch)
            if bool(batch.mask.any()):  # a host read
                return terms
            return terms

    data = meta_inputs()
    log_prob = torch.empty(ROWS, WIDTH, device=META, requires_grad=True)
    with pytest.raises(RuntimeError, match="meta"):
        Syncing()(log_prob, data["old_log_prob"], data["advantages"], data["mask"])
    with pytest.raises(RuntimeError, match="meta"):
        torch.ones(3, device=META)[torch.tensor(1, device=META)].sum().item()


@pytest.mark.parametrize("name, kind", list(cases()))
def test_every_name_and_correction_runs_on_meta_tensors(name, kind):
    assert not anomaly_enabled()
    algorithm = build(name, kind, kl_coef=0.1, entropy_coef=0.01)
    data = meta_inputs()
    log_prob = torch.empty(ROWS, WIDTH, device=META, requires_grad=True)
    entropy = torch.empty(ROWS, WIDTH, device=META, requires_grad=True)
    inputs = {**data, "entropy": entropy}
    if kind == "none" and not algorithm.consumes_rollout_log_prob:
        inputs.pop("rollout_log_prob")  # "none": no rollout log-probs, no truncated IS weight either
    whole = algorithm(log_prob, **inputs)  # the call counts itself (algorithm.step_normalizer)
    both = lambda key: [data[key], data[key][:2]] if key in inputs else None  # noqa: E731  (a step of two)
    step = algorithm.step_normalizer(both("mask"), old_log_probs=both("old_log_prob"),
                                     rollout_log_probs=both("rollout_log_prob"), group_ids=both("group_ids"),
                                     scores=both("scores"), expert=both("expert"))
    micro = algorithm(log_prob, **inputs, normalizer=step)
    (whole.loss + micro.loss).backward()
    assert whole.loss.device == META and whole.loss.shape == ()
    assert log_prob.grad.shape == (ROWS, WIDTH) and entropy.grad.shape == (ROWS, WIDTH)
    assert all(value.shape == () and value.device == META for value in whole.metrics.values())
    assert "pg_loss" in whole.metrics and "kl" in whole.metrics


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("exact_kl", [False, True], ids=["sampled KL", "full KL"])
def test_from_hidden_runs_on_meta_tensors(name, exact_kl):
    """Both routes of the fused path (one pass, and recompute for row-coupled losses and the exact
    KL), with the reference's hidden states for kl_estimator="full"."""
    algorithm = build(name, kl_coef=0.1, kl_estimator="full" if exact_kl else "k3")
    data = meta_inputs()
    hidden = torch.empty(ROWS, WIDTH, HIDDEN, device=META, requires_grad=True)
    weight = torch.empty(VOCAB, HIDDEN, device=META, requires_grad=True)
    targets = torch.empty(ROWS, WIDTH, dtype=torch.long, device=META)
    extra = {key: value for key, value in data.items() if key in PASSED_TO_FROM_HIDDEN}
    if not algorithm.consumes_rollout_log_prob:
        extra.pop("rollout_log_prob")  # no rollout correction here: the next test has them
    if exact_kl:
        extra |= dict(ref_hidden=torch.empty(ROWS, WIDTH, HIDDEN, device=META),
                      ref_weight=torch.empty(VOCAB, HIDDEN, device=META))
    out = algorithm.from_hidden(hidden, weight, targets, old_log_prob=data["old_log_prob"],
                                advantages=data["advantages"], mask=data["mask"], **extra)
    out.loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    assert out.metrics["kl"].device == META


def test_from_hidden_with_a_correction_and_the_exact_kl_from_logits_run_on_meta_tensors():
    data = meta_inputs()
    hidden = torch.empty(ROWS, WIDTH, HIDDEN, device=META, requires_grad=True)
    weight = torch.empty(VOCAB, HIDDEN, device=META, requires_grad=True)
    targets = torch.empty(ROWS, WIDTH, dtype=torch.long, device=META)
    for kind in CORRECTIONS:
        out = build("dapo", kind).from_hidden(hidden, weight, targets, old_log_prob=data["old_log_prob"],
                                              advantages=data["advantages"], mask=data["mask"],
                                              rollout_log_prob=data["rollout_log_prob"])
        out.loss.backward()
    logits = torch.empty(ROWS, WIDTH, VOCAB, device=META, requires_grad=True)
    full_kl = pgloss.full_kl_from_logits(logits, torch.empty(ROWS, WIDTH, VOCAB, device=META))
    log_prob, entropy = pgloss.log_prob_and_entropy(logits, targets)
    out = build("grpo", kl_estimator="full")(log_prob, data["old_log_prob"], data["advantages"], data["mask"],
                                            full_kl=full_kl, entropy=entropy)
    out.loss.backward()
    assert logits.grad.shape == logits.shape


def cpu_inputs(algorithm, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(ROWS, WIDTH, generator=g) * 2 - 0.05
    noisy = lambda scale: -(old + scale * torch.randn(ROWS, WIDTH, generator=g)).abs()  # noqa: E731
    mask = torch.rand(ROWS, WIDTH, generator=g) < 0.8
    mask[2] = False  # an empty row
    inputs = dict(old_log_prob=old, advantages=torch.randn(ROWS, generator=g), mask=mask)
    available = dict(ref_log_prob=noisy(0.1), group_ids=torch.arange(ROWS) // 2, scores=torch.randn(ROWS, generator=g),
                     teacher_log_prob=noisy(0.2))
    inputs |= {key: value for key, value in available.items() if key in algorithm.needs}
    if algorithm.takes_expert:  # CHORD's demonstration rows (an input it reads without needing it)
        inputs["expert"] = torch.arange(ROWS) % 3 == 0
    return noisy(0.3), inputs


@pytest.mark.compile
@pytest.mark.parametrize("name", NAMES)
def test_a_loss_call_compiles_whole_forward_and_backward(name):
    """One graph (fullgraph=True: a host read or an untraceable call would fail here), CPU inductor,
    with the eager loss and gradient. Each name is compiled once, on small shapes."""
    algorithm = build(name)
    log_prob, inputs = cpu_inputs(algorithm)
    torch._dynamo.reset()
    compiled = torch.compile(lambda lp, **kw: algorithm(lp, **kw).loss, fullgraph=True, backend="inductor")
    x, y = log_prob.clone().requires_grad_(), log_prob.clone().requires_grad_()
    loss = compiled(x, **inputs)
    loss.backward()
    expected = algorithm(y, **inputs).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-6)
