"""pgloss.from_verl: verl 0.9.1's actor config (its real classes, DictConfig, dict) as a pgloss Algorithm.

The loss of `from_verl(config)` is compared with verl's own `ppo_loss` (policy loss + KL + entropy,
as every verl engine calls it) on the same batch, value and gradient, float64.
"""

import dataclasses
import subprocess
import sys

import pytest
import torch

import pgloss

pytest.importorskip("verl")
tensordict = pytest.importorskip("tensordict")
omegaconf = pytest.importorskip("omegaconf")

from verl.trainer.config import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from pgloss.conformance.verl import FIELDS  # noqa: E402  (each verl loss with fields away from the defaults)
from pgloss.integrations import verl as adapter  # noqa: E402
from pgloss.trainer_options.verl import LOSS_MODES, algorithm_from_verl  # noqa: E402

ROWS, LENGTH = 6, 7
POLICY_KEYS = (
    "dro_beta",
    "ppo_kl_coef",
    "kl_cov_ratio",
    "clip_cov_ratio",
    "clip_cov_lb",
    "clip_cov_ub",
    "rollout_correction",
)


def config(loss_mode="vanilla", **fields):
    policy = {key: fields.pop(key) for key in POLICY_KEYS if key in fields}
    return ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy),
        **fields,
    )


def make_batch(seed=0):
    """No empty row, so that verl's row count equals pgloss's own."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, LENGTH + 1, (ROWS,), generator=gen)
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    old = -torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 2 - 0.1
    log_prob = -(old + 0.3 * torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64)).abs()  # log-probs <= 0
    ref = -(old + 0.3 * torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64)).abs()
    rollout = -(old + 0.2 * torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64)).abs()
    advantages = torch.randn(ROWS, 1, generator=gen, dtype=torch.float64).expand(ROWS, LENGTH).clone()
    entropy = torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 3
    return dict(log_prob=log_prob, old=old, ref=ref, rollout=rollout, advantages=advantages, mask=mask, entropy=entropy)


def verl_ppo_loss(cfg, batch):
    """verl's ppo_loss on the whole batch as one micro-batch (padded layout, prompt length 1)."""
    leaf = batch["log_prob"].clone().requires_grad_()
    mask = batch["mask"]
    packed = torch.cat([torch.cat([leaf[i, : int(mask[i].sum())], leaf.new_zeros(1)]) for i in range(ROWS)])
    entropy = torch.cat(
        [torch.cat([batch["entropy"][i, : int(mask[i].sum())], leaf.new_zeros(1)]) for i in range(ROWS)]
    )
    data = tensordict.TensorDict(
        dict(
            prompts=torch.ones(ROWS, 1, dtype=torch.long),
            responses=torch.ones(ROWS, LENGTH, dtype=torch.long),
            attention_mask=torch.cat([torch.ones(ROWS, 1, dtype=torch.bool), mask], dim=1).long(),
            response_mask=mask,
            old_log_probs=batch["old"],
            advantages=batch["advantages"],
            ref_log_prob=batch["ref"],
        ),
        batch_size=[ROWS],
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=ROWS)
    loss, _ = ppo_loss(cfg, {"log_probs": packed, "entropy": entropy}, data)
    loss.backward()
    return loss.detach(), leaf.grad


def pgloss_loss(algorithm, batch, **kwargs):
    leaf = batch["log_prob"].clone().requires_grad_()
    extra = {}
    if "ref_log_prob" in algorithm.needs:
        extra["ref_log_prob"] = batch["ref"]
    if "entropy" in algorithm.needs:
        extra["entropy"] = batch["entropy"]
    out = algorithm(
        log_prob=leaf, old_log_prob=batch["old"], advantages=batch["advantages"], mask=batch["mask"], **extra, **kwargs
    )
    out.loss.backward()
    return out.loss.detach(), leaf.grad


def as_dict(cfg):
    """The config as verl's YAML holds it: plain values and nested mappings."""
    out = {}
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, (bool, int, float, str, type(None))):
            out[field.name] = value
        elif field.name in ("policy_loss", "rollout_correction"):
            out[field.name] = as_dict(value)
    return out


