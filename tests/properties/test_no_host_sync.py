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
import steps
import torch
from host_sync import DEVICES, HostSync, no_host_sync, no_host_sync_on, on

import pgloss
from pgloss.core.aggregate import AGG_MODES
from pgloss.core.checks import anomaly_enabled
from pgloss.core.inputs import OPTIONAL_INPUTS
from pgloss.correction import m2po, token_masks
from pgloss.correction.gating import GATE_LEVELS, GATE_STATISTICS, Gate
from pgloss.correction.rejection import REJECTION_OPTIONS, Rejection
from pgloss.correction.rollout import WEIGHT_LEVELS, WEIGHT_MODES, RolloutCorrection
from pgloss.from_hidden import PASSED_INPUTS as PASSED_TO_FROM_HIDDEN
from pgloss.kl.corrections import KL_CORRECTIONS, KL_OPTIONS
from pgloss.losses.ppo import ClippedPolicy

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


def build(name, kind="none", width=WIDTH, **hyperparameters):
    name, term = TERMS.get(name, (name, {}))
    return pgloss.get(name, generation_budget=width, rollout_correction=CORRECTIONS[kind], **term, **hyperparameters)


def meta_inputs(rows=ROWS):
    """Every optional input a call may take, on `meta`; each algorithm reads what it needs."""

    def empty(spec):
        shape = (rows, WIDTH) if spec.per == "token" else (rows,)
        return torch.empty(
            shape, dtype={"integer": torch.long, "bool": torch.bool}.get(spec.kind, torch.float32), device=META
        )

    optional = {name: empty(spec) for name, spec in OPTIONAL_INPUTS.items() if name != "full_kl"}
    return dict(
        old_log_prob=torch.empty(rows, WIDTH, device=META),
        advantages=torch.empty(rows, device=META),
        mask=torch.empty(rows, WIDTH, dtype=torch.bool, device=META),
        **optional,
    )


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
    step = algorithm.step_normalizer(
        both("mask"),
        old_log_probs=both("old_log_prob"),
        rollout_log_probs=both("rollout_log_prob"),
        group_ids=both("group_ids"),
        scores=both("scores"),
        expert=both("expert"),
    )
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
        extra |= dict(
            ref_hidden=torch.empty(ROWS, WIDTH, HIDDEN, device=META), ref_weight=torch.empty(VOCAB, HIDDEN, device=META)
        )
    out = algorithm.from_hidden(
        hidden,
        weight,
        targets,
        old_log_prob=data["old_log_prob"],
        advantages=data["advantages"],
        mask=data["mask"],
        **extra,
    )
    out.loss.backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    assert out.metrics["kl"].device == META


def test_from_hidden_with_a_correction_and_the_exact_kl_from_logits_run_on_meta_tensors():
    data = meta_inputs()
    hidden = torch.empty(ROWS, WIDTH, HIDDEN, device=META, requires_grad=True)
    weight = torch.empty(VOCAB, HIDDEN, device=META, requires_grad=True)
    targets = torch.empty(ROWS, WIDTH, dtype=torch.long, device=META)
    for kind in CORRECTIONS:
        out = build("dapo", kind).from_hidden(
            hidden,
            weight,
            targets,
            old_log_prob=data["old_log_prob"],
            advantages=data["advantages"],
            mask=data["mask"],
            rollout_log_prob=data["rollout_log_prob"],
        )
        out.loss.backward()
    logits = torch.empty(ROWS, WIDTH, VOCAB, device=META, requires_grad=True)
    full_kl = pgloss.full_kl_from_logits(logits, torch.empty(ROWS, WIDTH, VOCAB, device=META))
    log_prob, entropy = pgloss.log_prob_and_entropy(logits, targets)
    out = build("grpo", kl_estimator="full")(
        log_prob, data["old_log_prob"], data["advantages"], data["mask"], full_kl=full_kl, entropy=entropy
    )
    out.loss.backward()
    assert logits.grad.shape == logits.shape


