"""Each decision has one owner that every path asks (docs/architecture.md's owner table).

- What a `loss_agg_mode` divides by, which count of the step's Normalizer it reads and whether it needs
  a generation budget: its row of `pgloss.core.aggregate.AGGREGATIONS`. The call, `Algorithm`'s checks
  and `needs`, `pgloss.get`'s budget, the TRL and verl translators and the verl adapter's counts ask it,
  so a mode added to the table works on every path with nothing else changed.
- What rollout log-probs do to a loss: `Algorithm.rollout_use`, read by the call's `correction`, the
  TRL translator and adapter and the lab.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import loops
import pytest
import torch

import pgloss
from pgloss.algorithm_fields import ROLLOUT_USES
from pgloss.core import aggregate as agg
from pgloss.core.aggregate import AGGREGATIONS, Aggregation, row_weights
from pgloss.core.normalizer import Normalizer
from pgloss.trainer_options import trl as trl_config
from pgloss.trainer_options import trl_trainer

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)
IDS = torch.tensor([0, 0, 1, 1, 2])
BUDGET = 8.0


def _counts() -> Normalizer:
    return Normalizer.count(MASK, group_ids=IDS, reduce=False)


def _scaled(normalizer: Normalizer, count: str) -> Normalizer:
    """`normalizer` with the count `count` doubled (twice the step, as far as that count can tell)."""
    return dataclasses.replace(normalizer, **{count: getattr(normalizer, count) * 2})


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_each_mode_reads_the_count_its_row_names(mode):
    """Doubling the count the row names changes the weights; doubling any other count changes nothing."""
    record = AGGREGATIONS[mode]
    step = _counts()
    rows = row_weights(MASK, mode, step, norm_constant=BUDGET, group_ids=IDS, delta_l_alpha=0.5)
    for count in ("tokens", "sequences", "group_tokens", "length_counts"):
        other = row_weights(MASK, mode, _scaled(step, count), norm_constant=BUDGET, group_ids=IDS, delta_l_alpha=0.5)
        if count == record.count:
            assert not torch.allclose(other, rows), f"{mode} does not read {count}"
        else:
            torch.testing.assert_close(
                other, rows, rtol=0, atol=0, msg=f"{mode} reads {count}, not only {record.count}"
            )


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_each_mode_asks_a_budget_exactly_when_its_row_says(mode):
    """`needs_budget` is what row_weights, Algorithm, pgloss.get and the verl translator require."""
    values = torch.randn(MASK.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    extra = dict(group_ids=IDS, delta_l_alpha=0.5)
    if AGGREGATIONS[mode].needs_budget:
        with pytest.raises(ValueError, match="needs norm_constant"):
            row_weights(MASK, mode, _counts(), **extra)
        with pytest.raises(ValueError, match=f"'{mode}' requires norm_constant"):
            pgloss.get("dapo", loss_agg_mode=mode)
        assert pgloss.algorithms.divides_by_budget("dapo", loss_agg_mode=mode)
        assert pgloss.get("dapo", loss_agg_mode=mode, generation_budget=BUDGET).norm_constant == BUDGET
    else:
        assert not pgloss.algorithms.divides_by_budget("dapo", loss_agg_mode=mode)
        assert pgloss.get("dapo", loss_agg_mode=mode, generation_budget=BUDGET).norm_constant is None
    out = agg.aggregate(values, MASK, mode, norm_constant=BUDGET, **extra)
    expected = loops.aggregate(
        values.tolist(), MASK.tolist(), mode, norm_constant=BUDGET, group_ids=IDS.tolist(), delta_l_alpha=0.5
    )
    assert out.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("mode", list(AGGREGATIONS))
def test_each_mode_passes_both_translators(mode):
    """verl's `loss_agg_mode` (with `loss_scale_factor` as the budget where the row asks one) and an
    Algorithm of that mode given to the TRL adapter come out as that mode."""
    record = AGGREGATIONS[mode]
    config = dict(loss_agg_mode=mode, loss_scale_factor=BUDGET, policy_loss=dict(loss_mode="pgloss_dapo"))
    algorithm = pgloss.from_verl(config)
    assert algorithm.loss_agg_mode == mode
    assert algorithm.norm_constant == (BUDGET if record.needs_budget else None)
    assert ("group_ids" in algorithm.needs) == record.needs_group_ids
    if record.needs_budget:
        with pytest.raises(ValueError, match="needs actor.loss_scale_factor"):
            pgloss.from_verl(dict(loss_agg_mode=mode, policy_loss=dict(loss_mode="pgloss_dapo")))
    given = pgloss.get("dapo", loss_agg_mode=mode, generation_budget=BUDGET)
    assert trl_trainer.trainer_algorithm(trl_config.grpo_options({}), given) == given


def _half_token_sum(mask, normalizer, **_):
    return torch.full((mask.shape[0],), 0.5, dtype=torch.float64, device=mask.device)


def _budget_token_sum(mask, normalizer, *, norm_constant, **_):
    return torch.full((mask.shape[0],), 1.0 / norm_constant, dtype=torch.float64, device=mask.device)


def test_a_mode_added_to_the_table_is_all_it_takes(monkeypatch):
    """Two new rows, one plain and one with a budget: the call, get, both translators and the verl
    adapter's counts take them without another change."""
    monkeypatch.setitem(
        AGGREGATIONS, "half-token-sum", Aggregation("half-token-sum", "2", None, False, _half_token_sum)
    )
    monkeypatch.setitem(
        AGGREGATIONS, "budget-token-sum", Aggregation("budget-token-sum", "C", None, True, _budget_token_sum)
    )
    gen = torch.Generator().manual_seed(2)
    log_prob = -torch.rand(MASK.shape, generator=gen, dtype=torch.float64)
    old = log_prob + 0.05 * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    advantages = torch.randn(MASK.shape[0], generator=gen, dtype=torch.float64)
    plain = pgloss.get("dapo", loss_agg_mode="token-sum")(log_prob, old, advantages, MASK).loss

    half = pgloss.get("dapo", loss_agg_mode="half-token-sum")
    torch.testing.assert_close(half(log_prob, old, advantages, MASK).loss, 0.5 * plain, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="'budget-token-sum' requires norm_constant"):
        pgloss.get("dapo", loss_agg_mode="budget-token-sum")
    budget = pgloss.get("dapo", loss_agg_mode="budget-token-sum", generation_budget=4)
    torch.testing.assert_close(budget(log_prob, old, advantages, MASK).loss, plain / 4, rtol=1e-12, atol=0)

    for mode, constant in (("half-token-sum", None), ("budget-token-sum", BUDGET)):
        from_verl = pgloss.from_verl(
            dict(loss_agg_mode=mode, loss_scale_factor=BUDGET, policy_loss=dict(loss_mode="pgloss_dapo"))
        )
        assert (from_verl.loss_agg_mode, from_verl.norm_constant) == (mode, constant)
        given = pgloss.get("dapo", loss_agg_mode=mode, generation_budget=BUDGET)
        assert trl_trainer.trainer_algorithm(trl_config.grpo_options({}), given) == given

    verl = pytest.importorskip("pgloss.integrations.verl")
    # dp_size 2 with no counts at all: a mode that reads no count needs none of verl's
    loss = verl.agg_loss(log_prob, MASK, "half-token-sum", dp_size=2)
    torch.testing.assert_close(loss, 2 * 0.5 * log_prob[MASK].sum(), rtol=1e-12, atol=0)


