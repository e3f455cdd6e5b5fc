"""SkyRL's outlier-token sequence mask (`compute_outlier_token_mask`, skyrl 0.4.0
skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py, read through PGLOSS_SKYRL_SRC) as pgloss's k1
rejections: `outlier_token_is_threshold_high` H is `Rejection("seq_min_k1", upper=None, lower=1/H)` (a sequence goes
when any token's ρ_t = π_old/π_rollout > H), `outlier_token_is_threshold_low` L is
`Rejection("seq_max_k1", upper=1/L, lower=1e-30)` (when any ρ_t < L). The same kept sequences on each side and on both,
3 seeds, with sequences dropped and kept by each side."""

from types import SimpleNamespace

import pytest
import torch
from advantages.trainer_sources import load, source_file
from conftest import log_probs, make_batch

from pgloss import RolloutCorrection
from pgloss.correction.rejection import Rejection

F64 = dict(dtype=torch.float64)


def skyrl_keep(old, rollout, mask, low, high):
    ns = {"torch": torch, "Optional": None, "Tuple": None, "DictConfig": None}
    load(
        source_file("PGLOSS_SKYRL_SRC", "skyrl/backends/skyrl_train/utils/torch_utils.py"),
        ("masked_mean", "safe_exp_delta"),
        ns,
    )
    load(
        source_file("PGLOSS_SKYRL_SRC", "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py"),
        ("compute_outlier_token_mask",),
        ns,
    )
    config = SimpleNamespace(outlier_token_is_threshold_low=low, outlier_token_is_threshold_high=high)
    keep, _ = ns["compute_outlier_token_mask"](old, rollout, mask.double(), config)
    return keep.bool().expand_as(mask) & mask


def rules(low, high):
    out = []
    if high is not None:
        out.append(Rejection("seq_min_k1", upper=None, lower=1 / high))
    if low is not None:
        out.append(Rejection("seq_max_k1", upper=1 / low, lower=1e-30))
    return tuple(out)


@pytest.mark.parametrize("low, high", [(None, 1.8), (0.6, None), (0.6, 1.8)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_outlier_token_mask_matches_skyrl(seed, low, high):
    data = make_batch(batch=12, length=9, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    rollout = log_probs(data["old_log_prob"] + 0.45 * torch.randn(data["mask"].shape, generator=gen, **F64))
    old, mask = data["old_log_prob"], data["mask"]
    theirs = skyrl_keep(old, rollout, mask, low, high)
    ours = RolloutCorrection(weight_level=None, rejection=rules(low, high)).keep_mask(mask, old, rollout)
    assert torch.equal(ours, theirs)
    rho = torch.where(mask, (old - rollout).exp(), 1.0)
    if high is not None:  # the high side drops some sequences and keeps others
        over = (rho > high).any(-1)
        assert over.any() and (~over & mask.any(-1)).any()
    if low is not None:
        under = (rho < low).any(-1)
        assert under.any() and (~under & mask.any(-1)).any()