KL_TYPES = ["low_var_kl", "mse", "kl", "abs", "k3+", "low_var_kl+", "k1+"]
AGG = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("index", range(len(FIELDS)))
@pytest.mark.parametrize("form", ["ActorConfig", "DictConfig", "dict"])
def test_from_verl_computes_what_verl_computes(index, form):
    """Every verl loss_mode, with its fields, verl's KL loss and entropy bonus: from_verl's algorithm
    gives the loss and gradient of verl's ppo_loss."""
    mode = list(FIELDS)[index]
    agg = "seq-mean-token-mean" if mode in ("sapo", "geo_mean") else AGG[index % len(AGG)]
    cfg = config(
        mode,
        **FIELDS[mode],
        loss_agg_mode=agg,
        loss_scale_factor=9,
        use_kl_loss=True,
        kl_loss_coef=0.3,
        kl_loss_type=KL_TYPES[index % len(KL_TYPES)],
        entropy_coeff=0.02,
    )
    given = {"ActorConfig": cfg, "DictConfig": omegaconf.OmegaConf.create(as_dict(cfg)), "dict": as_dict(cfg)}[form]
    algorithm = pgloss.from_verl(given)
    assert algorithm.name == LOSS_MODES[mode]
    batch = make_batch(seed=index)
    torch.manual_seed(0)  # clip_cov's draw
    theirs, their_grad = verl_ppo_loss(cfg, batch)
    torch.manual_seed(0)
    ours, our_grad = pgloss_loss(algorithm, batch)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-8, atol=1e-13)
    assert their_grad.abs().sum() > 0


def test_issue_examples_dro_beta_and_kl_cov_fields_reach_pgloss():
    """verl's dro with dro_beta=0.05 and kl_cov with ppo_kl_coef=1, kl_cov_ratio=0.5, through the
    adapter's pgloss_dro / pgloss_kl_cov: verl's values, not pgloss's defaults (β 0.1, κ 0.1, 2e-4)."""
    batch = make_batch(seed=7)
    args = (batch["old"], batch["log_prob"], batch["advantages"], batch["mask"], "token-mean")
    for verl_mode, fields, default in [
        ("dro", dict(dro_beta=0.05), pgloss.get("dro")),
        ("kl_cov", dict(ppo_kl_coef=1.0, kl_cov_ratio=0.5), pgloss.get("kl_cov")),
    ]:
        theirs, _ = core_algos.get_policy_loss_fn(verl_mode)(*args, config(verl_mode, **fields))
        ours, _ = core_algos.get_policy_loss_fn("pgloss_" + verl_mode)(*args, config("pgloss_" + verl_mode, **fields))
        stale = default(
            log_prob=batch["log_prob"], old_log_prob=batch["old"], advantages=batch["advantages"], mask=batch["mask"]
        ).loss
        torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=0)
        assert abs(float(stale - theirs)) > 1e-3  # the default would have been a different loss


def test_adapter_and_from_verl_are_one_mapping():
    """The adapter's per-call algorithm is from_verl's without verl's KL and entropy terms."""
    cfg = config(
        "pgloss_kl_cov",
        ppo_kl_coef=0.7,
        kl_cov_ratio=0.1,
        loss_agg_mode="seq-mean-token-sum",
        use_kl_loss=True,
        kl_loss_coef=0.2,
        entropy_coeff=0.01,
    )
    per_call = adapter._algorithm("kl_cov", None, "seq-mean-token-sum", cfg)
    assert per_call == dataclasses.replace(pgloss.from_verl(cfg), kl_coef=0.0, entropy_coef=0.0)
    assert (per_call.ppo_kl_coef, per_call.kl_cov_ratio) == (0.7, 0.1)


def test_registered_variant_is_read_by_from_verl():
    key = adapter.register("dro_b03_cfgtest", pgloss.get("dro", dro_beta=0.3), overwrite=True)
    assert pgloss.from_verl(config(key)).dro_beta == 0.3  # unset in verl: the variant's own β stands
    assert pgloss.from_verl(config(key, dro_beta=0.05)).dro_beta == 0.05


@pytest.fixture
def registered():
    """Names registered by a test, removed afterwards so that every other test sees the built-in table."""
    from pgloss.algorithms import NAMED, RECIPES, SOURCES

    added = []
    yield added
    for name in added:
        for table in (NAMED, SOURCES, RECIPES):
            table.pop(name, None)


