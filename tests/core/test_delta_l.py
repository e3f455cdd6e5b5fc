"""ΔL Normalization (`loss_agg_mode="delta-l-norm"`, He et al. 2025, arXiv 2509.07558) against its
float64 loop (tests/loops/aggregate.py), its defining properties, and the authors' own code.

Parity: PGLOSS_DELTA_L_SRC, the root of a checkout of the authors' repository (zerolllin/Delta-L-Normalization,
a verl fork, commit 89da5b9), holding verl/trainer/ppo/core_algos.py and verl/utils/torch_functional.py.
Their `compute_grpo_outcome_advantage(use_grpopp=True)` multiplies each GRPO advantage by
(L_i/L̄)^-α / mean_j (L_j/L̄)^-α over the batch, and `compute_policy_loss(use_grpopp=True)` takes
`masked_mean_allavg`, the mean over the B×T padded tensor, T the response budget M. The functions are
cut from the files by path (their package imports the rest of verl). Measured (dual_clip_ppo, α ∈ {0, 0.5,
0.75, 1}, 3 seeds, B = 12 in groups of 4, T = 10, 0/1 rewards): float64 |Δ loss| ≤ 5.6e-17 (relative
2.2e-14), |Δ ∂/∂log π| ≤ 5.2e-18; asserted relative 1e-12. Their weights are the same as pgloss's only
when the batch is the optimizer step (one mini-batch) and no response is empty (an empty response's
0^-α is infinite there; pgloss gives it weight 0).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import loops
import numpy as np
import pytest
import torch
from conftest import make_batch
from properties.micro_batches import cut, split_call

import pgloss
from pgloss.core.aggregate import aggregate, row_weights

F64 = dict(dtype=torch.float64)
ALPHAS = [0.0, 0.5, 0.75, 1.0]


def batch(seed, rows=8, width=9):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, width, generator=gen, **F64)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    lengths[2] = 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return values, mask


@pytest.mark.parametrize("alpha", ALPHAS + [2.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop(alpha, seed):
    values, mask = batch(seed)
    out = aggregate(values, mask, "delta-l-norm", norm_constant=9.0, delta_l_alpha=alpha)
    expected = loops.aggregate(values.tolist(), mask.tolist(), "delta-l-norm", norm_constant=9.0, delta_l_alpha=alpha)
    assert out.item() == pytest.approx(expected, rel=1e-13)


def test_alpha_zero_is_dr_grpo():
    values, mask = batch(3)
    torch.testing.assert_close(
        aggregate(values, mask, "delta-l-norm", norm_constant=9.0, delta_l_alpha=0.0),
        aggregate(values, mask, "seq-mean-token-sum-norm", norm_constant=9.0),
        rtol=1e-15,
        atol=0,
    )


@pytest.mark.parametrize("alpha", ALPHAS)
def test_weights_are_unbiased(alpha):
    """Σ_i x_i = 1/C over the non-empty rows (the estimate of Dr.GRPO's scale), 0 on the empty row."""
    _, mask = batch(4)
    x = row_weights(mask, "delta-l-norm", pgloss.Normalizer.count(mask), norm_constant=9.0, delta_l_alpha=alpha)
    assert x.sum().item() == pytest.approx(1 / 9.0, rel=1e-14)
    assert x[2].item() == 0.0


def test_alpha_one_is_the_minimum_variance_unbiased_combination():
    """Var(Σ x_i g_i) = V Σ x_i² L_i (Var g_i ∝ L_i, independent): among weights with Σ x_i = 1/C, α = 1's
    x_i ∝ 1/L_i is the smallest; any perturbation within the constraint, and every other α, is larger."""
    _, mask = batch(5)
    lengths = mask.sum(-1).double()
    rows = lengths > 0
    n = pgloss.Normalizer.count(mask)

    def variance(x):
        return (x[rows] ** 2 * lengths[rows]).sum().item()

    best = row_weights(mask, "delta-l-norm", n, norm_constant=9.0, delta_l_alpha=1.0)
    assert variance(best) == pytest.approx(1 / (81 * (1 / lengths[rows]).sum().item()), rel=1e-13)  # 1/(C²·Σ 1/L)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        step = torch.randn(mask.shape[0], generator=gen, **F64) * rows
        step -= rows * step.sum() / rows.sum()  # keeps Σ x = 1/C
        assert variance(best + 1e-3 * step) > variance(best)
    for alpha in (0.0, 0.5, 0.75, 1.5):
        other = row_weights(mask, "delta-l-norm", n, norm_constant=9.0, delta_l_alpha=alpha)
        assert variance(other) > variance(best)


@pytest.mark.parametrize("alpha", [0.0, 0.75, 1.0])
def test_micro_batches_and_alpha(alpha):
    """Any α: the step's length counts make micro-batches add up to the one call (value and gradient)."""
    data = make_batch(batch=9, length=6, seed=41, per_token_adv=True)
    alg = pgloss.get("dapo", loss_agg_mode="delta-l-norm", norm_constant=6.0, delta_l_alpha=alpha, kl_coef=0.1)

    def run(parts):
        return split_call(
            alg,
            data["log_prob"],
            parts,
            alg.step_normalizer(cut(data["mask"], parts)),
            old_log_prob=data["old_log_prob"],
            advantages=data["advantages"],
            mask=data["mask"],
            ref_log_prob=data["ref_log_prob"],
        )

    whole = run([slice(0, 9)])
    for parts in ([slice(0, 2), slice(2, 9)], [slice(0, 1), slice(1, 5), slice(5, 9)]):
        split = run(parts)
        torch.testing.assert_close(split[0], whole[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(split[1], whole[1], rtol=1e-12, atol=1e-14)


def test_gradcheck():
    data = make_batch(batch=6, length=5, seed=7, per_token_adv=True)
    alg = pgloss.get("grpo", loss_agg_mode="delta-l-norm", norm_constant=5.0, delta_l_alpha=0.75, entropy_coef=0.01)

    def loss(log_prob, entropy):
        return alg(
            log_prob,
            data["old_log_prob"],
            data["advantages"],
            data["mask"],
            ref_log_prob=data["ref_log_prob"],
            entropy=entropy,
        ).loss

    assert torch.autograd.gradcheck(
        loss, (data["log_prob"].clone().requires_grad_(True), data["entropy"].clone().requires_grad_(True))
    )


def test_budget_and_alpha_are_checked():
    with pytest.raises(ValueError, match="'delta-l-norm' requires norm_constant > 0"):
        pgloss.get("grpo", loss_agg_mode="delta-l-norm")
    assert pgloss.get("grpo", loss_agg_mode="delta-l-norm", generation_budget=64).norm_constant == 64.0
    with pytest.raises(ValueError, match="delta_l_alpha must be >= 0"):
        pgloss.get("grpo", loss_agg_mode="delta-l-norm", norm_constant=4.0, delta_l_alpha=-1.0)
    with pytest.raises(TypeError, match="delta_l_alpha must be a real number"):
        pgloss.get("grpo", loss_agg_mode="delta-l-norm", norm_constant=4.0, delta_l_alpha="1")


def test_normalizer_without_lengths_or_counted_on_shorter_masks_is_refused():
    values, mask = batch(6)
    bare = pgloss.Normalizer(tokens=torch.tensor(100.0, **F64), sequences=torch.tensor(10.0, **F64))
    with pytest.raises(ValueError, match="needs a Normalizer that counted the step's lengths"):
        aggregate(values, mask, "delta-l-norm", normalizer=bare, norm_constant=9.0)
    short = pgloss.Normalizer(
        tokens=torch.tensor(1000.0, **F64),
        sequences=torch.tensor(100.0, **F64),
        length_counts=torch.full((5,), 20.0, **F64),
    )
    with pytest.raises(ValueError, match="counted lengths up to 4"):
        aggregate(values, mask, "delta-l-norm", normalizer=short, norm_constant=9.0)
    other = pgloss.Normalizer.count(torch.ones(8, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="sequences of .* tokens but this call holds more"):
        aggregate(values, mask, "delta-l-norm", normalizer=other, norm_constant=9.0)


def test_length_counts():
    masks = [torch.tensor([[1, 1, 0], [0, 0, 0]]), torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]])]
    assert pgloss.Normalizer.count(masks).length_counts.tolist() == [0, 1, 2, 1]


# -- the authors' code ------------------------------------------------------------------------------------------


def _authors():
    from advantages.trainer_sources import load, source_file

    core = source_file("PGLOSS_DELTA_L_SRC", "verl/trainer/ppo/core_algos.py")
    functional = load(
        source_file("PGLOSS_DELTA_L_SRC", "verl/utils/torch_functional.py"),
        ("masked_mean", "masked_mean_allavg"),
        {"torch": torch},
    )
    verl_f = SimpleNamespace(masked_mean=functional["masked_mean"], masked_mean_allavg=functional["masked_mean_allavg"])
    return load(
        core,
        ("agg_loss", "compute_grpo_outcome_advantage", "compute_policy_loss"),
        {"torch": torch, "np": np, "defaultdict": defaultdict, "verl_F": verl_f},
    )


def authors_case(seed, rows=12, width=10):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (rows,), generator=gen)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    old = -torch.rand(rows, width, generator=gen, **F64) * 2 - 0.1
    log_prob = -(old + 0.3 * torch.randn(rows, width, generator=gen, **F64)).abs()
    rewards = torch.zeros(rows, width, **F64)
    rewards[torch.arange(rows), lengths - 1] = torch.randint(0, 2, (rows,), generator=gen).double()
    ids = np.array([i // 4 for i in range(rows)])
    return log_prob, old, rewards, mask, ids


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_authors_code(alpha, seed):
    ns = _authors()
    log_prob, old, rewards, mask, ids = authors_case(seed)
    config = dict(alpha=alpha)
    adv_dl, _ = ns["compute_grpo_outcome_advantage"](rewards, mask, ids, use_grpopp=True, grpopp_config=config)
    adv, _ = ns["compute_grpo_outcome_advantage"](rewards, mask, ids)
    theirs_lp = log_prob.clone().requires_grad_(True)
    theirs = ns["compute_policy_loss"](
        old, theirs_lp, adv_dl, mask, cliprange=0.2, use_grpopp=True, grpopp_config=config
    )[0]
    theirs.backward()
    ours_lp = log_prob.clone().requires_grad_(True)
    alg = pgloss.get("dual_clip_ppo", loss_agg_mode="delta-l-norm", norm_constant=mask.shape[1], delta_l_alpha=alpha)
    ours = alg(ours_lp, old, adv[:, 0], mask.bool()).loss
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(ours_lp.grad, theirs_lp.grad, rtol=1e-12, atol=1e-16)
