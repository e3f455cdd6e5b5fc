"""`pgloss.diagnostics.inspect` under a sequence group (2 gloo ranks, each holding a slice of every sequence):
its closed form reads the batch the call reads, with whole-sequence statistics, so -Â·f·w equals the call's
per-token gradient on each rank. The cases, in one pair of processes: GRPO with sequence-level rejections of the
rollout correction (the mean k3 and the max k2 of a sequence decide on the whole sequence, not on this rank's
slice), and the sequence ratios of GSPO, GSPO-token and sample-level GRPO (s_i, and |y_i|, over the whole
sequence), and GSPO with token-level correction weights (their mean over the whole sequence)."""

import torch
from conftest import run_ranks

import pgloss
from pgloss import RolloutCorrection, SequenceParallel
from pgloss.correction.rollout import Rejection
from pgloss.diagnostics.inspect import inspect

RULES = (Rejection("seq_mean_k3", upper=0.03), Rejection("seq_max_k2", upper=0.3))


def one_rank(rank, world):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows, width = 8, 8
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.1
    noisy = lambda scale: (old + scale * torch.randn(rows, width, generator=g, dtype=torch.float64)).clamp(max=-1e-3)  # noqa: E731
    log_prob, rollout = noisy(0.1), noisy(0.2)
    rollout[0, 6] -= 2.0  # far off-policy on rank 1's half of row 0: its k2 rejects the whole row, on both ranks
    mask = torch.arange(width)[None, :] < torch.tensor([8, 5, 3, 7, 8, 6, 2, 8])[:, None]
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    split = SequenceParallel()
    lp, old_lp, rollout_lp, m = (split.shard(v, dim=1) for v in (log_prob, old, rollout, mask))
    results = {}
    for name in CASES:
        correction = CORRECTIONS.get(name)
        algorithm = pgloss.get(name.split("+")[0], kl_coef=0.0, rollout_correction=correction)
        rollout_inputs = {"rollout_log_prob": rollout_lp} if correction else {}
        normalizer = algorithm.step_normalizer(
            m,
            old_log_probs=old_lp,
            rollout_log_probs=rollout_lp if correction else None,
            sequence_parallel=split,
        )
        result = inspect(algorithm, lp, old_lp, advantages, m, normalizer=normalizer, **rollout_inputs)
        results[name] = result.policy_grad, result.closed_form, m
    return results


CORRECTIONS = {
    "grpo": RolloutCorrection(weight_level=None, rejection=RULES),
    "gspo+token weights": RolloutCorrection(weight_level="token"),  # GSPO's ℓ_i weighs by their sequence mean
}
CASES = ("grpo", "gspo", "gspo_token", "sample_grpo", "gspo+token weights")


def test_the_closed_form_is_the_gradient_of_the_call_on_each_rank_of_a_sequence_group():
    for rank, results in run_ranks(one_rank, world=2).items():
        assert set(results) == set(CASES)
        for name, (policy_grad, closed_form, mask) in results.items():
            assert closed_form is not None and policy_grad[1:].abs().sum() > 0, name
            if name == "grpo":  # row 0 is rejected on the rank that holds its good half
                assert not policy_grad[0].any() and mask[0].any()
            torch.testing.assert_close(closed_form, policy_grad, rtol=1e-10, atol=1e-12, msg=f"{name}, rank {rank}")
