"""verl 0.9.1's defaults that differ from a pgloss name's, read from the installed verl (its dataclasses and the
YAML its Hydra config is built from), each held to pgloss's documented answer (docs/integrations.md, "Defaults
that moved"): `from_verl` follows verl's config; a pgloss name keeps its own default."""

from pathlib import Path

import pytest
import torch

import pgloss

pytest.importorskip("verl")
yaml = pytest.importorskip("yaml")

import verl  # noqa: E402
from verl.trainer.config import RolloutCorrectionConfig  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

CONFIG = Path(verl.__file__).parent / "trainer" / "config"


def _actor(**fields):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)


def test_verl_actor_aggregates_token_mean_and_dual_clip_ppo_keeps_the_seq_mean():
    """verl `workers/config/actor.py` ActorConfig.loss_agg_mode and `trainer/config/actor/actor.yaml` are
    token-mean; pgloss's `dual_clip_ppo` keeps its registry default, seq-mean-token-mean.
    `from_verl` of verl's default actor (loss_mode vanilla) is dual_clip_ppo aggregated token-mean, as verl."""
    assert ActorConfig.__dataclass_fields__["loss_agg_mode"].default == "token-mean"
    assert yaml.safe_load((CONFIG / "actor" / "actor.yaml").read_text())["loss_agg_mode"] == "token-mean"
    assert pgloss.get("dual_clip_ppo").loss_agg_mode == "seq-mean-token-mean"
    algorithm = pgloss.from_verl(_actor(policy_loss=PolicyLossConfig(loss_mode="vanilla")))
    assert (algorithm.name, algorithm.loss_agg_mode) == ("dual_clip_ppo", "token-mean")
    assert pgloss.from_verl({"policy_loss": {"loss_mode": "vanilla"}}).loss_agg_mode == "token-mean"


def test_rollout_correction_dataclass_default_weighs_the_yaml_default_does_not():
    """verl `trainer/config/algorithm.py` RolloutCorrectionConfig() is rollout_is="sequence", threshold 2.0 (a
    sequence-product weight truncated at 2); `trainer/config/algorithm/rollout_correction.yaml` (and the generated
    ppo_trainer.yaml) set rollout_is: null (no weight). `from_verl` reads what it is given: the dataclass built in
    Python weighs, the YAML's does not."""
    dataclass_default = RolloutCorrectionConfig()
    assert (dataclass_default.rollout_is, dataclass_default.rollout_is_threshold) == ("sequence", 2.0)
    from_yaml = yaml.safe_load((CONFIG / "algorithm" / "rollout_correction.yaml").read_text())
    assert from_yaml["rollout_is"] is None and from_yaml["rollout_is_threshold"] == 2.0
    generated = yaml.safe_load((CONFIG / "_generated_ppo_trainer.yaml").read_text())
    assert generated["algorithm"]["rollout_correction"]["rollout_is"] is None

    actor = _actor()
    weighted = pgloss.from_verl(actor, rollout_correction=dataclass_default).rollout_correction
    assert (weighted.weight_level, weighted.upper, weighted.weight_mode) == ("sequence_product", 2.0, "truncate")
    assert pgloss.from_verl(actor, rollout_correction=from_yaml).rollout_correction is None
    assert pgloss.from_verl(actor).rollout_correction is None


def test_the_two_defaults_give_different_losses():
    """The difference is not cosmetic: on the same batch the dataclass default's loss is not the YAML's."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 5, generator=gen, dtype=torch.float64) - 0.1
    log_prob = -(old + 0.2 * torch.randn(4, 5, generator=gen, dtype=torch.float64)).abs()
    rollout = -(old + 0.4 * torch.randn(4, 5, generator=gen, dtype=torch.float64)).abs()
    advantages, mask = torch.randn(4, generator=gen, dtype=torch.float64), torch.ones(4, 5, dtype=torch.bool)
    losses = []
    for rc in (
        RolloutCorrectionConfig(),
        yaml.safe_load((CONFIG / "algorithm" / "rollout_correction.yaml").read_text()),
    ):
        algorithm = pgloss.from_verl(_actor(), rollout_correction=rc)
        kwargs = {"rollout_log_prob": rollout} if algorithm.rollout_correction is not None else {}
        losses.append(float(algorithm(log_prob, old, advantages, mask, **kwargs).loss))
    assert abs(losses[0] - losses[1]) > 1e-4
