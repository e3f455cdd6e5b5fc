"""`pgloss.StepMetrics`: a step's metrics from its calls, over micro-batches and ranks.

The property: every metric of every registered name, with each kind of rollout correction, combined from
uneven micro-batches (one of zero rows, one all-masked) on one process and on two gloo ranks
(`on_rank` / `check_ranks`, run by tests/properties/test_two_ranks_step_statistics.py), equals the metric
of one call on the whole batch. Beside it, the combination rules against a float64 loop, and the edges."""

import dataclasses
import math

import pytest
import torch
from properties.host_sync import DEVICES, HostSync, no_host_sync, no_host_sync_on, on
from properties.micro_batches import cut
from properties.steps import CORRECTIONS, WIDTH, cases, data, entropy, log_probs

import pgloss
from pgloss.algorithms import ClipCov, KLCov
from pgloss.core.batch import TokenBatch
from pgloss.core.metrics import Stat, effective_sample_size, token_extremes, token_mean

RANK_PARTS = {0: [slice(0, 2), slice(2, 4), slice(4, 6)], 1: [slice(6, 6), slice(6, 8)]}  # uneven, whole groups
ONE_PROCESS = RANK_PARTS[0] + RANK_PARTS[1]  # rows 4:6 all masked, rows 6:6 none at all
OPTIONS = dict(kl_coef=0.05, entropy_coef=0.01, positive_nll_coef=0.1)  # every metric base.py makes


def build(name, kind):
    return pgloss.get(name, generation_budget=WIDTH, rollout_correction=CORRECTIONS[kind], **OPTIONS)


def step_data():
    """steps.data() with group 2 (rows 4, 5) all masked, the entropy and CHORD's expert rows."""
    hidden, weight, targets, inputs = data()
    inputs["mask"] = inputs["mask"].clone()
    inputs["mask"][4:6] = False
    inputs["entropy"] = entropy(hidden, weight)
    inputs["expert"] = torch.tensor([False, True, False, False, True, False, True, False])
    return log_probs(hidden, weight, targets).detach(), inputs


def call(algorithm, log_prob, inputs, part=slice(None), normalizer=None):
    torch.manual_seed(0)  # Clip-Cov draws from the global generator
    take = {k: v for k, v in inputs.items() if k != "expert" or "expert" in algorithm.reads}
    return algorithm(log_prob[part], **{k: v[part] for k, v in take.items()}, normalizer=normalizer)


def selections(algorithm, log_prob, inputs, parts):
    """Clip-Cov's and KL-Cov's step selection (over ranks: a collective), one map per part; None for others."""
    if not isinstance(algorithm, (ClipCov, KLCov)):
        return [None] * len(parts)
    named = {k: v for k, v in inputs.items() if k not in ("old_log_prob", "advantages", "mask", "expert")}
    whole = TokenBatch.prepare(log_prob, inputs["old_log_prob"], inputs["advantages"], inputs["mask"], **named)
    batch, _, _ = algorithm.corrected(whole, None)  # the masks and old log-probs the calls select on
    torch.manual_seed(0)
    if isinstance(algorithm, ClipCov):
        return algorithm.step_selection(
            cut(batch.log_prob, parts),
            cut(batch.old_log_prob, parts),
            cut(batch.advantages, parts),
            cut(batch.mask, parts),
        )
    return algorithm.step_selection(cut(batch.log_prob, parts), cut(batch.advantages, parts), cut(batch.mask, parts))


def split_metrics(parts) -> dict:
    """{(name, kind): the step's metrics (floats) from the calls on `parts`, counted over the ranks}."""
    log_prob, inputs = step_data()
    out = {}
    for param in cases():
        name, kind = param.values
        algorithm = build(name, kind)
        normalizer = algorithm.step_normalizer(
            cut(inputs["mask"], parts),
            old_log_probs=cut(inputs["old_log_prob"], parts),
            rollout_log_probs=cut(inputs["rollout_log_prob"], parts),
            group_ids=cut(inputs["group_ids"], parts),
            scores=cut(inputs["scores"], parts),
            expert=cut(inputs["expert"], parts),
        )
        step = pgloss.StepMetrics()
        for part, selection in zip(parts, selections(algorithm, log_prob, inputs, parts), strict=True):
            call_algorithm = algorithm if selection is None else dataclasses.replace(algorithm, selection=selection)
            step.add(call(call_algorithm, log_prob, inputs, part, normalizer))
        out[(name, kind)] = step.as_floats()
    return out


