"""The step's counting and the inputs an algorithm needs: one owner (`Algorithm.step_normalizer`,
`Algorithm.needs`, `pgloss.get(generation_budget=)`) that every path calls."""

import pytest
import torch
from conftest import log_probs
from properties.micro_batches import cut, split_call

import pgloss
from pgloss.correction.rejection import Rejection
from pgloss.correction.rollout import RolloutCorrection


def batch(seed=0, rows=8, width=12):
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, width, generator=g) < 0.8
    old = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 2
    return dict(
        log_prob=log_probs(old + 0.1 * torch.randn(rows, width, generator=g, dtype=torch.float64)),
        old_log_prob=old,
        rollout_log_prob=log_probs(old + 0.3 * torch.randn(rows, width, generator=g, dtype=torch.float64)),
        advantages=torch.randn(rows, generator=g, dtype=torch.float64),
        mask=mask,
    )


CORRECTIONS = {
    "k3 rejection": RolloutCorrection(rejection=(Rejection("token_k3", upper=0.05),)),
    "batch-normalised": RolloutCorrection(upper=1.5, batch_normalize=True),
    "sequence rejection": RolloutCorrection(weight_level=None, rejection=(Rejection("seq_mean_k1", upper=1.2),)),
}


@pytest.mark.parametrize("kind", CORRECTIONS)
def test_micro_batches_counted_by_the_step_rule_equal_one_call(kind):
    algorithm = pgloss.get("dapo", rollout_correction=CORRECTIONS[kind])
    data = batch()
    log_prob = data.pop("log_prob").requires_grad_(True)
    whole = algorithm(log_prob, **data).loss
    parts = [slice(0, 3), slice(3, 8)]
    normalizer = algorithm.step_normalizer(
        cut(data["mask"], parts),
        old_log_probs=cut(data["old_log_prob"], parts),
        rollout_log_probs=cut(data["rollout_log_prob"], parts),
    )
    split, grad_split = split_call(algorithm, log_prob, parts, normalizer, **data)
    torch.testing.assert_close(split, whole.detach(), rtol=1e-12, atol=1e-14)
    (grad_whole,) = torch.autograd.grad(whole, log_prob)
    torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-14)


def test_counting_the_original_masks_gives_another_loss_under_rejection():
    """What an adapter that counts the masks itself computed: the test above can fail."""
    algorithm = pgloss.get("dapo", rollout_correction=CORRECTIONS["k3 rejection"])
    data = batch()
    whole = algorithm(**data).loss
    naive = pgloss.Normalizer.count(data["mask"])
    assert not torch.allclose(algorithm(**data, normalizer=naive).loss, whole)


def test_the_step_rule_needs_old_log_probs_beside_rollout_ones():
    algorithm = pgloss.get("dapo", rollout_correction=CORRECTIONS["k3 rejection"])
    data = batch()
    with pytest.raises(ValueError, match="old_log_probs"):
        algorithm.step_normalizer(data["mask"], rollout_log_probs=data["rollout_log_prob"])
    with pytest.raises(ValueError, match="rollout_log_probs"):
        algorithm.step_normalizer(data["mask"])


def test_group_ids_are_counted_only_when_needed():
    data = batch()
    ids = torch.arange(8) // 2
    assert pgloss.get("grpo").step_normalizer(data["mask"], group_ids=ids).group_tokens is None
    counted = pgloss.get("grpo", loss_agg_mode="group-mean-token-mean").step_normalizer(data["mask"], group_ids=ids)
    torch.testing.assert_close(counted.group_tokens, data["mask"].sum(-1).double().reshape(4, 2).sum(-1))


@pytest.mark.parametrize(
    "name, hyperparameters, expected",
    [
        ("dapo", {}, set()),
        ("grpo", {"kl_coef": 0.1}, {"ref_log_prob"}),
        ("grpo", {"kl_coef": 0.1, "kl_estimator": "full"}, {"full_kl"}),
        ("dapo", {"entropy_coef": 0.01}, {"entropy"}),
        ("dapo", {"loss_agg_mode": "group-mean-token-mean"}, {"group_ids"}),
        ("grpo", {}, {"ref_log_prob"}),
        ("real", {}, {"group_ids"}),
        ("topr", {}, {"scores"}),
        ("dapo", {"rollout_correction": RolloutCorrection()}, {"rollout_log_prob"}),
        ("dapo", {"rollout_correction": RolloutCorrection(weight_level=None, off_policy_mask=0.1)}, set()),
    ],
)
def test_needs_declares_every_input_the_call_requires(name, hyperparameters, expected):
    algorithm = pgloss.get(name, generation_budget=64, **hyperparameters)
    assert algorithm.needs == expected
    data = batch()
    extra = dict(
        ref_log_prob=data["old_log_prob"],
        full_kl=torch.zeros_like(data["old_log_prob"]),
        entropy=torch.ones_like(data["old_log_prob"]),
        group_ids=torch.arange(8) // 2,
        scores=torch.randn(8, dtype=torch.float64),
        rollout_log_prob=data["rollout_log_prob"],
    )
    given = {k: v for k, v in data.items() if k != "rollout_log_prob"}
    algorithm(**given, **{k: extra[k] for k in expected})  # enough
    for missing in expected:
        with pytest.raises(ValueError, match=f"needs {missing}"):
            algorithm(**given, **{k: extra[k] for k in expected - {missing}})


def test_generation_budget_sets_the_divisor_only_where_the_loss_divides_by_one():
    assert pgloss.get("dr_grpo", generation_budget=512).norm_constant == 512.0
    assert pgloss.get("dr_grpo", generation_budget=512, norm_constant=100.0).norm_constant == 100.0
    assert pgloss.get("grpo", generation_budget=512).norm_constant is None
    assert pgloss.get("grpo", loss_agg_mode="seq-mean-token-sum-norm", generation_budget=64).norm_constant == 64.0
    assert pgloss.algorithms.divides_by_budget("dr_grpo") and not pgloss.algorithms.divides_by_budget("dapo")
    with pytest.raises(ValueError, match="norm_constant"):
        pgloss.get("dr_grpo")
    with pytest.raises(ValueError, match="generation_budget"):
        pgloss.get("dr_grpo", generation_budget=0)
    with pytest.raises(TypeError, match="generation_budget"):
        pgloss.get("dr_grpo", generation_budget="512")
