"""SkyRL 0.4.0's loss defaults against pgloss, read from its released source ($PGLOSS_SKYRL_SRC, the root of the
unpacked skyrl wheel; `make test` sets it): the defaults of `skyrl/train/config/config.py` (read without
importing it) and SkyRL's own `apply_loss_reduction_to_advantages_minibatch` and `dppo_policy_loss`
(`skyrl/backends/skyrl_train/utils/ppo_utils.py`), executed from the file (docs/integrations.md, "Defaults
that moved").

SkyRL reduces a loss by scaling the advantages of the mini-batch (one optimizer step) so that the token sum
of the per-token loss is the wanted mean: for a loss positively homogeneous in Â (the clipped surrogate), its
loss is pgloss's `token-sum` on the scaled advantages."""

from __future__ import annotations

import ast
import os
import types
from pathlib import Path

import pytest
import torch
from conftest import make_batch

import pgloss
from pgloss.conformance import sources

CONFIG = "skyrl/train/config/config.py"
PPO_UTILS = "skyrl/backends/skyrl_train/utils/ppo_utils.py"
OFF_POLICY = "skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py"
TORCH_UTILS = "skyrl/backends/skyrl_train/utils/torch_utils.py"


def _file(relative: str) -> Path:
    root = os.environ.get("PGLOSS_SKYRL_SRC")
    if not root:
        pytest.skip("PGLOSS_SKYRL_SRC is not set (the root of the unpacked skyrl 0.4.0 wheel)")
    path = Path(root) / relative
    if not path.is_file():
        pytest.skip(f"PGLOSS_SKYRL_SRC={root} holds no {relative}")
    return path