def check_against_whole(results: dict) -> None:
    log_prob, inputs = step_data()
    seen = set()
    for param in cases():
        name, kind = param.values
        whole = call(build(name, kind), log_prob, inputs)
        got = results[(name, kind)]
        assert got.keys() == whole.metrics.keys(), (name, kind)
        for key, value in whole.metrics.items():
            # float32 values (the fractions' count / count) carry their own rounding into the step
            tol = 1e-10 if value.dtype == torch.float64 else 1e-6
            assert got[key] == pytest.approx(value.item(), rel=tol, abs=tol * 1e-3, nan_ok=True), (name, kind, key)
        seen |= set(whole.metrics)
    # the property covered every kind of metric: means, extremes, loss terms, the ESS, CHORD's and the corrections'
    assert {
        "pg_loss",
        "kl_loss",
        "positive_nll_loss",
        "entropy",
        "kl",
        "ratio_max",
        "ratio_min",
        "sft_loss",
        "rollout_is_ess",
        "rollout_is_weight_min",
        "rollout_chi2_seq",
        "rollout_rejected_frac",
        "rollout_opsm_frac",
        "clip_cov_fraction",
        "kl_cov_fraction",
    } <= seen


def test_micro_batches_give_the_whole_batch_metrics_for_every_name():
    check_against_whole(split_metrics(ONE_PROCESS))


def on_rank(rank: int) -> dict:
    """Run inside two gloo processes (tests/properties/test_two_ranks_step_statistics.py)."""
    out = {"split": split_metrics(RANK_PARTS[rank])}
    step = pgloss.StepMetrics()  # rank 1 adds nothing: its collectives still run, rank 0 gets its own calls
    if rank == 0:
        step.add(
            {"x": Stat.mean(torch.tensor(2.0), torch.tensor(3)), "top": Stat.max(torch.tensor(5.0), torch.tensor(1))}
        )
    out["one_rank_added"] = step.as_floats()
    mismatched = pgloss.StepMetrics()  # same number of names, different ones
    mismatched.add({"a" if rank == 0 else "b": Stat.mean(torch.tensor(1.0), torch.tensor(1))})
    out["mismatched_compute"] = {k: v.item() for k, v in mismatched.compute().items()}
    try:
        mismatched.as_floats()
        out["mismatched"] = None
    except ValueError as error:
        out["mismatched"] = str(error)
    loss = pgloss.StepMetrics()
    loss.add({"pg_loss": Stat.loss(torch.tensor(1.0 + rank))})
    out["loss"] = loss.as_floats()
    return out


def check_ranks(results: dict) -> None:
    for rank in (0, 1):
        check_against_whole(results[rank]["split"])
    assert results[0]["one_rank_added"] == {"top": 5.0, "x": 2.0} and results[1]["one_rank_added"] == {}
    for rank, name in ((0, "a"), (1, "b")):
        assert math.isnan(results[rank]["mismatched_compute"][name])
        assert "different metric names" in results[rank]["mismatched"]
    assert results[0]["loss"] == results[1]["loss"] == {"pg_loss": 1.5}  # (1 + 2) / 2 ranks: DDP's average


# -- the combination rules against a float64 loop ---------------------------------------------------


def test_means_extremes_and_losses_combine_as_a_loop_over_the_tokens():
    gen = torch.Generator().manual_seed(5)
    calls = []
    for rows in (3, 0, 7, 2):  # one call without rows, one all masked
        values = torch.randn(rows, 5, generator=gen, dtype=torch.float64)
        mask = torch.rand(rows, 5, generator=gen) > 0.4
        if rows == 2:
            mask[:] = False  # all masked
        calls.append((values, mask))
    step = pgloss.StepMetrics()
    for values, mask in calls:
        low, high = token_extremes(values, mask)
        step.add({"mean": token_mean(values, mask), "low": low, "high": high, "loss": Stat.loss(values.sum())})
    got = step.as_floats()
    valid = torch.cat([v[m] for v, m in calls])
    assert got["mean"] == pytest.approx(sum(valid.tolist()) / len(valid), rel=1e-14)
    assert (got["low"], got["high"]) == (min(valid.tolist()), max(valid.tolist()))
    assert got["loss"] == pytest.approx(sum(v.sum().item() for v, _ in calls), rel=1e-14)
    naive = torch.stack([token_mean(v, m).value for v, m in calls]).nanmean().item()
    assert abs(naive - got["mean"]) > 1e-3  # the mean of the calls' means is another number: the test can fail


def test_a_function_of_means_is_that_function_of_the_step_means():
    """The effective sample size E[w]²/E[w²] of the step's weights, not a mean of the calls' ESS."""
    gen = torch.Generator().manual_seed(6)
    weights = [torch.rand(n, generator=gen, dtype=torch.float64) * scale for n, scale in ((3, 1.0), (9, 4.0), (0, 1.0))]
    step = pgloss.StepMetrics()
    for w in weights:  # the empty call's ESS is NaN, with weight 0
        step.add({"ess": effective_sample_size(w, torch.ones(len(w), dtype=torch.bool))})
    every = torch.cat(weights).tolist()
    expected = (sum(every) / len(every)) ** 2 / (sum(x * x for x in every) / len(every))
    assert step.as_floats()["ess"] == pytest.approx(expected, rel=1e-14)


