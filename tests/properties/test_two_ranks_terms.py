"""The step-level terms over two real gloo ranks: ΔL Normalization at α ≠ 1 (its length counts), VAPO's
positive-example NLL (the step's rewarded-token count), CHORD (the step's counts of its expert and
on-policy rows apart, the expert rows on both ranks), the teachers' terms (verl's distillation, SDPO's, SDAR's,
each aggregated in its own mode); each rank computes its share with the
all-reduced step counts, and DDP's gradient average equals one process's gradient. The adaptive
entropy controller, stepped on each rank from its own micro-batches, moves as on one process."""

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch, run_ranks
from properties.micro_batches import cut, split_call

import pgloss
from pgloss.controllers import AdaptiveEntropy

RANK_ROWS = {0: [slice(0, 1), slice(1, 3)], 1: [slice(3, 9)]}


def cases():
    return {
        "delta_l_0.75": (
            pgloss.get("dapo", loss_agg_mode="delta-l-norm", norm_constant=6.0, delta_l_alpha=0.75, kl_coef=0.1),
            {},
        ),
        "positive_nll": (pgloss.get("grpo", positive_nll_coef=0.5), {}),
        "chord": (pgloss.get("chord", chord_mu=0.3, kl_coef=0.1), {"expert": EXPERT}),
        "chord_seq": (
            pgloss.get("chord", chord_mu=0.6, loss_agg_mode="seq-mean-token-mean", sft_weight="none"),
            {"expert": EXPERT},
        ),
        "teachers": (
            pgloss.get("grpo", policy_coef=0.5, distill_coef=0.3, self_distill_coef=0.2, sdar_coef=0.1),
            {"teacher_log_prob": data()["teacher_log_prob"]},
        ),
    }


EXPERT = torch.tensor([True, False, False, True, False, False, True, True, False])


def data():
    batch = make_batch(batch=9, length=6, seed=33, per_token_adv=True)
    batch["scores"] = torch.tensor([1.0, 0.0, 2.0, 1.0, 0.0, -1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    return batch


def step(alg, batch, parts, extra):
    normalizer = alg.step_normalizer(
        cut(batch["mask"], parts), scores=cut(batch["scores"], parts), **{k: cut(v, parts) for k, v in extra.items()}
    )
    return split_call(
        alg,
        batch["log_prob"],
        parts,
        normalizer,
        old_log_prob=batch["old_log_prob"],
        advantages=batch["advantages"],
        mask=batch["mask"],
        ref_log_prob=batch["ref_log_prob"],
        scores=batch["scores"],
        **extra,
    )[1]


def controller_run(parts_per_step):
    """Three steps; the entropy scaled so the step's mean crosses the target: (coef, last entropy) per step."""
    batch = data()
    controller = AdaptiveEntropy(0.01, target=0.5, delta=0.004)
    out = []
    for scale in (0.6, 1.4, 0.9):
        for p in parts_per_step:
            controller.observe(batch["entropy"][p] * scale, batch["mask"][p])
        controller.step()
        out.append((controller.coef, controller.last_entropy))
    return out


def worker(rank: int, world: int) -> dict:
    out = {}
    for key, (alg, extra) in cases().items():
        grad = step(alg, data(), RANK_ROWS[rank], extra).clone()
        dist.all_reduce(grad)
        out[key] = grad / dist.get_world_size()
    out["adaptive_entropy"] = controller_run(RANK_ROWS[rank])
    return out


def test_two_gloo_ranks_match_one_process():
    results = run_ranks(worker)
    for key, (alg, extra) in cases().items():
        whole = step(alg, data(), [slice(0, 9)], extra)
        for rank in (0, 1):
            torch.testing.assert_close(results[rank][key], whole, rtol=1e-12, atol=1e-14, msg=f"{key} rank {rank}")
    one = controller_run([slice(0, 9)])
    assert [c for c, _ in one] == pytest.approx([0.014, 0.010, 0.014])  # the coefficient moved both ways
    for rank in (0, 1):
        for (c, h), (c1, h1) in zip(results[rank]["adaptive_entropy"], one, strict=True):
            assert c == pytest.approx(c1, abs=1e-15) and h == pytest.approx(h1, rel=1e-14)
