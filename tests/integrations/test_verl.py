"""pgloss_<name> inside verl 0.9.1: through verl's own `ppo_loss`, with the counts its engine fills.

`verl.workers.utils.losses.ppo_loss` is what every verl engine calls per micro-batch. Its inputs
are built here as the engine builds them: log-probs in verl's packed (no-padding) layout,
`dp_size`, `batch_num_tokens` (the all-reduced valid-token count, an int) and `global_batch_size`
(rows of the mini-batch, empty ones included) set on every micro-batch. The log-probs are float64
leaves: a gradient with respect to them is the gradient with respect to any parameter upstream.
"""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import pgloss

pytest.importorskip("verl")
tensordict = pytest.importorskip("tensordict")

from properties.micro_batches import micro_batches  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from pgloss.integrations import verl as adapter  # noqa: E402

ROWS, LENGTH, BUDGET = 8, 7, 9.0
SPLIT = [slice(0, 3), slice(3, 4), slice(4, 8)]  # uneven micro-batches, as verl's dynamic batching makes them


def make_batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, LENGTH + 1, (ROWS,), generator=gen)
    lengths[5] = 0  # an empty response: verl's global_batch_size still counts its row
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    old = -torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 2 - 0.1
    log_prob = -(old + 0.3 * torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64)).abs()  # log-probs are <= 0
    advantages = torch.randn(ROWS, 1, generator=gen, dtype=torch.float64).expand(ROWS, LENGTH).clone()
    weights = 0.5 + torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64)
    prompt_lengths = torch.randint(1, 4, (ROWS,), generator=gen)
    return dict(
        log_prob=log_prob, old=old, advantages=advantages, mask=mask, weights=weights, prompt_lengths=prompt_lengths
    )


def actor_config(loss_mode=None, **fields):
    """verl's ActorConfig; `loss_mode` or an explicit `policy_loss=PolicyLossConfig(...)`."""
    if loss_mode is not None:
        fields["policy_loss"] = PolicyLossConfig(loss_mode=loss_mode)
    return ActorConfig(strategy="fsdp", rollout_n=4, ppo_mini_batch_size=2, ppo_micro_batch_size_per_gpu=2, **fields)


def micro_batch(batch, leaf, rows, *, dp_size=1, with_weights=False):
    """One micro-batch in verl's layout: left-padded prompts, right-padded responses, packed log-probs."""
    mask, prompt_lengths = batch["mask"][rows], batch["prompt_lengths"][rows]
    n, width = mask.shape[0], int(prompt_lengths.max())
    prompt_attention = torch.arange(width)[None, :] >= (width - prompt_lengths)[:, None]
    packed = []
    for i in range(n):  # position s of a sequence holds log π of token s + 1
        length = int(mask[i].sum())
        zeros = leaf.new_zeros(int(prompt_lengths[i]) - 1)
        packed += [zeros, leaf[rows][i, :length], leaf.new_zeros(1)]
    fields = dict(
        prompts=torch.ones(n, width, dtype=torch.long),
        responses=torch.ones(n, LENGTH, dtype=torch.long),
        attention_mask=torch.cat([prompt_attention, mask], dim=1).long(),
        response_mask=mask,
        old_log_probs=batch["old"][rows],
        advantages=batch["advantages"][rows],
    )
    if with_weights:
        fields["rollout_is_weights"] = batch["weights"][rows]
    data = tensordict.TensorDict(fields, batch_size=[n])
    # What FSDPEngine.forward_backward_batch and the trainer set: global counts of the mini-batch.
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=int(batch["mask"].sum()), global_batch_size=ROWS)
    return {"log_probs": torch.cat(packed)}, data


def run(config, batch, split, **kwargs):
    """Σ of ppo_loss over the micro-batches of `split`, and the gradient of that sum."""
    leaf = batch["log_prob"].clone().requires_grad_()
    return micro_batches(lambda rows: ppo_loss(config, *micro_batch(batch, leaf, rows, **kwargs))[0], split), leaf.grad


def own_mode(name):
    return pgloss.get(name, generation_budget=BUDGET).loss_agg_mode


def test_every_name_is_registered():
    assert all(adapter.registered_name(n) in core_algos.POLICY_LOSS_REGISTRY for n in pgloss.names())
    assert core_algos.get_policy_loss_fn("pgloss_dapo").__name__ == "pgloss_dapo_policy_loss"