def defaults(cls: str) -> dict:
    """The literal field defaults of the dataclass `cls` in SkyRL's config.py."""
    tree = ast.parse(_file(CONFIG).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and item.value is not None:
            try:
                out[item.target.id] = ast.literal_eval(item.value)
            except ValueError:
                continue
    return out


@pytest.fixture(scope="module")
def skyrl():
    namespace = {"torch": torch}  # annotations are not evaluated
    sources.load(_file(TORCH_UTILS), ("masked_mean", "safe_exp_delta"), namespace)
    sources.load(
        _file(OFF_POLICY),
        (
            "off_policy_correction_enabled",
            "compute_tis_ratio",
            "compute_outlier_token_mask",
            "compute_token_mask",
            "compute_sequence_mask",
            "compute_off_policy_correction",
            "apply_off_policy_correction",
        ),
        namespace,
    )
    return sources.load(
        _file(PPO_UTILS),
        ("reduce_loss", "apply_loss_reduction_to_advantages_minibatch", "dppo_policy_loss"),
        namespace,
    )


def _batch(seed, rows=8, length=9):
    data = make_batch(batch=rows, length=length, seed=seed, spread=0.5, per_token_adv=True)
    data["mask"][3, 0] = True  # no empty row: SkyRL's sequence_mean counts it, pgloss's count does not
    data["group_ids"] = torch.arange(rows) // 4  # two prompts of four responses, contiguous as SkyRL's
    return data


def _skyrl_reduced(skyrl, data, reduction, **kwargs):
    """SkyRL's loss: its advantages scaled by the reduction, then pgloss's token sum of the clipped surrogate."""
    scaled = skyrl["apply_loss_reduction_to_advantages_minibatch"](
        data["advantages"], data["mask"].double(), reduction, max_seq_len=data["mask"].shape[1], **kwargs
    )
    ppo = pgloss.get("ppo", loss_agg_mode="token-sum")
    return ppo(data["log_prob"], data["old_log_prob"], scaled, data["mask"]).loss


def test_loss_reduction_default_is_token_mean():
    assert defaults("AlgorithmConfig")["loss_reduction"] == "token_mean"


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    ("reduction", "mode"),
    [("token_mean", "token-mean"), ("sequence_mean", "seq-mean-token-mean"), ("prompt_mean", "group-mean-token-mean")],
)
def test_token_mean_and_prompt_mean_are_pgloss_modes(skyrl, seed, reduction, mode):
    """SkyRL 0.4's token_mean divides by the mini-batch's tokens (pgloss's token-mean over the step) and its
    prompt_mean is pgloss's group-mean-token-mean (the token mean within each prompt's responses, then the mean
    over prompts); float64."""
    data = _batch(seed)
    bounds = [(0, 4), (4, 8)]
    theirs = _skyrl_reduced(skyrl, data, reduction, micro_batch_size=2, prompt_boundaries=bounds)
    algorithm = pgloss.get("ppo", loss_agg_mode=mode)
    ours = algorithm(
        data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"], group_ids=data["group_ids"]
    )
    torch.testing.assert_close(ours.loss, theirs, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_token_mean_legacy_is_per_micro_batch_and_documented(skyrl, seed):
    """token_mean_legacy averages each micro-batch's token mean: pgloss's token-mean with each micro-batch
    counting itself, not the step (which depends on the split: pgloss's step count does not)."""
    data = _batch(seed)
    theirs = _skyrl_reduced(skyrl, data, "token_mean_legacy", micro_batch_size=2)
    algorithm = pgloss.get("ppo", loss_agg_mode="token-mean")
    parts = [
        algorithm(*(data[k][i : i + 2] for k in ("log_prob", "old_log_prob", "advantages", "mask"))).loss
        for i in range(0, 8, 2)
    ]
    torch.testing.assert_close(torch.stack(parts).mean(), theirs, rtol=0, atol=1e-12)
    step = algorithm(data["log_prob"], data["old_log_prob"], data["advantages"], data["mask"]).loss
    assert abs(float(step - theirs)) > 1e-6  # uneven micro-batches: the two differ


def _skyrl_dppo(skyrl, data, rollout, dppo_type, leaf):
    config = types.SimpleNamespace(
        dppo=types.SimpleNamespace(
            dppo_type=dppo_type, **{k: v for k, v in defaults("DPPOConfig").items() if k != "dppo_type"}
        ),
        off_policy_correction=types.SimpleNamespace(**defaults("OffPolicyCorrectionConfig")),
    )
    mask = data["mask"].double()
    scaled = skyrl["apply_loss_reduction_to_advantages_minibatch"](
        data["advantages"], mask, "token_mean", micro_batch_size=2, max_seq_len=mask.shape[1]
    )
    loss, _ = skyrl["dppo_policy_loss"](
        leaf, data["old_log_prob"], scaled, config, loss_mask=mask, rollout_logprobs=rollout
    )
    return loss


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("dppo_type", "name"), [("binary_tv", "dppo_tv"), ("binary_kl", "dppo_kl")])
def test_dppo_against_the_rollout_without_truncation(skyrl, seed, dppo_type, name):
    """SkyRL's dppo takes its ratio and trust region against the rollout log-probs and truncates nothing;
    pgloss's dppo_tv / dppo_kl (verl's) against `old_log_prob`, the weight truncated at c = 3. Called with
    `old_log_prob=` the rollout log-probs and a truncation above e^20 (log r is clamped to ±20 on both sides),
    the gradient is SkyRL's to float32's precision (SkyRL's `safe_exp_delta` exponentiates in float32 whatever
    the input's dtype; measured 1e-7 relative on float64 inputs); the value is not: SkyRL's is -Â·r, pgloss's
    -Â·sg[r]·log π."""
    assert defaults("DPPOConfig") == {"dppo_type": "binary_tv", "delta_low": 0.2, "delta_high": 0.2}
    data = _batch(seed)
    gen = torch.Generator().manual_seed(seed)
    rollout = -(
        data["old_log_prob"] + 0.4 * torch.randn(data["old_log_prob"].shape, generator=gen, dtype=torch.float64)
    ).abs()
    leaf = data["log_prob"].clone().requires_grad_(True)
    theirs = _skyrl_dppo(skyrl, data, rollout, dppo_type, leaf)
    (want,) = torch.autograd.grad(theirs, leaf)
    assert pgloss.get(name).truncation == 3.0
    algorithm = pgloss.get(name, loss_agg_mode="token-mean", truncation=1e9)
    leaf2 = data["log_prob"].clone().requires_grad_(True)
    ours = algorithm(leaf2, rollout, data["advantages"], data["mask"]).loss
    (grad,) = torch.autograd.grad(ours, leaf2)
    torch.testing.assert_close(grad, want, rtol=1e-6, atol=1e-12)
    valid = data["mask"]
    assert abs(float(ours.detach() - theirs.detach())) > 1e-6
    # with the default c = 3 (seeds 1 and 3 have a ratio above it) the gradients differ
    leaf3 = data["log_prob"].clone().requires_grad_(True)
    (grad3,) = torch.autograd.grad(pgloss.get(name)(leaf3, rollout, data["advantages"], data["mask"]).loss, leaf3)
    ratio = (data["log_prob"] - rollout).exp()
    if bool((ratio[valid] > 3).any()):
        assert not torch.allclose(grad3, want, rtol=1e-6, atol=1e-12)
