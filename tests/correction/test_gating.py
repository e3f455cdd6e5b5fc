"""Rollout gating on probabilities (`pgloss.correction.gating`) and ROLL's segment level: against float64 loops,
against ROLL's `compute_train_infer_correction` (read from a ROLL checkout under $PGLOSS_ROLL_SRC; OpenRLHF's gates
are checked against its own `PolicyLoss` by `pgloss conformance`, tests/conformance/test_openrlhf_conformance.py),
composed with a loss, micro-batches against one call, and bad input."""

import math
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import loops
import pytest
import torch
from conftest import log_probs, make_batch
from properties.micro_batches import cut, split_call

import pgloss
from pgloss.conformance.sources import load
from pgloss.correction.gating import GATE_LEVELS, GATE_STATISTICS, Gate, segment_mean
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection

F64 = torch.float64


def turns(seed=0, batch=8, length=12, spread=0.4):
    """A batch whose rows hold several segments (masked gaps, as tool or environment tokens between turns), one
    row empty, rollout log-probs off the old ones by `spread`."""
    d = make_batch(batch=batch, length=length, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    d["mask"] = (torch.rand(batch, length, generator=gen) > 0.3) & (torch.arange(length) < length - 1 - seed % 2)
    d["mask"][3] = False
    d["mask"][0] = torch.tensor([1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 1], dtype=torch.bool)[:length]
    d["rollout_log_prob"] = log_probs(
        d["old_log_prob"] + spread * torch.randn(d["mask"].shape, generator=gen, dtype=F64)
    )
    return d


def apply(correction, d, **kwargs):
    mask = d["mask"]
    zero = lambda x: torch.where(mask, x, 0.0)  # noqa: E731  (as TokenBatch.prepare hands them over)
    return correction.apply(
        log_prob=zero(d["log_prob"]),
        old_log_prob=zero(d["old_log_prob"]),
        rollout_log_prob=zero(d["rollout_log_prob"]),
        mask=mask,
        seq_advantages=d["advantages"],
        **kwargs,
    )


def lists(d, *keys):
    return [d[k].tolist() for k in keys]


def test_turns_hold_several_segments():
    mask = turns()["mask"]
    assert max(len(loops.segments(row)) for row in mask.tolist()) >= 3


def test_segment_mean_matches_loop():
    d = turns(seed=1)
    mask = d["mask"]
    got = segment_mean(d["old_log_prob"], mask)
    want = torch.zeros_like(got)
    for i, row in enumerate(mask.tolist()):
        for run in loops.segments(row):
            want[i, run] = sum(d["old_log_prob"][i, t].item() for t in run) / len(run)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-15)


# the bounds keep some and drop some of each level's units on these batches
BOUNDS = {
    ("binary_kl", "token"): (None, 0.03),
    ("binary_kl", "seq_mean"): (None, 0.06),
    ("binary_kl", "seq_sum"): (None, 0.5),
    ("binary_kl", "segment_mean"): (None, 0.04),
    ("tv", "token"): (None, 0.1),
    ("tv", "seq_mean"): (None, 0.12),
    ("tv", "seq_sum"): (None, 1.0),
    ("tv", "segment_mean"): (0.05, 0.15),
    ("diff", "token"): (-0.1, 0.05),
    ("diff", "seq_mean"): (-0.05, 0.03),
    ("diff", "seq_sum"): (-0.5, 0.2),
    ("diff", "segment_mean"): (-0.05, 0.03),
}


@pytest.mark.parametrize("level", GATE_LEVELS)
@pytest.mark.parametrize("statistic", GATE_STATISTICS)
def test_gate_matches_loop_and_leaves_the_mask(statistic, level):
    d = turns(seed=2)
    lower, upper = BOUNDS[statistic, level]
    gate = Gate(statistic, level, lower=lower, upper=upper)
    out = apply(RolloutCorrection(weight_level=None, gates=(gate,)), d)
    keep = loops.gate_keep(
        *lists(d, "old_log_prob", "rollout_log_prob", "mask"), statistic, level, lower=lower, upper=upper
    )
    want = d["mask"] & torch.tensor(keep)
    assert torch.equal(out.mask, want)
    assert 0 < int(want.sum()) < int(d["mask"].sum())  # the bound binds
    rejected = 1 - int(want.sum()) / int(d["mask"].sum())
    assert float(out.metrics["rollout_rejected_frac"].value) == pytest.approx(rejected)


