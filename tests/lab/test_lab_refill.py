"""DAPO's dynamic sampling refills the batch: the first kept groups of bounded extra rounds, alike on every rank."""

import dataclasses
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lab_helpers import TINY, fixed_batch, same_run, tiny_policy

from pgloss.lab.batch import Batch, refill
from pgloss.lab.config import LabConfig
from pgloss.lab.trainer import train


def with_scores(batch: Batch, equal_groups: set[int], offset: int) -> Batch:
    """`batch` with group ids shifted by `offset` and the rewards of `equal_groups` (local ids) all 1."""
    r = batch.rollout
    ids = r.group_ids + offset
    scores = torch.where(
        torch.isin(r.group_ids, torch.tensor(sorted(equal_groups), dtype=torch.long)), 1.0, batch.scores
    )
    rollout = type(r)(r.tokens, r.valid, r.prompt_len, r.mask, r.finished, ids)
    return Batch(rollout, batch.old_log_prob, batch.ref_log_prob, batch.advantages, scores, batch.rollout_log_prob)


@pytest.fixture(scope="module")
def base():
    return fixed_batch(tiny_policy(), n_prompts=4, group=4)


def rounds(base, equal: list[set[int]], rank: int = 0, world: int = 1):
    """A first round and a `draw` whose round k drops the groups `equal[k]`; records the calls.
    This rank holds the groups rank, rank + world, ... of each round."""
    calls = []

    def mine(k):
        batch = with_scores(base, equal[k], 4 * k)
        return batch.select(((batch.rollout.group_ids - 4 * k) % world == rank).nonzero().squeeze(1))

    def draw(k):
        calls.append(k)
        return mine(k)

    return mine(0), draw, calls


def test_refill_fills_the_batch_with_the_first_kept_groups_renumbered(base):
    first, draw, calls = rounds(base, [{0, 1, 2}, {0, 2}, set()])
    batch, stats = refill(first, draw, 4, max_rounds=3)
    assert calls == [1, 2]  # kept 1, then 3, then 7 >= 4 groups: two extra rounds
    assert {k: float(v) for k, v in stats.items()} == pytest.approx({"sampled_groups": 12, "groups": 4, "kept": 4 / 12})
    # kept global ids: 3 (round 0), 5, 7 (round 1), 8 (round 2) -> renumbered 0..3, whole groups of 4 rows
    assert batch.rollout.group_ids.tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    src = torch.cat([base.scores[12:16], base.scores[4:8], base.scores[12:16], base.scores[0:4]])
    assert torch.equal(batch.scores, src)
    assert torch.equal(batch.advantages, torch.cat([base.advantages[i : i + 4] for i in (12, 4, 12, 0)]))
    # rows keep their tokens through the re-padding
    kept_mask = batch.rollout.mask[4:8]
    assert torch.equal(batch.rollout.responses[4:8][kept_mask], base.rollout.responses[4:8][base.rollout.mask[4:8]])


def test_refill_respects_the_bound_and_stops_when_full(base):
    first, draw, calls = rounds(base, [{0, 1, 2, 3}] * 5)
    batch, stats = refill(first, draw, 4, max_rounds=2)
    assert calls == [1, 2] and float(stats["groups"]) == 0 and float(stats["sampled_groups"]) == 12
    assert batch.advantages.numel() == 0
    first, draw, calls = rounds(base, [set(), {0}])
    batch, stats = refill(first, draw, 4, max_rounds=2)
    assert calls == [] and float(stats["kept"]) == 1.0 and batch.rollout.group_ids.unique().tolist() == [0, 1, 2, 3]
    first, draw, calls = rounds(base, [{0}, set()])
    _, stats = refill(first, draw, 4, max_rounds=0)
    assert calls == [] and float(stats["groups"]) == 3 and float(stats["kept"]) == 0.75


def _worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        # rank 1 holds groups 1 and 3 of each round; its groups are never dropped, rank 0's are until round 2
        first, draw, calls = rounds(
            fixed_batch(tiny_policy(), n_prompts=4, group=4), [{0, 2}, {0, 2}, set()], rank, world
        )
        batch, stats = refill(first, draw, 4, max_rounds=3)
        torch.save(
            {"calls": calls, "stats": stats, "ids": batch.rollout.group_ids, "scores": batch.scores}, f"{out}.{rank}"
        )
    finally:
        dist.destroy_process_group()


def test_every_rank_makes_the_same_rounds_and_ids_stay_global(tmp_path, base):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "refill")
    mp.spawn(_worker, args=(2, port, out), nprocs=2, join=True)
    r0, r1 = torch.load(f"{out}.0"), torch.load(f"{out}.1")
    # globally kept: round 0 -> 1, 3; round 1 -> 5, 7: four groups after one extra round, on both ranks
    assert r0["calls"] == r1["calls"] == [1]
    assert (
        r0["stats"] == r1["stats"] and float(r0["stats"]["groups"]) == 4 and float(r0["stats"]["sampled_groups"]) == 8
    )
    assert r0["ids"].numel() == 0 and r1["ids"].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
    first, draw, _ = rounds(base, [{0, 2}, {0, 2}, set()])
    one, _ = refill(first, draw, 4, max_rounds=3)
    assert torch.equal(one.rollout.group_ids, r1["ids"]) and torch.equal(one.scores, r1["scores"])


def test_a_dapo_run_is_deterministic_and_respects_the_bound():
    cfg = LabConfig(
        algorithm="dapo",
        max_refill_rounds=2,
        steps=2,
        warm_steps=3,
        prompts_per_step=4,
        group_size=4,
        eval_prompts=4,
        samples=2,
        **TINY,
    )
    a, b = train(cfg), train(cfg)
    assert same_run(a, b)
    for r in a["metrics"]:  # the barely warm policy never answers right: every round drops every group
        assert r["sampled_groups"] == 12 and r["groups"] == 0 and r["kept"] == 0
    grpo = train(dataclasses.replace(cfg, algorithm="grpo"))["metrics"]
    assert all(r["sampled_groups"] == r["groups"] == 4 and r["kept"] == 1 for r in grpo)


def test_cat_keeps_optional_log_probs_and_refuses_parts_that_differ(base):
    sampler = base.old_log_prob - 0.5  # a stand-in for a mismatched sampler's log-probs
    with_sampler = dataclasses.replace(base, rollout_log_prob=sampler)
    both = Batch.cat([with_sampler, with_sampler])
    assert both.rollout_log_prob is not None and torch.equal(both.rollout_log_prob, torch.cat([sampler, sampler]))
    assert Batch.cat([base, base]).rollout_log_prob is None and Batch.cat([base, base]).teacher_log_prob is None
    for parts in ([with_sampler, base], [base, with_sampler]):  # the second was silently dropped
        with pytest.raises(ValueError, match="rollout_log_prob is None in some parts only"):
            Batch.cat(parts)