@pytest.mark.parametrize("name", pgloss.names())
def test_micro_batches_equal_one_call(name):
    """Uneven micro-batches through verl's ppo_loss give the loss and gradient of one call."""
    algorithm = pgloss.get(name, generation_budget=BUDGET)
    batch = make_batch(seed=1)
    fields = dict(policy_loss=PolicyLossConfig(loss_mode=adapter.registered_name(name), dro_beta=0.1))
    if own_mode(name) == "group-mean-token-mean":  # REAL: a per-group loss; verl has no group mode nor ids
        with pytest.raises(ValueError, match="fixes loss_agg_mode='group-mean-token-mean'"):
            run(actor_config(**fields), batch, SPLIT)
        return
    needs = dataclasses.replace(algorithm, kl_coef=0.0, entropy_coef=0.0).needs  # verl adds KL and entropy itself
    if needs:  # e.g. TOPR's scores: verl passes none to a policy loss
        config = actor_config(**fields, loss_agg_mode=own_mode(name))
        with pytest.raises(ValueError, match=f"needs {sorted(needs)[0]}.*verl does not pass"):
            run(config, batch, SPLIT)
        return
    config = actor_config(**fields, loss_agg_mode=own_mode(name), loss_scale_factor=BUDGET)
    if algorithm.couples_rows:
        # A selection among a call's tokens: per micro-batch by definition (verl's own clip_cov and
        # kl_cov too), so only one call is checked.
        loss, grad = run(config, batch, [slice(0, ROWS)])
        assert torch.isfinite(loss) and grad.abs().sum() > 0
        return
    loss_split, grad_split = run(config, batch, SPLIT)
    loss_whole, grad_whole = run(config, batch, [slice(0, ROWS)])
    torch.testing.assert_close(loss_split, loss_whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_split, grad_whole, rtol=1e-12, atol=1e-14)
    assert grad_whole.abs().sum() > 0
    assert float(grad_whole[~batch["mask"]].abs().max()) == 0.0


def test_dp_size_scales_each_rank_share():
    """With dp_size=2 a rank's loss is twice its share: DDP's average over ranks restores the sum."""
    config = actor_config("pgloss_dapo")
    batch = make_batch(seed=2)
    one, _ = run(config, batch, SPLIT)
    two, _ = run(config, batch, SPLIT, dp_size=2)
    torch.testing.assert_close(two, 2 * one, rtol=1e-12, atol=0)


PARITY = [  # (verl's loss_mode, pgloss name, ActorConfig fields)
    ("vanilla", "dual_clip_ppo", dict(loss_agg_mode="token-mean", clip_ratio_high=0.28)),
    ("vanilla", "dual_clip_ppo", dict(loss_agg_mode="seq-mean-token-mean")),
    ("vanilla", "dual_clip_ppo", dict(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=BUDGET)),
    ("vanilla", "dual_clip_ppo", dict(loss_agg_mode="token-sum")),
    ("vanilla", "dual_clip_ppo", dict(loss_agg_mode="seq-mean-token-sum")),
    ("gspo", "gspo_token", dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
    ("gspo", "gspo", dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_low=3e-4, clip_ratio_high=4e-4)),
    ("sapo", "sapo", dict(loss_agg_mode="seq-mean-token-mean", tau_pos=1.0, tau_neg=1.05)),
    ("cispo", "cispo", dict(loss_agg_mode="token-mean", clip_ratio_low=10.0, clip_ratio_high=4.0)),
    # verl's policy_loss fields (PolicyLossConfig) reach the pgloss field of the same meaning
    ("dro", "dro", dict(loss_agg_mode="token-mean", dro_beta=0.05)),
    ("dro", "dro", dict(loss_agg_mode="seq-mean-token-mean", dro_beta=0.3)),
    ("kl_cov", "kl_cov", dict(loss_agg_mode="token-mean", ppo_kl_coef=1.0, kl_cov_ratio=0.5)),
    ("kl_cov", "kl_cov", dict(loss_agg_mode="seq-mean-token-sum", ppo_kl_coef=0.3, kl_cov_ratio=0.1)),
    # clip_cov_ratio 1: every candidate is detached, the draw (verl's randperm, pgloss's keys) does not enter
    ("clip_cov", "clip_cov", dict(loss_agg_mode="token-mean", clip_cov_ratio=1.0, clip_cov_lb=-0.5, clip_cov_ub=2.0)),
    ("gpg", "gpg", dict(loss_agg_mode="token-mean")),
    (
        "dppo_tv",
        "dppo_tv",
        dict(loss_agg_mode="token-mean", clip_ratio_c=1.5, clip_ratio_low=0.05, clip_ratio_high=0.1),
    ),
    ("dppo_kl", "dppo_kl", dict(loss_agg_mode="seq-mean-token-mean", clip_ratio_c=1.2, clip_ratio_low=0.02)),
]
POLICY_LOSS_KEYS = ("dro_beta", "ppo_kl_coef", "kl_cov_ratio", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")


def parity_config(loss_mode, fields):
    fields = dict(fields)
    policy = {key: fields.pop(key) for key in POLICY_LOSS_KEYS if key in fields}
    return actor_config(policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy), **fields)