def test_a_name_registered_with_its_own_default_is_read_by_from_verl(registered):
    """pgloss.register("my_dro", DRO, dro_beta=0.3): unset in verl, the registered β stands (a built-in
    name without one, pgloss_dro, is refused as verl refuses dro)."""
    pgloss.register("my_dro_cfgtest", type(pgloss.get("dro")), dro_beta=0.3)
    registered.append("my_dro_cfgtest")
    cfg = config("pgloss_my_dro_cfgtest", loss_agg_mode="seq-mean-token-mean")
    assert pgloss.from_verl(cfg).dro_beta == 0.3
    assert adapter._algorithm("my_dro_cfgtest", None, "token-mean", cfg).dro_beta == 0.3
    assert pgloss.from_verl(config("pgloss_my_dro_cfgtest", dro_beta=0.05)).dro_beta == 0.05
    with pytest.raises(ValueError, match="pgloss_dro.? needs policy_loss.dro_beta"):
        pgloss.from_verl(config("pgloss_dro"))


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        (dict(loss_mode="dro"), "policy_loss.dro_beta > 0 .verl refuses it unset"),
        (dict(loss_mode="pgloss_dro"), "policy_loss.dro_beta > 0"),
        (dict(loss_mode="dro", dro_beta=-1.0), "dro_beta must be > 0"),
        (dict(loss_mode="my_loss"), "policy_loss.loss_mode 'my_loss' has no pgloss equivalent"),
        (dict(loss_mode="vanilla", loss_agg_mode="seq-mean-token-sum-norm"), "needs actor.loss_scale_factor"),
        (dict(loss_mode="vanilla", use_kl_loss=True, kl_loss_type="full"), "kl_loss_type 'full' is not implemented"),
        (
            dict(loss_mode="vanilla", use_kl_loss=True, kl_loss_type="k9"),
            "kl_loss_type='k9' is not one of verl's KL types",
        ),
        (dict(loss_mode="sapo", entropy_coeff=0.01), "set loss_agg_mode='seq-mean-token-mean'"),
        (dict(loss_mode="gspo", clip_ratio_c=0.5), None),  # clip_ratio_c applies to dual-clip losses only
        (dict(loss_mode="vanilla", clip_ratio_c=0.5), "dual_clip must be > 1"),
        (
            dict(
                loss_mode="bypass_mode",
                rollout_correction=RolloutCorrectionConfig(
                    bypass_mode=True, loss_type="reinforce", rollout_is="token", rollout_is_batch_normalize=True
                ),
            ),
            "rollout_is_batch_normalize with bypass_mode has no pgloss equivalent",
        ),
        (
            dict(loss_mode="bypass_mode", rollout_correction=RolloutCorrectionConfig(rollout_rs="token_k3")),
            "rollout_rs needs rollout_rs_threshold",
        ),
        (
            dict(loss_mode="bypass_mode", rollout_correction=RolloutCorrectionConfig(loss_type="a2c")),
            "loss_type must be 'ppo_clip' or 'reinforce'",
        ),
    ],
)
def test_refusals_name_the_option(fields, match):
    cfg = config(fields.pop("loss_mode"), **fields)
    if match is None:
        assert pgloss.from_verl(cfg).name == "gspo_token"
        return
    with pytest.raises(ValueError, match=match):
        pgloss.from_verl(cfg)


def test_refusals_of_the_adapter_are_verl_s():
    """An unset dro_beta through pgloss_dro is refused at the call, as verl's dro refuses it."""
    batch = make_batch()
    args = (batch["old"], batch["log_prob"], batch["advantages"], batch["mask"], "token-mean")
    with pytest.raises(ValueError, match="dro_beta"):
        core_algos.get_policy_loss_fn("dro")(*args, config("dro"))
    with pytest.raises(ValueError, match="pgloss_dro needs policy_loss.dro_beta"):
        core_algos.get_policy_loss_fn("pgloss_dro")(*args, config("pgloss_dro"))


def _with_info(cfg, mask):
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=mask.shape[0])
    return cfg