def test_verl_refuses_a_count_it_does_not_carry():
    verl = pytest.importorskip("pgloss.integrations.verl")
    with pytest.raises(ValueError, match="divides by the step's length_counts, which verl's global_batch_info"):
        verl.agg_loss(
            torch.ones(2, 3),
            torch.ones(2, 3),
            "delta-l-norm",
            dp_size=2,
            batch_num_tokens=6,
            global_batch_size=2,
            loss_scale_factor=4,
        )
    with pytest.raises(ValueError, match=r"needs global_batch_info\['global_batch_size'\]"):
        verl.agg_loss(torch.ones(2, 3), torch.ones(2, 3), "seq-mean-token-mean", dp_size=2, batch_num_tokens=6)


# -- rollout log-probs ---------------------------------------------------------------------------------

CORRECTION = pgloss.RolloutCorrection(weight_level="token", upper=3.0)


def _configured(name: str) -> list[pgloss.Algorithm]:
    plain = pgloss.get(name, generation_budget=BUDGET)
    if not type(plain).takes_rollout_correction():
        return [plain]
    return [plain, dataclasses.replace(plain, rollout_correction=CORRECTION)]


@pytest.mark.parametrize("name", pgloss.names())
def test_rollout_use_is_what_the_call_does(name):
    """The call's correction follows `rollout_use`: none for a family's own weight, the configured
    correction, or truncated IS at `rollout_is_cap` when only rollout log-probs are given."""
    for algorithm in _configured(name):
        use = algorithm.rollout_use
        assert use in ROLLOUT_USES
        assert (use == "own weight") == algorithm.consumes_rollout_log_prob
        assert algorithm.correction(False) is (algorithm.rollout_correction if use == "correction" else None)
        given = algorithm.correction(True)
        if use == "own weight":
            assert given is None
        elif use == "correction":
            assert given is CORRECTION
        else:
            assert given == pgloss.RolloutCorrection(
                upper=algorithm.rollout_is_cap, max_log_ratio=algorithm.max_log_ratio
            )


@pytest.mark.parametrize("vllm_is", [False, True])
@pytest.mark.parametrize("name", ["dapo", "vespo"])
def test_trl_passes_vllm_log_probs_by_the_algorithms_answer(name, vllm_is):
    """TRL applies no weight unless asked: the adapter gives vLLM's log-probs to a configured correction,
    to a family's own weight when TRL's vLLM importance sampling is on, and never where the algorithm
    would apply its implicit truncated IS."""
    trl = pytest.importorskip("pgloss.integrations.trl")
    inputs = {"sampling_per_token_logps": torch.zeros(2, 3)}
    for algorithm in _configured(name):
        trainer = SimpleNamespace(algorithm=algorithm, use_vllm=True, vllm_importance_sampling_correction=vllm_is)
        passed = trl.PGLossMixin._pgloss_uses_rollout(trainer, inputs)
        expected = {"correction": True, "own weight": vllm_is, "truncated IS": False}[algorithm.rollout_use]
        assert passed == expected, (algorithm.name, algorithm.rollout_use)