def cpu_inputs(algorithm, seed=0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(ROWS, WIDTH, generator=g) * 2 - 0.05
    noisy = lambda scale: -(old + scale * torch.randn(ROWS, WIDTH, generator=g)).abs()  # noqa: E731
    mask = torch.rand(ROWS, WIDTH, generator=g) < 0.8
    mask[2] = False  # an empty row
    inputs = dict(old_log_prob=old, advantages=torch.randn(ROWS, generator=g), mask=mask)
    available = dict(
        ref_log_prob=noisy(0.1),
        group_ids=torch.arange(ROWS) // 2,
        scores=torch.randn(ROWS, generator=g),
        teacher_log_prob=noisy(0.2),
    )
    inputs |= {key: value for key, value in available.items() if key in algorithm.needs}
    if "expert" in algorithm.reads:  # CHORD's demonstration rows (an input it reads without needing it)
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


# ---- the syncs meta tensors cannot see: a dispatch-level detector on CPU tensors (host_sync.py) ----

SYNCS = {  # one of each kind the detector refuses, and what it must say
    "new_tensor of a number": (lambda x, m: x.new_tensor(-torch.inf), "lift_fresh"),
    "torch.tensor": (lambda x, m: torch.tensor(1.0, device=x.device), "lift_fresh"),
    "as_tensor of a list": (lambda x, m: torch.as_tensor([1.0, 2.0]), "lift_fresh"),
    ".item()": (lambda x, m: x.sum().item(), "_local_scalar_dense"),
    "bool(tensor)": (lambda x, m: bool(m.any()), "_local_scalar_dense"),
    "a 0-d index": (lambda x, m: x[m.sum()], "_local_scalar_dense"),
    "bool-mask indexing": (lambda x, m: x[m], "bool mask"),
    "bool-mask assignment": (lambda x, m: x.clone().__setitem__(m, x.new_full((), 1.0)), "bool mask"),
    "nonzero": (lambda x, m: m.nonzero(), "nonzero"),
    "torch.where(cond)": (lambda x, m: torch.where(m), "nonzero"),
    "masked_select": (lambda x, m: x.masked_select(m), "masked_select"),
    "unique": (lambda x, m: torch.unique(m), "unique"),
    "repeat_interleave": (lambda x, m: torch.repeat_interleave(x[0].long().abs()), "repeat_interleave"),
    "torch.equal": (lambda x, m: torch.equal(x, x), "equal"),
    "tolist": (lambda x, m: x.tolist(), "tolist"),
    "to another device": (lambda x, m: x.to("meta"), "copies from cpu to meta"),
    "a bool viewed as uint8 (a compile hazard)": (lambda x, m: m.view(torch.uint8).argmax(), "dtype"),
}
ALLOWED = {  # fills and Python operands: no copy, no read
    "full": lambda x, m: torch.full((2,), -torch.inf, device=x.device),
    "new_full": lambda x, m: x.new_full((), 1.0),
    "zeros": lambda x, m: torch.zeros(3, device=x.device),
    "where with a number": lambda x, m: torch.where(m, x, 0.0),
    "clamp with numbers": lambda x, m: x.clamp(-1.0, 1.0),
    "integer indexing": lambda x, m: x.gather(1, m.long()),
    "repeat_interleave with output_size": lambda x, m: torch.repeat_interleave(
        torch.arange(3), torch.full((3,), 2), output_size=6
    ),
    "assert_async": lambda x, m: torch._assert_async(m.sum() >= 0, "a count is never negative"),
}


@pytest.mark.parametrize("kind", SYNCS)
def test_the_detector_refuses_each_kind_of_host_sync(kind):
    code, says = SYNCS[kind]
    x = torch.randn(3, 4)
    with pytest.raises(HostSync, match=says), no_host_sync():
        code(x, x > 0)


@pytest.mark.parametrize("kind", ALLOWED)
def test_the_detector_allows_fills_and_python_operands(kind):
    x = torch.randn(3, 4)
    with no_host_sync():
        ALLOWED[kind](x, x > 0)


def test_the_detector_sees_a_backward_and_the_value_checks_run_as_on_an_accelerator():
    class Reads(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad * grad.new_tensor(2.0)

    x = torch.randn(3, requires_grad=True)
    y = Reads.apply(x).sum()
    with pytest.raises(HostSync, match="lift_fresh"), no_host_sync():
        y.backward()
    positive = torch.full((2, 3), 0.5)  # probabilities passed as log-probs: refused by a CPU value check
    with pytest.raises(ValueError, match="log-probabilities"):
        pgloss.get("ppo")(positive, positive, torch.ones(2), torch.ones(2, 3, dtype=torch.bool))


def sync_free_inputs(seed=0):
    """steps.data()'s step in float32 (the dtype a trainer passes), with CHORD's expert rows and an
    entropy with its gradient: every optional input, each name reads what it needs."""
    hidden, weight, targets, inputs = steps.data(seed)
    inputs = {k: v.float() if v.is_floating_point() else v for k, v in inputs.items()}
    inputs["expert"] = torch.arange(steps.ROWS) % 3 == 0
    log_prob = steps.log_probs(hidden, weight, targets).float()
    return hidden.float(), weight.float(), targets, log_prob, inputs


def counted_step(algorithm, inputs):
    """The step's `Normalizer`, counted before the calls (a step-level collective may sync)."""
    keys = dict(
        old_log_probs="old_log_prob",
        rollout_log_probs="rollout_log_prob",
        group_ids="group_ids",
        scores="scores",
        expert="expert",
    )
    return algorithm.step_normalizer(
        [inputs["mask"]], **{arg: [inputs[key]] for arg, key in keys.items() if key in inputs}
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name, kind", list(cases()))
def test_every_name_and_correction_calls_without_a_host_sync(name, kind, device):
    """Forward and backward, as a whole step and with the step's `Normalizer`, with the KL and entropy
    terms on: no operation that would make the host wait for an accelerator."""
    algorithm = build(name, kind, width=steps.WIDTH, kl_coef=0.1, entropy_coef=0.01)
    _, _, _, log_prob, inputs = sync_free_inputs()
    if kind == "none" and not algorithm.consumes_rollout_log_prob:
        inputs.pop("rollout_log_prob")
    inputs = on(device, inputs)
    normalizer = counted_step(algorithm, inputs)
    log_prob = log_prob.to(device).requires_grad_(True)
    entropy = torch.rand(log_prob.shape, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_(True)
    with no_host_sync_on(device):
        torch.manual_seed(0)  # Clip-Cov and KL-Cov draw from the global generator
        whole = algorithm(log_prob, **inputs, entropy=entropy)
        torch.manual_seed(0)
        step = algorithm(log_prob, **inputs, entropy=entropy, normalizer=normalizer)
        (whole.loss + step.loss).backward()
    torch.testing.assert_close(whole.loss, step.loss)  # one micro-batch is the whole step
    assert log_prob.grad.abs().sum() > 0 and torch.isfinite(log_prob.grad).all()


# Whole-vocabulary chunks, and vocabulary tiles of 4 columns with whole rows per chunk (the one-pass
# route) or 5-token chunks (the recompute route), as in test_paths.py.
TILES = {
    "whole": {},
    "tiles one pass": dict(chunk_size=12, vocab_block=4),
    "tiles recompute": dict(chunk_size=5, vocab_block=4),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("exact_kl", [False, True], ids=["sampled KL", "full KL"])
def test_from_hidden_calls_without_a_host_sync(name, exact_kl, tiles, device):
    algorithm = build(name, width=steps.WIDTH, kl_coef=0.1, kl_estimator="full" if exact_kl else "k3")
    hidden, weight, targets, _, inputs = sync_free_inputs()
    hidden, weight, targets, inputs = hidden.to(device), weight.to(device), targets.to(device), on(device, inputs)
    extra = {key: value for key, value in inputs.items() if key in PASSED_TO_FROM_HIDDEN}
    if not algorithm.consumes_rollout_log_prob:
        extra.pop("rollout_log_prob")
    if exact_kl:
        extra |= dict(ref_hidden=hidden + 0.1, ref_weight=weight.flip(0))
    hidden.requires_grad_(True), weight.requires_grad_(True)
    with no_host_sync_on(device):
        out = algorithm.from_hidden(
            hidden,
            weight,
            targets,
            old_log_prob=inputs["old_log_prob"],
            advantages=inputs["advantages"],
            mask=inputs["mask"],
            **extra,
            **TILES[tiles],
        )
        out.loss.backward()
    assert hidden.grad.abs().sum() > 0 and weight.grad.abs().sum() > 0


OPTIONS = {  # the options no name takes by default, each on one name
    **{f"grpo {mode}": ("grpo", dict(loss_agg_mode=mode, norm_constant=8.0, delta_l_alpha=0.5)) for mode in AGG_MODES},
    **{f"grpo KL {kl}": ("grpo", dict(kl_coef=0.1, kl_estimator=kl)) for kl in KL_OPTIONS if kl != "full"},
    **{
        f"grpo KL correction {c}": ("grpo", dict(kl_coef=0.1, kl_estimator="k2", kl_correction=c))
        for c in KL_CORRECTIONS
    },
    "ppo delta": ("ppo", dict(delta=2.0)),
    "dual_clip_ppo delta": ("dual_clip_ppo", dict(delta=2.0)),
    **{
        f"correction {level} {mode}": (
            "grpo",
            dict(rollout_correction=RolloutCorrection(weight_level=level, weight_mode=mode, lower=0.5, upper=2.0)),
        )
        for level in WEIGHT_LEVELS
        for mode in WEIGHT_MODES
    },
    **{
        f"rejection {option}": (
            "grpo",
            dict(
                rollout_correction=RolloutCorrection(
                    rejection=(Rejection(option, upper=2.0 if option.endswith("k1") else 0.05),)
                )
            ),
        )
        for option in REJECTION_OPTIONS
    },
    **{
        f"gate {statistic} {level}": (
            "grpo",
            dict(rollout_correction=RolloutCorrection(gates=(Gate(statistic, level, lower=-0.5, upper=0.5),))),
        )
        for statistic in GATE_STATISTICS
        for level in GATE_LEVELS
    },
    "correction bypass, weighing the KL": (
        "grpo",
        dict(kl_coef=0.1, rollout_correction=RolloutCorrection(bypass=True, weight_kl=True)),
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", OPTIONS)
def test_each_option_calls_without_a_host_sync(option, device):
    name, hyperparameters = OPTIONS[option]
    algorithm = pgloss.get(name, **hyperparameters)
    _, _, _, log_prob, inputs = sync_free_inputs()
    inputs, log_prob = on(device, inputs), log_prob.to(device).requires_grad_(True)
    with no_host_sync_on(device):
        algorithm(log_prob, **inputs).loss.backward()
    assert log_prob.grad.abs().sum() > 0


def test_the_micro_batch_masks_and_corrections_compute_without_a_host_sync():
    """The token masks a trainer applies to each micro-batch before the call (their step-level cuts,
    `entropy_threshold` and `m2po_cutoff`, read the host once per step, before), given a cut as a number
    or as a tensor, and the rollout correction's rejection mask."""
    _, _, _, log_prob, inputs = sync_free_inputs()
    mask, old, rollout = inputs["mask"], inputs["old_log_prob"], inputs["rollout_log_prob"]
    entropy = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2))
    threshold = token_masks.entropy_threshold(entropy, mask, top=0.5)
    cutoff = m2po.m2po_cutoff(rollout, old, mask, threshold=0.04)
    expected = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3))
    correction = RolloutCorrection(rejection=(Rejection("seq_max_k2", upper=0.05), Rejection("token_k1", upper=2.0)))
    with no_host_sync():
        masks = {
            "top entropy, tensor cut": token_masks.top_entropy_mask(entropy, mask, threshold),
            "top entropy, number cut": token_masks.top_entropy_mask(entropy, mask, 0.5),
            "truncated": token_masks.truncated_completion_mask(mask, torch.arange(steps.ROWS) % 2 == 0),
            "m2po, tensor cut": m2po.m2po_mask(rollout, old, mask, cutoff),
            "m2po, number cut": m2po.m2po_mask(rollout, old, mask, 0.01),
            "clip_b": token_masks.clip_b_mask(log_prob, entropy, inputs["advantages"], mask),
            "clip_v": token_masks.clip_v_mask(log_prob, entropy, expected, inputs["advantages"], mask, max_frac=0.1),
            "rejection": correction.keep_mask(mask, old, rollout),
        }
    for kind, kept in masks.items():
        assert kept.dtype == torch.bool and not (kept & ~mask).any(), kind


@pytest.mark.compile
def test_dual_clip_ppo_compiles_whole_at_a_moderate_size():
    """The small shapes above compile without splitting a reduction; inductor splits the large ones
    (on CUDA an argmax over a bool viewed as uint8 failed there, at B=64, T=4096). A loss call with its
    metrics and a step's `Normalizer`, forward and backward, at 32 x 2048 with uneven lengths: the
    eager values, the eager gradient."""
    g = torch.Generator().manual_seed(0)
    rows, width = 32, 2048
    old = -torch.rand(rows, width, generator=g) * 3
    log_prob = -(old + 0.2 * torch.randn(rows, width, generator=g)).abs()
    mask = torch.arange(width) < torch.randint(width // 8, width + 1, (rows, 1), generator=g)
    mask[3] = False
    advantages = torch.randn(rows, width, generator=g)
    algorithm = pgloss.get("dual_clip_ppo")
    normalizer = pgloss.Normalizer.count(mask)

    def call(lp):
        out = algorithm(lp, old, advantages, mask, normalizer=normalizer)
        return out.loss, out.metrics

    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    x, y = log_prob.clone().requires_grad_(), log_prob.clone().requires_grad_()
    (loss, metrics), (expected, expected_metrics) = compiled(x), call(y)
    (loss + expected).backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-5, atol=1e-9)
    assert metrics.keys() == expected_metrics.keys()
    for key in ("ratio_min", "ratio_max", "pg_clipfrac", "pg_clipfrac_lower"):
        assert metrics[key] == expected_metrics[key], key  # extremes and counts: exact
    assert expected_metrics["ratio_min"] < 1 < expected_metrics["ratio_max"]