@pytest.mark.parametrize("with_weights", [False, True], ids=["plain", "rollout_is_weights"])
@pytest.mark.parametrize(
    ("verl_mode", "name", "fields"), PARITY, ids=[f"{v}-{n}-{f['loss_agg_mode']}" for v, n, f in PARITY]
)
def test_equals_verl_own_loss(verl_mode, name, fields, with_weights):
    """verl's own loss and pgloss's, split the same way with the same counts: same loss and gradient."""
    if with_weights and name == "gspo":
        pytest.skip(
            "per-token weights on GSPO's sequence loss spread its gradient evenly; verl's gspo is "
            "the sequence-token form (pgloss_gspo_token), which weights each token's own gradient"
        )
    batch = make_batch(seed=3)
    if verl_mode == "gspo":  # small log-ratios, so that some sequences fall inside GSPO's narrow band
        batch["log_prob"] = batch["old"] + 1e-4 * (batch["log_prob"] - batch["old"])
    # Clip-Cov and KL-Cov select among a call's tokens; a one-row micro-batch with a sequence-level
    # advantage has cov = 0 on every token, where verl and pgloss break the tie differently
    # (docs/reference.md), so their micro-batches hold several rows.
    split = [slice(0, 3), slice(3, 8)] if verl_mode in ("clip_cov", "kl_cov") else SPLIT
    torch.manual_seed(0)  # clip_cov draws its tokens with torch's global generator, pgloss's as verl's
    theirs, their_grad = run(parity_config(verl_mode, fields), batch, split, with_weights=with_weights)
    torch.manual_seed(0)
    ours, our_grad = run(parity_config(adapter.registered_name(name), fields), batch, split, with_weights=with_weights)
    torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(our_grad, their_grad, rtol=1e-7, atol=1e-12)
    assert their_grad.abs().sum() > 0


def test_metrics_are_verl_keys():
    fn = core_algos.get_policy_loss_fn("pgloss_dual_clip_ppo")
    batch = make_batch()
    _, metrics = fn(
        batch["old"],
        batch["log_prob"],
        batch["advantages"],
        batch["mask"],
        "token-mean",
        actor_config("pgloss_dual_clip_ppo"),
    )
    assert {"actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_clipfrac_lower"} <= set(metrics)
    assert "actor/pg_loss" not in metrics  # ppo_loss records it itself


def test_the_algorithm_is_built_once_per_configuration(monkeypatch):
    """verl calls a policy loss per micro-batch with fresh global counts: the algorithm is built once for a
    configuration (what `algorithm_from_verl` reads, and the call's loss_agg_mode), again when it changes."""
    built = []
    build = adapter._algorithm
    monkeypatch.setattr(adapter, "_algorithm", lambda *args: built.append(args[2:]) or build(*args))
    fn = adapter.policy_loss_fn("dapo")
    batch = make_batch()
    config = actor_config("pgloss_dapo", clip_ratio_high=0.28)

    def call(config, mode="token-mean", rows=SPLIT[0]):
        return fn(
            batch["old"][rows], batch["log_prob"][rows], batch["advantages"][rows], batch["mask"][rows], mode, config
        )

    for rows in SPLIT:
        config.global_batch_info.update(dp_size=1, batch_num_tokens=int(batch["mask"].sum()), global_batch_size=ROWS)
        call(config, rows=rows)
    assert len(built) == 1
    call(config, "seq-mean-token-mean")
    call(actor_config("pgloss_dapo", clip_ratio_high=0.3))
    call(actor_config("pgloss_dapo", clip_ratio_high=0.28))  # a new object, the same configuration
    assert len(built) == 3
    call({"clip_ratio_high": 0.28, "global_batch_info": {}})  # a dict: its keys are part of it
    with pytest.raises(ValueError, match="clip_ratio_hihg"):
        call({"clip_ratio_high": 0.28, "global_batch_info": {}, "clip_ratio_hihg": 0.3})


