"""pgloss's check that the swap of conftest.py is in force (not one of verl's tests)."""

import pytest
import torch
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.core_algos import compute_policy_loss_dro, compute_policy_loss_vanilla

from pgloss.integrations import verl as adapter


def test_verl_functions_are_pgloss_s(pgloss_swapped_in):
    """What a verl test module imported from core_algos is pgloss's during its tests."""
    if not pgloss_swapped_in:
        pytest.skip("PGLOSS_PEERS=original: verl's own functions")
    assert core_algos.agg_loss is adapter.agg_loss
    assert compute_policy_loss_dro is core_algos.POLICY_LOSS_REGISTRY["pgloss_dro"]
    assert compute_policy_loss_vanilla.__name__ == "pgloss_dual_clip_ppo_policy_loss"
    assert core_algos.compute_policy_loss_geo_mean.__name__ == "pgloss_gmpo_policy_loss"
    # pgloss's aggregation refuses the padded-width divisor that verl's would use
    with pytest.raises(ValueError, match="norm_constant"):
        core_algos.agg_loss(torch.ones(2, 3), torch.ones(2, 3), "seq-mean-token-sum-norm")
