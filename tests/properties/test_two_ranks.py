"""Data parallelism with two real torch.distributed processes (gloo on CPU).

Each rank computes its share of the batch with the all-reduced Normalizer; averaging the two
ranks' gradients, as DDP does, must give the gradient of the whole batch on one process.
"""

import torch
import torch.distributed as dist
from conftest import algorithm, make_batch, run_ranks
from properties.micro_batches import cut, split_call

import pgloss

CASES = [("grpo", mode) for mode in pgloss.AGG_MODES] + [("gspo", "seq-mean-token-mean"), ("fipo", "token-mean")]
# Rank 0 gets 3 rows split in two micro-batches, rank 1 gets 6 rows: uneven on purpose.
RANK_ROWS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 9)]}


def worker(rank: int, world: int) -> dict:
    data = make_batch(batch=9, length=6, seed=31, per_token_adv=True)
    out = {}
    for name, mode in CASES:
        alg = algorithm(name, loss_agg_mode=mode, norm_constant=6.0, kl_coef=0.1)
        parts = RANK_ROWS[rank]
        normalizer = pgloss.Normalizer.count(cut(data["mask"], parts), group_ids=cut(data["group_ids"], parts))
        _, grad = split_call(
            alg,
            data["log_prob"],
            parts,
            normalizer,
            old_log_prob=data["old_log_prob"],
            advantages=data["advantages"],
            mask=data["mask"],
            ref_log_prob=data["ref_log_prob"],
            group_ids=data["group_ids"],
        )
        grad = grad.clone()
        dist.all_reduce(grad)
        out[(name, mode)] = grad / dist.get_world_size()  # DDP's gradient average
    return out


def test_two_gloo_ranks_match_one_process():
    results = run_ranks(worker)
    data = make_batch(batch=9, length=6, seed=31, per_token_adv=True)
    for name, mode in CASES:
        alg = algorithm(name, loss_agg_mode=mode, norm_constant=6.0, kl_coef=0.1)
        log_prob = data["log_prob"].clone().requires_grad_(True)
        alg(
            log_prob,
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            ref_log_prob=data["ref_log_prob"],
            group_ids=data["group_ids"],
        ).loss.backward()
        for rank in (0, 1):
            torch.testing.assert_close(
                results[rank][(name, mode)], log_prob.grad, rtol=1e-12, atol=1e-14, msg=f"{name} {mode} rank {rank}"
            )