def test_a_step_without_tokens_gives_nan_means_and_extremes_and_zero_loss():
    algorithm = pgloss.get("dapo", kl_coef=0.1)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    zeros = torch.zeros(2, 3, dtype=torch.float64)
    step = pgloss.StepMetrics()
    for _ in range(2):
        step.add(algorithm(zeros - 1, zeros - 1, torch.ones(2, dtype=torch.float64), mask, ref_log_prob=zeros - 1))
    got = step.as_floats()
    assert got["pg_loss"] == 0.0 and got["kl_loss"] == 0.0
    assert all(math.isnan(v) for k, v in got.items() if k not in ("pg_loss", "kl_loss")), got
    assert "entropy" not in got  # absent from every call: absent
    assert pgloss.StepMetrics().as_floats() == {}


@pytest.mark.parametrize("device", DEVICES)
def test_add_and_compute_make_no_host_sync(device):
    """add and compute neither read a value (meta tensors refuse it) nor copy one to the device (the dispatch
    detector refuses it on CPU, CUDA's sync debug mode on a GPU); as_floats reads once, the caller's choice."""
    log_prob, inputs = step_data()
    log_prob, inputs = log_prob.to(device), on(device, inputs)
    algorithm = build("dapo", "token TIS")
    outs = [call(algorithm, log_prob, inputs, part) for part in ONE_PROCESS]
    with no_host_sync_on(device):
        step = pgloss.StepMetrics(device=torch.device(device))
        for out in outs:
            step.add(out)
        step.compute()
    if device != "cpu":
        return
    with pytest.raises(HostSync):
        with no_host_sync():
            step.as_floats()
    meta = torch.device("meta")
    step = pgloss.StepMetrics(device=meta)
    out = pgloss.get("dapo")(
        torch.empty(4, 3, device=meta),
        torch.empty(4, 3, device=meta),
        torch.empty(4, device=meta),
        torch.empty(4, 3, dtype=torch.bool, device=meta),
    )
    step.add(out)
    step.add(out)
    values = step.compute()
    assert values.keys() == out.metrics.keys() and all(v.device == meta for v in values.values())


def test_every_path_hands_its_metrics_with_their_reduction():
    log_prob, inputs = step_data()
    hidden, weight, targets, _ = data()
    algorithm = build("dapo", "token TIS")
    named = {k: v for k, v in inputs.items() if k in algorithm.needs - {"entropy"} or k == "rollout_log_prob"}
    for out in (
        call(algorithm, log_prob, inputs),
        algorithm.from_hidden(
            hidden, weight, targets, **{k: inputs[k] for k in ("old_log_prob", "advantages", "mask")}, **named
        ),
    ):
        assert out.stats.keys() == out.metrics.keys()
        assert all(out.stats[k].value is v for k, v in out.metrics.items())
    teacher = torch.randn(2, 3, 7, dtype=torch.float64)
    divergence = pgloss.divergence_from_logits(
        torch.randn(2, 3, 7, dtype=torch.float64), teacher, mask=torch.ones(2, 3, dtype=torch.bool), beta=0.5
    )
    assert divergence.stats["divergence"].reduce == "mean"


def test_bad_input_is_refused_by_name():
    step = pgloss.StepMetrics()
    bare = pgloss.LossOutput(loss=torch.zeros(()), metrics={"mine": torch.zeros(())}, per_token=torch.zeros(1, 1))
    with pytest.raises(TypeError, match="mine"):
        step.add(bare)
    with pytest.raises(TypeError, match="'x' must be a pgloss.core.metrics.Stat"):
        step.add({"x": torch.zeros(())})
    with pytest.raises(TypeError, match="output must be"):
        step.add([1.0])
    step.add({"x": Stat.mean(torch.zeros(()), torch.tensor(1))})
    with pytest.raises(ValueError, match="'x' changed how it combines"):
        step.add({"x": Stat.max(torch.zeros(()), torch.tensor(1))})
    with pytest.raises(ValueError, match="needs its weight"):
        step.add({"y": Stat(torch.zeros(()), "mean")})
    with pytest.raises(ValueError, match="reduce='median'"):
        step.add({"z": Stat(torch.zeros(()), "median", torch.tensor(1))})
    small = pgloss.StepMetrics(capacity=3)
    small.add({f"m{i}": Stat.mean(torch.zeros(()), torch.tensor(1)) for i in range(2)})
    with pytest.raises(ValueError, match="capacity=3"):
        small.compute()
    with pytest.raises(TypeError, match="dtype"):
        pgloss.StepMetrics(dtype=torch.float16)
