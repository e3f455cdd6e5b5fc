"""GAE, group-relative advantages and DAPO's sampling rules against plain loops."""

import loops
import pytest
import torch

from pgloss.advantages import dynamic_sampling_keep, gae, group_advantages, overlong_penalty


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_gae_matches_loop(gamma, lam):
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    values = torch.randn(4, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(4, 7, generator=gen) > 0.25  # holes in the middle: tool output
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    expected = torch.tensor(
        loops.gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma=gamma, lam=lam), dtype=torch.float64
    )
    torch.testing.assert_close(adv, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, (expected + values) * mask)


def test_gae_with_lambda_one_is_discounted_return_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.2, 0.5, 0.7]], dtype=torch.float64)
    adv, _ = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.81 - 0.2, 0.9 - 0.5, 1.0 - 0.7]], dtype=torch.float64))


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_loop(scale):
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.2, 0.9, 3.0], dtype=torch.float64)
    groups = torch.tensor([7, 7, 7, 7, 2, 2, 2, 5])  # the last group has one member
    expected = loops.group_advantages(scores.tolist(), groups.tolist(), scale=scale, eps=1e-6)
    torch.testing.assert_close(
        group_advantages(scores, groups, scale=scale), torch.tensor(expected, dtype=torch.float64)
    )


def test_dynamic_sampling_keeps_groups_with_mixed_rewards():
    scores = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert dynamic_sampling_keep(scores, groups).tolist() == [False, False, False, False, True, True, False, False]


def test_overlong_penalty_is_dapo_eq_13():
    lengths = torch.tensor([10, 12, 14, 16, 20])
    out = overlong_penalty(lengths, max_length=16, cache_length=4)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(lengths, max_length=4, cache_length=8)


def test_bad_group_ids_are_refused():
    with pytest.raises(ValueError, match="group_ids must be integers"):
        group_advantages(torch.ones(3), torch.ones(3))
