"""One count of the step: `Algorithm.count_step` takes the micro-batches by the call's own argument names and
reduces everything the objective declared (tokens, sequences, lengths, tokens per group, each counted subset of
rows, a rollout correction's weight sums) in one MAX and one SUM all-reduce over two real gloo ranks; the counts
equal one process's count of the whole step. A row-coupled call that holds part of a group warns."""

import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch, run_ranks
from properties.micro_batches import cut, split_call

import pgloss
from pgloss import Rejection, RolloutCorrection

RANK_ROWS = {0: [slice(0, 2), slice(2, 4)], 1: [slice(4, 9)]}
EXPERT = torch.tensor([True, False, False, True, False, False, True, True, False])
CORRECTION = RolloutCorrection(upper=1.5, batch_normalize=True, rejection=(Rejection("token_k2", 0.05),))


def configurations():
    """Every kind of declared count at once: per-group counts, the rewarded rows, the expert and on-policy rows,
    the kept masks and the weight sums of a correction."""
    return {
        "chord": pgloss.get(
            "chord",
            loss_agg_mode="group-mean-token-mean",
            positive_nll_coef=0.5,
            rollout_correction=CORRECTION,
        ),
        "dapo": pgloss.get("dapo", positive_nll_coef=0.3, rollout_correction=CORRECTION),
    }


def data():
    batch = make_batch(batch=9, length=6, seed=5, per_token_adv=True)
    noise = torch.randn(9, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    batch["rollout_log_prob"] = (batch["old_log_prob"] + 0.1 * noise).clamp(max=0.0)
    batch["scores"] = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, -1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    batch["expert"] = EXPERT
    return batch


def count(algorithm, batch, parts):
    return algorithm.count_step(
        cut(batch["mask"], parts),
        **{name: cut(batch[name], parts) for name in ("old_log_prob", "rollout_log_prob", "group_ids", "scores")},
        expert=cut(batch["expert"], parts),
    )


def summary(normalizer):
    """Every count a Normalizer carries, as plain numbers."""
    out = {
        "tokens": float(normalizer.tokens),
        "sequences": float(normalizer.sequences),
        "lengths": normalizer.length_counts.tolist(),
    }
    if normalizer.group_tokens is not None:
        out["groups"] = normalizer.group_tokens.tolist()
    out |= {f"part {name}": summary(part) for name, part in normalizer.parts.items()}
    return out | {f"sum {name}": value.tolist() for name, value in normalizer.sums.items()}


def worker(rank: int, world: int) -> dict:
    calls = []
    real = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, **kwargs):
        calls.append("MAX" if op == dist.ReduceOp.MAX else "SUM")
        return real(tensor, op=op, **kwargs)

    out = {}
    dist.all_reduce = counted
    try:
        for key, algorithm in configurations().items():
            calls.clear()
            normalizer = count(algorithm, data(), RANK_ROWS[rank])
            out[key] = (list(calls), summary(normalizer), normalizer.world_size)
    finally:
        dist.all_reduce = real
    return out


def test_one_max_and_one_sum_per_step_over_two_ranks():
    results = run_ranks(worker)
    for key, algorithm in configurations().items():
        whole = summary(count(algorithm, data(), [slice(0, 9)]))
        assert {"part expert", "part on_policy", "part rewarded"} <= set(whole) or key == "dapo"
        for rank in (0, 1):
            calls, counts, world = results[rank][key]
            assert sorted(calls) == ["MAX", "SUM"], f"{key} rank {rank}: {calls}"
            assert world == 2
            sums = {name: counts.pop(name) for name in list(counts) if name.startswith("sum ")}
            assert counts == {name: value for name, value in whole.items() if not name.startswith("sum ")}
            assert sums.keys() == {name for name in whole if name.startswith("sum ")} != set()
            for name, value in sums.items():  # float sums: the same up to the order of the addition
                assert value == pytest.approx(whole[name], rel=1e-14)


def test_the_count_takes_the_call_s_own_names():
    batch = data()
    algorithm = configurations()["dapo"]
    parts = [slice(0, 4), slice(4, 9)]
    by_name = algorithm.count_step(
        cut(batch["mask"], parts),
        **{name: cut(value, parts) for name, value in batch.items() if name != "mask"},
    )
    aliased = algorithm.step_normalizer(
        cut(batch["mask"], parts),
        old_log_probs=cut(batch["old_log_prob"], parts),
        rollout_log_probs=cut(batch["rollout_log_prob"], parts),
        scores=cut(batch["scores"], parts),
    )
    assert summary(by_name) == summary(aliased)
    with pytest.raises(TypeError, match="unexpected argument 'old_log_probs'; did you mean 'old_log_prob'"):
        algorithm.count_step(batch["mask"], old_log_probs=batch["old_log_prob"])


@pytest.mark.parametrize("name", ["real", "gvpo"])
def test_a_call_with_part_of_a_group_warns_and_whole_groups_do_not(name):
    batch = make_batch(batch=6, length=5, seed=2)
    batch["group_ids"] = torch.tensor([0, 0, 1, 1, 2, 2])
    batch["scores"] = torch.tensor([1.0, 0.0, 1.0, 0.5, 0.0, 1.0], dtype=torch.float64)
    algorithm = pgloss.get(name)
    inputs = {k: batch[k] for k in ("old_log_prob", "advantages", "mask", "group_ids", "scores")}
    inputs = {k: v for k, v in inputs.items() if k in {"old_log_prob", "advantages", "mask"} | algorithm.needs}
    for parts, partial in (([slice(0, 2), slice(2, 6)], False), ([slice(0, 1), slice(1, 3), slice(3, 6)], True)):
        normalizer = algorithm.count_step(cut(batch["mask"], parts), group_ids=cut(batch["group_ids"], parts))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            split_call(algorithm, batch["log_prob"], parts, normalizer, **inputs)
        kinds = [w.category for w in caught]
        assert (pgloss.PartialGroupWarning in kinds) == partial, (parts, [str(w.message) for w in caught])
    with warnings.catch_warnings():
        warnings.simplefilter("error", pgloss.PartialGroupWarning)  # strict: the user's choice makes it an error
        with pytest.raises(pgloss.PartialGroupWarning, match="Put whole groups in each micro-batch"):
            split_call(algorithm, batch["log_prob"], parts, normalizer, **inputs)


def test_the_old_spelling_of_a_declared_count_is_refused_with_the_new_one():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match=r"algorithm.count_step\(mask, scores=..., expert=...\)"):
        pgloss.Normalizer.count(mask, scores=torch.ones(2), expert=torch.zeros(2, dtype=torch.bool))