def test_unhonourable_modes_are_refused():
    batch = make_batch()
    args = (batch["old"], batch["log_prob"], batch["advantages"], batch["mask"])
    with pytest.raises(ValueError, match="loss_scale_factor"):
        core_algos.get_policy_loss_fn("pgloss_dr_grpo")(*args, "seq-mean-token-sum-norm", actor_config("x"))
    with pytest.raises(ValueError, match="fixes loss_agg_mode"):
        core_algos.get_policy_loss_fn("pgloss_gspo")(*args, "token-mean", actor_config("x"))


def test_register_variant_and_refuse_duplicates():
    fipo = pgloss.get("fipo", delta=8.0)
    key = adapter.register("fipo_delta8_test", fipo)
    assert key == "pgloss_fipo_delta8_test" and key in core_algos.POLICY_LOSS_REGISTRY
    with pytest.raises(ValueError, match="already has a policy loss 'pgloss_fipo_delta8_test'"):
        adapter.register("fipo_delta8_test", fipo)
    with pytest.raises(ValueError, match="already has a policy loss 'pgloss_dapo'"):
        adapter.register("dapo")
    assert adapter.register("fipo_delta8_test", pgloss.get("fipo", delta=9.0), overwrite=True) == key
    with pytest.raises(ValueError, match="unknown algorithm 'nope'"):
        adapter.register("nope")
    with pytest.raises(TypeError, match="algorithm must be a pgloss.Algorithm"):
        adapter.register("bad_variant", "dapo")
    with pytest.raises(TypeError, match="overwrite must be a bool, got 'no'"):
        adapter.register("fipo_delta8_test", fipo, overwrite="no")
    # The variant's δ is used: a large ratio with a positive advantage is capped at δ = 9.
    batch = make_batch()
    batch["old"] = batch["log_prob"] - 3.0
    batch["advantages"] = batch["advantages"].abs()
    fn = core_algos.get_policy_loss_fn(key)
    ours, _ = fn(
        batch["old"],
        batch["log_prob"],
        batch["advantages"],
        batch["mask"],
        "token-mean",
        actor_config(key, clip_ratio_high=0.28),
    )
    plain = pgloss.get("fipo", delta=9.0)(
        log_prob=batch["log_prob"], old_log_prob=batch["old"], advantages=batch["advantages"], mask=batch["mask"]
    )
    torch.testing.assert_close(ours, plain.loss)


def _bare_import(code, **env):
    """Run `code` in a fresh interpreter whose only pgloss import is verl's plugin discovery."""
    return subprocess.Popen(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


LIST = (
    "import verl; from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY as R; "
    "print(sorted(k for k in R if k.startswith('pgloss_')))"
)


def test_entry_point_discovery():
    """A bare `import verl` registers every pgloss_<name>; VERL_USE_EXTERNAL_PLUGINS=none none; and a
    plugin that fails to import says so at ERROR level (verl itself logs it at DEBUG and carries on)."""
    auto = _bare_import(LIST)
    off = _bare_import(LIST, VERL_USE_EXTERNAL_PLUGINS="none")
    # verl 0.10 installed: the adapter's version check fails inside verl's plugin loader.
    broken = _bare_import(
        "import importlib.metadata as m; found = m.version; "
        "m.version = lambda d: '0.10.0' if d == 'verl' else found(d); " + LIST
    )
    out, err = auto.communicate(timeout=240)
    assert auto.returncode == 0, err
    assert eval(out.strip().splitlines()[-1]) == sorted(adapter.registered_name(n) for n in pgloss.names())
    out, err = off.communicate(timeout=240)
    assert off.returncode == 0 and out.strip().splitlines()[-1] == "[]", err
    out, err = broken.communicate(timeout=240)
    assert broken.returncode == 0 and out.strip().splitlines()[-1] == "[]", err
    assert "pgloss could not register its policy losses into verl" in err
    assert "supports verl >=0.9.1,<0.10, found verl 0.10.0" in err