@pytest.mark.parametrize("preset", ["bypass_ppo_clip_k3_rs", "bypass_pg_is", "bypass_pg_geo_rs_token_tis"])
def test_bypass_mode_as_verl_runs_it(preset):
    """verl's bypass_mode loss (old = rollout log-probs; weights and rejections on π_θ / π_rollout)."""
    rc = getattr(RolloutCorrectionConfig, preset)()
    batch = make_batch(seed=3)
    cfg = _with_info(config("bypass_mode", rollout_correction=rc, clip_ratio_high=0.28), batch["mask"])
    leaf = batch["log_prob"].clone().requires_grad_()
    theirs, _ = core_algos.compute_policy_loss_bypass_mode(
        batch["rollout"], leaf, batch["advantages"], batch["mask"].double(), "token-mean", cfg
    )
    theirs.backward()
    algorithm = pgloss.from_verl(config(rollout_correction=rc, clip_ratio_high=0.28), rollout_correction=rc)
    assert algorithm.rollout_correction.bypass
    ours, our_grad = pgloss_loss(
        algorithm,
        dict(batch, old=batch["rollout"]),
        rollout_log_prob=batch["rollout"],
        normalizer=pgloss.Normalizer.count(batch["mask"]),
    )
    torch.testing.assert_close(ours, theirs.detach(), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(our_grad, leaf.grad, rtol=1e-8, atol=1e-13)


@pytest.mark.parametrize(
    "preset", ["decoupled_token_is", "decoupled_seq_is", "decoupled_k3_rs_token_tis", "decoupled_geo_rs_seq_tis"]
)
@pytest.mark.parametrize("normalize", [False, True])
def test_decoupled_rollout_correction_as_verl_runs_it(preset, normalize):
    """algorithm.rollout_correction in decoupled mode: verl's trainer weighs and rejects on π_old /
    π_rollout over the whole batch, then the actor's loss runs on the kept tokens."""
    rc = getattr(RolloutCorrectionConfig, preset)()
    rc = dataclasses.replace(rc, rollout_is_batch_normalize=normalize and rc.rollout_is is not None)
    batch = make_batch(seed=4)
    if "geo" in preset:  # a sequence's mean log-ratio bound of 1e-3: a close sampler, so that rows survive
        batch["rollout"] = batch["old"] + 2e-3 * (batch["rollout"] - batch["old"])
    proto, kept, _ = compute_rollout_correction_and_rejection_mask(
        batch["old"],
        batch["rollout"],
        batch["mask"].double(),
        rollout_is=rc.rollout_is,
        rollout_is_threshold=rc.rollout_is_threshold,
        rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
    )
    weights = proto.batch["rollout_is_weights"] if proto is not None else None
    leaf = batch["log_prob"].clone().requires_grad_()
    cfg = _with_info(config("vanilla", clip_ratio_high=0.28), kept)
    theirs, _ = core_algos.compute_policy_loss_vanilla(
        batch["old"], leaf, batch["advantages"], kept, "token-mean", cfg, rollout_is_weights=weights
    )
    theirs.backward()
    algorithm = pgloss.from_verl(config("vanilla", clip_ratio_high=0.28), rollout_correction=rc)
    step = algorithm.step_normalizer(batch["mask"], old_log_probs=batch["old"], rollout_log_probs=batch["rollout"])
    ours, our_grad = pgloss_loss(algorithm, batch, rollout_log_prob=batch["rollout"], normalizer=step)
    assert kept.sum() > 0 and leaf.grad.abs().sum() > 0
    rtol = 1e-8 if normalize else 1e-10  # verl's masked_mean divides by count + 1e-8 (3.7e-10 relative here)
    torch.testing.assert_close(ours, theirs.detach(), rtol=rtol, atol=1e-13)
    torch.testing.assert_close(our_grad, leaf.grad, rtol=1e-8, atol=1e-13)


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum", "token-mean"])
def test_from_verl_with_rows_emptied_by_the_rejection_differs_as_documented(agg):
    """A sequence-level rejection (rollout_rs="seq_mean_k3", threshold 0.02) empties 3 of the 6 rows:
    verl's seq-mean modes divide by global_batch_size, every row counted, where one pgloss call divides
    by the 3 kept rows (0.195322 against verl's 0.097661 under seq-mean-token-mean: exactly x 6/3); the
    step's counts with verl's row count give verl's loss. token-mean counts the kept tokens on both sides."""
    rc = RolloutCorrectionConfig(rollout_is=None, rollout_rs="seq_mean_k3", rollout_rs_threshold="0.02")
    batch = make_batch(seed=4)
    _, kept, _ = compute_rollout_correction_and_rejection_mask(
        batch["old"],
        batch["rollout"],
        batch["mask"].double(),
        rollout_is=None,
        rollout_is_threshold=None,
        rollout_rs=rc.rollout_rs,
        rollout_rs_threshold=rc.rollout_rs_threshold,
    )
    kept = kept.bool()
    assert int(kept.any(-1).sum()) == 3 and torch.equal(kept, batch["mask"] & kept.any(-1, keepdim=True))
    cfg = config("vanilla", loss_agg_mode=agg)
    theirs, their_grad = verl_ppo_loss(cfg, dict(batch, mask=kept))  # global_batch_size = ROWS, as verl's trainer
    algorithm = pgloss.from_verl(cfg, rollout_correction=rc)
    one_call, _ = pgloss_loss(algorithm, batch, rollout_log_prob=batch["rollout"])
    ratio = 1.0 if agg == "token-mean" else ROWS / 3
    torch.testing.assert_close(one_call, theirs * ratio, rtol=1e-10, atol=0)
    step = algorithm.step_normalizer(batch["mask"], old_log_probs=batch["old"], rollout_log_probs=batch["rollout"])
    as_verl = dataclasses.replace(step, sequences=torch.tensor(float(ROWS), dtype=torch.float64))
    ours, our_grad = pgloss_loss(algorithm, batch, rollout_log_prob=batch["rollout"], normalizer=as_verl)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=0)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-8, atol=1e-13)
    assert "global_batch_size" in pgloss.from_verl.__doc__  # the difference is stated where the promise is made