@pytest.mark.parametrize("k", ["k1", "k2", "k3"])
def test_segment_rejection_matches_loop(k):
    d = turns(seed=3)
    upper, lower = {"k1": (1.3, 0.9), "k2": (0.02, None), "k3": (0.02, None)}[k]
    out = apply(RolloutCorrection(weight_level=None, rejection=(Rejection(f"segment_mean_{k}", upper, lower),)), d)
    keep = loops.kl_rejection_keep(
        *lists(d, "old_log_prob", "rollout_log_prob", "mask"), f"segment_mean_{k}", upper, lower
    )
    want = d["mask"] & torch.tensor(keep)
    assert torch.equal(out.mask, want)
    assert 0 < int(want.sum()) < int(d["mask"].sum())


@pytest.mark.parametrize("mode, lower, upper", [("truncate", None, 1.2), ("mask", 0.8, 1.25)])
def test_segment_weight_matches_loop(mode, lower, upper):
    d = turns(seed=4)
    out = apply(RolloutCorrection(weight_level="segment_geometric", weight_mode=mode, lower=lower, upper=upper), d)
    weight, flags = loops.rollout_weights(
        *lists(d, "old_log_prob", "rollout_log_prob", "mask"),
        level="segment_geometric",
        mode=mode,
        lower=lower,
        upper=upper,
    )
    torch.testing.assert_close(out.weight, torch.tensor(weight, dtype=F64), rtol=1e-12, atol=1e-14)
    assert any(f for row in flags for f in row)
    # a segment's weight is its own: rows with several segments carry several values
    row = out.weight[0][d["mask"][0]]
    assert len(set(row.tolist())) > 1


def test_gate_with_a_weight_composes_with_a_loss_as_the_loop():
    """DAPO with OpenRLHF's sequence binary-KL gate and the untruncated token weight: Σ_kept ρ_t ℓ_t / N."""
    d = turns(seed=5)
    gate = Gate("binary_kl", "seq_mean", upper=0.04)
    corr = RolloutCorrection(weight_level="token", upper=None, gates=(gate,))
    alg = pgloss.get("dapo", rollout_correction=corr)
    for count_rejected in (False, True):
        normalizer = corr.normalizer(d["mask"], d["old_log_prob"], d["rollout_log_prob"], count_rejected=count_rejected)
        out = alg(
            d["log_prob"],
            d["old_log_prob"],
            d["advantages"],
            d["mask"],
            rollout_log_prob=d["rollout_log_prob"],
            normalizer=normalizer,
        )
        train, rollout, mask = lists(d, "old_log_prob", "rollout_log_prob", "mask")
        keep = loops.gate_keep(train, rollout, mask, "binary_kl", "seq_mean", upper=0.04)
        lp, adv = d["log_prob"].tolist(), d["advantages"].tolist()
        total, kept = 0.0, 0
        for i in range(len(mask)):
            for t in range(len(mask[0])):
                if mask[i][t] and keep[i][t]:
                    kept += 1
                    r = math.exp(lp[i][t] - train[i][t])
                    total += math.exp(train[i][t] - rollout[i][t]) * loops.ppo_token(
                        r, adv[i], clip_low=0.2, clip_high=0.28
                    )
        counted = int(d["mask"].sum()) if count_rejected else kept
        assert 0 < kept < int(d["mask"].sum())
        torch.testing.assert_close(out.loss, torch.tensor(total / counted, dtype=F64), rtol=1e-12, atol=1e-14)


PARTS = [slice(0, 3), slice(3, 5), slice(5, 8)]
CORRECTIONS = [
    RolloutCorrection(weight_level="token", upper=None, gates=(Gate("binary_kl", "seq_mean", upper=0.04),)),
    RolloutCorrection(weight_level="token", upper=None, gates=(Gate("tv", "token", upper=0.08),)),
    RolloutCorrection(
        weight_level="segment_geometric",
        upper=1.2,
        batch_normalize=True,
        rejection=(Rejection("segment_mean_k1", 1 / 0.8, 1 / 1.25),),
        gates=(Gate("diff", "segment_mean", lower=-0.03, upper=0.03),),
    ),
]


