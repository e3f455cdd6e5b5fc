"""The estimators against verl 0.9.1's own advantage functions (verl/trainer/ppo/core_algos.py),
run on the same scores: the outcome reward sits on each response's last valid token."""

import numpy as np
import pytest
import torch

from pgloss import advantages as est
from pgloss.vocab.entropy import sum_pi_squared

pytest.importorskip("verl")
from verl.trainer.ppo import core_algos


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.tensor([3, 3, 3, 3, 1, 1, 1, 4, 4, 4, 4, 4])
    lengths = torch.randint(1, 7, (12,), generator=gen)
    mask = (torch.arange(6)[None, :] < lengths[:, None]).float()
    scores = torch.randn(12, generator=gen, dtype=torch.float64)
    scores[::5] = 0.0
    token_rewards = torch.zeros(12, 6, dtype=torch.float64)
    token_rewards[torch.arange(12), lengths - 1] = scores
    return scores, ids, lengths, mask, token_rewards


def seq(adv):  # verl broadcasts onto the mask; read one value per row
    return adv.sum(-1) / (adv != 0).sum(-1).clamp(min=1)


class Config(dict):
    def __getattr__(self, name):
        return self[name]


def test_grpo_rloo_opo_gpg_match_verl():
    scores, ids, lengths, mask, rewards = inputs()
    index = np.array(ids.tolist())
    torch.testing.assert_close(
        core_algos.compute_grpo_outcome_advantage(rewards, mask, index)[0],
        est.grpo_advantages(scores, ids, convention="verl")[:, None] * mask,
    )
    torch.testing.assert_close(
        core_algos.compute_rloo_outcome_advantage(rewards, mask, index)[0],
        est.rloo_advantages(scores, ids)[:, None] * mask,
    )
    torch.testing.assert_close(
        core_algos.compute_opo_outcome_advantage(rewards, mask, index)[0],
        est.opo_advantages(scores, ids, lengths)[:, None] * mask,
    )
    torch.testing.assert_close(
        core_algos.compute_gpg_outcome_advantage(rewards, mask, index)[0],
        est.gpg_advantages(scores, ids)[:, None] * mask,
    )


@pytest.mark.parametrize("scale", [True, False])
def test_passk_matches_verl(scale):
    scores, ids, _, mask, rewards = inputs(1)
    verl, _ = core_algos.compute_grpo_passk_outcome_advantage(
        rewards, mask, np.array(ids.tolist()), config=Config(norm_adv_by_std_in_grpo=scale)
    )
    torch.testing.assert_close(verl, est.passk_advantages(scores, ids, scale=scale)[:, None] * mask)


def test_reinforce_pp_and_baseline_and_remax_match_verl():
    scores, ids, _, mask, rewards = inputs(2)
    gen = torch.Generator().manual_seed(3)
    dense = torch.randn(rewards.shape, generator=gen, dtype=torch.float64) * mask
    adv, ret = core_algos.compute_reinforce_plus_plus_outcome_advantage(dense, mask, config=Config(gamma=0.9))
    ours, our_ret = est.reinforce_pp_advantages(dense, mask.bool(), gamma=0.9)
    torch.testing.assert_close(ret, our_ret)
    torch.testing.assert_close(adv, ours)
    adv, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(rewards, mask, np.array(ids.tolist()))
    torch.testing.assert_close(adv, est.reinforce_pp_baseline_advantages(scores, ids, mask.bool()))
    baseline = torch.randn(12, generator=gen, dtype=torch.float64)
    adv, ret = core_algos.compute_remax_outcome_advantage(dense, baseline, mask)
    ours, our_ret = est.remax_advantages(dense, mask.bool(), baseline)
    torch.testing.assert_close(ret, our_ret)
    torch.testing.assert_close(adv, ours)


@pytest.mark.parametrize("with_weights", [False, True])
def test_optimal_token_baseline_matches_verl(with_weights):
    scores, ids, lengths, mask, _ = inputs(4)
    gen = torch.Generator().manual_seed(5)
    rewards = torch.randn(mask.shape, generator=gen, dtype=torch.float64) * mask
    logits = torch.randn(12, 6, 9, generator=gen, dtype=torch.float64)
    old = torch.log_softmax(logits, -1)[..., 3]
    spp = sum_pi_squared(logits)
    weights = (0.8 + 0.4 * torch.rand(mask.shape, generator=gen, dtype=torch.float64)) if with_weights else None
    verl_adv, verl_ret = core_algos.compute_optimal_token_baseline_advantage(
        rewards, mask, np.array(ids.tolist()), old, spp, rollout_is_weights=weights
    )
    adv, ret = est.optimal_token_baseline_advantages(rewards, mask.bool(), ids, old, spp, rollout_weights=weights)
    torch.testing.assert_close(ret, verl_ret)
    torch.testing.assert_close(adv, verl_adv)