def test_import_pgloss_does_not_import_verl():
    code = (
        "import sys, pgloss; pgloss.from_verl({'policy_loss': {'loss_mode': 'dro', 'dro_beta': 0.1}}); "
        "print('verl' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_policy_only_drops_verl_s_own_terms():
    cfg = config("vanilla", use_kl_loss=True, kl_loss_coef=0.5, entropy_coeff=0.1)
    full, policy = algorithm_from_verl(cfg), algorithm_from_verl(cfg, policy_only=True)
    assert (full.kl_coef, full.entropy_coef, full.kl_estimator) == (0.5, 0.1, "k3")
    assert (policy.kl_coef, policy.entropy_coef) == (0.0, 0.0)


def test_a_dict_config_s_misspelt_key_is_refused_not_ignored():
    """`clip_ratio_hgh` used to give clip_high 0.2 silently; now it is named with the key it misspells. A full
    verl config as a dict (every field of ActorConfig and PolicyLossConfig, with its real neighbours of the keys
    pgloss reads) is no typo."""
    with pytest.raises(
        ValueError,
        match=r"^verl's actor config: 'clip_ratio_hgh' is not an option \(did you mean "
        r"'clip_ratio_high'\?\)",
    ):
        pgloss.from_verl(dict(clip_ratio_hgh=0.3, policy_loss=dict(loss_mode="vanilla")))
    with pytest.raises(
        ValueError,
        match=r"^verl's policy_loss config: 'loss_mod' is not an option \(did you mean "
        r"'loss_mode'\?\)",
    ):
        pgloss.from_verl(omegaconf.OmegaConf.create(dict(policy_loss=dict(loss_mod="vanilla"))))
    full = config(clip_ratio_high=0.28)
    assert pgloss.from_verl(dataclasses.asdict(full)) == pgloss.from_verl(full)
    from pgloss.trainer_options.verl import READ_KEYS

    fields = {f.name for f in dataclasses.fields(ActorConfig)}
    assert set(READ_KEYS["actor"]) <= fields and set(READ_KEYS["policy_loss"]) <= {
        f.name for f in dataclasses.fields(PolicyLossConfig)
    }


def test_an_unknown_kl_loss_type_is_named_in_verl_s_words():
    with pytest.raises(
        ValueError,
        match=r"^kl_loss_type='low_var_kll' is not one of verl's KL types .*"
        r"\(did you mean 'low_var_kl'\?\)",
    ):
        pgloss.from_verl(dict(use_kl_loss=True, kl_loss_type="low_var_kll", policy_loss=dict(loss_mode="vanilla")))