@pytest.mark.parametrize("corr", CORRECTIONS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("count_rejected", [False, True])
def test_micro_batches_with_the_step_count_match_one_call(corr, mode, count_rejected):
    d = turns(seed=6)
    alg = pgloss.get("grpo", loss_agg_mode=mode, kl_coef=0.05, rollout_correction=corr)
    whole_count = corr.normalizer(d["mask"], d["old_log_prob"], d["rollout_log_prob"], count_rejected=count_rejected)
    whole_lp = d["log_prob"].clone().requires_grad_(True)
    inputs = dict(
        old_log_prob=d["old_log_prob"],
        advantages=d["advantages"],
        mask=d["mask"],
        rollout_log_prob=d["rollout_log_prob"],
        ref_log_prob=d["ref_log_prob"],
    )
    whole = alg(whole_lp, **inputs, normalizer=whole_count)
    whole.loss.backward()
    step = alg.count_step(
        cut(d["mask"], PARTS),
        old_log_prob=cut(d["old_log_prob"], PARTS),
        rollout_log_prob=cut(d["rollout_log_prob"], PARTS),
        count_rejected=count_rejected,
    )
    assert float(step.tokens) == float(whole_count.tokens)
    if not count_rejected:
        assert float(step.tokens) < float(d["mask"].sum())  # the gates are counted before the step
    total, grad = split_call(alg, d["log_prob"], PARTS, step, **inputs)
    torch.testing.assert_close(total, whole.loss.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, whole_lp.grad, rtol=1e-12, atol=1e-14)


def test_a_gate_in_bypass_mode_reads_the_current_policy_and_stays_in_the_denominator():
    d = turns(seed=7)
    gate = Gate("tv", "token", upper=0.08)
    corr = RolloutCorrection(weight_level=None, bypass=True, gates=(gate,))
    out = apply(corr, d)
    keep = loops.gate_keep(*lists(d, "log_prob", "rollout_log_prob", "mask"), "tv", "token", upper=0.08)
    assert torch.equal(out.mask, d["mask"] & torch.tensor(keep))
    counted = corr.normalizer(d["mask"], d["old_log_prob"], d["rollout_log_prob"])
    assert float(counted.tokens) == float(d["mask"].sum())
    with pytest.raises(ValueError, match="with bypass the rejection depends on π_θ"):
        corr.keep_mask(d["mask"], d["old_log_prob"], d["rollout_log_prob"])


@pytest.mark.parametrize(
    "args, kwargs, error, match",
    [
        (("kl",), dict(upper=0.1), ValueError, "Gate statistic must be one of"),
        (("tv", "geometric"), dict(upper=0.1), ValueError, "Gate level must be one of"),
        (("tv",), dict(), ValueError, "needs a bound"),
        (("diff",), dict(lower=0.1, upper=-0.1), ValueError, "lower <= upper"),
        (("binary_kl",), dict(upper=-0.1), ValueError, "need upper >= 0"),
        (("tv",), dict(upper="0.1"), TypeError, "Gate upper"),
        (("tv",), dict(upper=math.nan), ValueError, "Gate upper"),
    ],
)
def test_bad_gate_is_refused(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        Gate(*args, **kwargs)


def test_bad_gates_and_segment_under_sequence_parallel_are_refused():
    with pytest.raises(TypeError, match="gates must be a tuple of pgloss.correction.gating.Gate"):
        RolloutCorrection(gates=("tv",))
    with pytest.raises(ValueError, match="rollout_log_prob"):
        RolloutCorrection(weight_level=None, gates=(Gate("tv", upper=0.1),)).apply(
            log_prob=torch.zeros(2, 3),
            old_log_prob=torch.zeros(2, 3),
            rollout_log_prob=None,
            mask=torch.ones(2, 3, dtype=torch.bool),
        )
    assert RolloutCorrection(weight_level=None, gates=[Gate("tv", upper=0.1)]).gates == (Gate("tv", upper=0.1),)
    with pytest.raises(ValueError, match="segment_mean .*sequence_parallel"):
        segment_mean(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), SimpleNamespace())  # a stand-in group


# -- ROLL's own function ------------------------------------------------------------------------------------------

ROLL_VARIABLE = "PGLOSS_ROLL_SRC"
ROLL_FILES = {
    "roll/utils/functionals.py": ("masked_mean", "masked_sum", "agg_loss"),
    "roll/pipeline/agentic/utils.py": ("compute_segment_masked_mean",),
    "roll/utils/train_infer_corrections.py": (
        "_compute_all_granularity",
        "_infer_global_valid_samples_from_mask",
        "_infer_global_valid_tokens_from_mask",
        "compute_train_infer_correction",
    ),
}
"""alibaba/ROLL (main, checked at 8eb27cc), Apache-2.0: `compute_train_infer_correction` and what it calls, run
from the files of a ROLL checkout (ROLL is not on the package index; its package imports its whole training
stack)."""


def roll_namespace() -> dict:
    root = os.environ.get(ROLL_VARIABLE)
    if not root:
        pytest.skip(f"set {ROLL_VARIABLE} to the root of a checkout of alibaba/ROLL to test against its code")
    namespace: dict = dict(torch=torch, Optional=Optional, Dict=dict, Tuple=tuple)
    for relative, names in ROLL_FILES.items():
        path = Path(root) / relative
        if not path.is_file():
            pytest.fail(f"${ROLL_VARIABLE}={root} holds no {relative}")
        load(path, names, namespace)
    return namespace


LEVELS = {"token": "token", "geometric": "seq_mean", "sequence": "seq_sum", "segment": "segment_mean"}
WEIGHTS = {
    "token": "token",
    "geometric": "sequence_geometric",
    "sequence": "sequence_product",
    "segment": "segment_geometric",
}


def roll_correction(weight_type, upper_bound, filters):
    """pgloss's RolloutCorrection for ROLL's `TrainInferCorrectionConfig`: the IS weight at `weight_type`, truncated
    at `upper_bound`; a ratio filter [low, high] as the k1 rejection on π_rollout/π_train in [1/high, 1/low], a
    difference filter [low, high] as a `diff` gate, each at its `agg_type`."""
    rejection, gates = [], []
    for f in filters:
        if f.ratio_enabled:
            rejection.append(Rejection(f"{LEVELS[f.agg_type]}_k1", 1 / f.ratio_low, 1 / f.ratio_high))
        if f.diff_enabled:
            gates.append(Gate("diff", LEVELS[f.agg_type], lower=f.diff_low, upper=f.diff_high))
    return RolloutCorrection(
        weight_level=WEIGHTS[weight_type], upper=upper_bound, rejection=tuple(rejection), gates=tuple(gates)
    )


def roll_filter(agg, ratio=None, diff=None):
    return SimpleNamespace(
        enabled=True,
        agg_type=agg,
        ratio_enabled=ratio is not None,
        ratio_low=(ratio or (0.8, 1.2))[0],
        ratio_high=(ratio or (0.8, 1.2))[1],
        diff_enabled=diff is not None,
        diff_low=(diff or (-0.2, 0.2))[0],
        diff_high=(diff or (-0.2, 0.2))[1],
    )


ROLL_RATIO_BANDS = {"token": (0.8, 1.25), "geometric": (0.9, 1.1), "sequence": (0.5, 2.0), "segment": (0.9, 1.1)}
ROLL_DIFF_BANDS = {
    "token": (-0.05, 0.05),
    "geometric": (-0.03, 0.03),
    "sequence": (-0.2, 0.2),
    "segment": (-0.03, 0.03),
}
ROLL_TOLERANCE = 1e-12
"""Relative, float64. ROLL's `masked_mean` divides by the count plus 1e-8, which leaves the count exact: the count
of its integer mask (`response_mask.long()`) plus 1e-8 is a float32 n (measured: 2e-16)."""


@pytest.mark.parametrize("agg", list(LEVELS))
@pytest.mark.parametrize("kind", ["ratio", "diff", "both"])
def test_roll_compute_train_infer_correction_agrees(agg, kind):
    roll = roll_namespace()
    d = turns(seed=10 + len(agg))
    mask = d["mask"]
    ratio = ROLL_RATIO_BANDS[agg] if kind in ("ratio", "both") else None
    diff = ROLL_DIFF_BANDS[agg] if kind in ("diff", "both") else None
    filters = [roll_filter(agg, ratio, diff)]
    if kind == "both":  # and a second rule at token level, ANDed
        filters.append(roll_filter("token", ratio=(0.5, 2.0)))
    for weight_type in LEVELS:
        upper_bound = {"token": 1.2, "geometric": 1.05, "sequence": 2.0, "segment": None}[weight_type]
        cfg = SimpleNamespace(
            is_weight=SimpleNamespace(enabled=True, weight_type=weight_type, upper_bound=upper_bound, detach=True),
            filters=filters,
        )
        their_weight, their_filter, _ = roll["compute_train_infer_correction"](
            cfg, mask.long(), d["old_log_prob"], d["rollout_log_prob"]
        )
        ours = apply(roll_correction(weight_type, upper_bound, filters), d)
        their_mask = mask & their_filter.bool()
        assert torch.equal(ours.mask, their_mask), (weight_type, agg, kind)
        assert 0 < int(their_mask.sum()) < int(mask.sum())
        want = torch.where(their_mask, their_weight, 0.0)
        torch.testing.assert_close(ours.weight, want, rtol=ROLL_TOLERANCE, atol=0)


EVERY_RULE = RolloutCorrection(
    weight_level="segment_geometric",
    upper=1.5,
    rejection=(Rejection("segment_mean_k3", 0.05),),
    gates=tuple(Gate(s, level, lower=-0.5, upper=0.5) for s in GATE_STATISTICS for level in GATE_LEVELS),
)


def test_every_gate_runs_on_meta_tensors_with_the_step_count():
    meta = torch.device("meta")
    alg = pgloss.get("grpo", kl_coef=0.0, rollout_correction=EVERY_RULE)
    shape = (4, 6)
    log_prob = torch.empty(shape, device=meta, requires_grad=True)
    inputs = dict(
        old_log_prob=torch.empty(shape, device=meta),
        advantages=torch.empty(4, device=meta),
        mask=torch.empty(shape, dtype=torch.bool, device=meta),
        rollout_log_prob=torch.empty(shape, device=meta),
    )
    step = alg.count_step(
        inputs["mask"], old_log_prob=inputs["old_log_prob"], rollout_log_prob=inputs["rollout_log_prob"]
    )
    out = alg(log_prob, **inputs, normalizer=step)
    out.loss.backward()
    assert out.loss.device == meta and log_prob.grad.shape == shape


@pytest.mark.compile
def test_every_gate_compiles_whole_forward_and_backward():
    d = turns(seed=9)
    alg = pgloss.get("grpo", kl_coef=0.0, rollout_correction=EVERY_RULE)
    inputs = {k: d[k] for k in ("old_log_prob", "advantages", "mask", "rollout_log_prob")}
    torch._dynamo.reset()
    compiled = torch.compile(lambda lp, **kw: alg(lp, **kw).loss, fullgraph=True, backend="inductor")
    x, y = d["log_prob"].clone().requires_grad_(), d["log_prob"].clone().requires_grad_()
    loss = compiled(x, **inputs)
    loss.backward()
    expected = alg(y, **inputs).loss
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-12, atol=1e-14)


def test_non_finite_values_at_masked_positions_never_reach_the_gates():
    d = turns(seed=11)
    alg = pgloss.get("grpo", kl_coef=0.0, rollout_correction=EVERY_RULE)

    def loss_and_grad(poison):
        given = {
            k: d[k] if poison is None else torch.where(d["mask"], d[k], poison)
            for k in ("log_prob", "old_log_prob", "rollout_log_prob")
        }
        lp = given.pop("log_prob").clone().requires_grad_(True)
        out = alg(lp, advantages=d["advantages"], mask=d["mask"], **given)
        out.loss.backward()
        return out.loss.detach(), lp.grad

    clean = loss_and_grad(None)
    for poison in (math.nan, math.inf, -math.inf):
        loss, grad = loss_and_grad(poison)
        torch.testing.assert_close(loss, clean[0], rtol=0, atol=0)
        torch.testing.assert_close(grad, clean[1], rtol=0, atol=0)
