"""REC, OPMD and sPPO against Trinity-RFT's own loss functions, GVPO against verl-recipe's.

The trainers' source is read from a directory an environment variable names; without it these tests
skip. Neither package is installed here:

- PGLOSS_TRINITY_SRC: the root of an unpacked Trinity-RFT 0.6.0 wheel (the directory holding
  `trinity/`). `trinity.algorithm`'s package import pulls the whole trainer (Ray, vLLM, verl), so
  the four light files the losses need are loaded by path under stub packages: algorithm/key_mapper.py,
  algorithm/utils.py, policy_loss_fn/policy_loss_fn.py (the real `PolicyLossFn` base class with its
  key mapping), then rec_policy_loss.py, opmd_policy_loss.py and sppo_loss_fn.py.
- PGLOSS_VERL_RECIPE_SRC: a checkout of verl-recipe (the directory holding `gvpo/`). Its
  gvpo_core_algos.py imports verl modules this verl (0.9.1) lacks, so only the function
  `compute_policy_loss_gvpo` is taken from the file (by `ast`) and executed with verl's own
  `allgather_dict_tensors` in a one-process gloo group (a `device_mesh` stub whose flattened group is
  the world).

Measured (PGLOSS_TRINITY_SRC=Trinity-RFT 0.6.0 wheel, PGLOSS_VERL_RECIPE_SRC=verl-recipe 48ea0a7; 6 seeds,
B = 8, T = 7; value and gradient w.r.t. log π, max |Δ| absolute / relative to the largest value):
- REC, keep rules one-side / two-side / ring / none x weights none / importance_sampling / advantage:
  float64 8.9e-16 / 5.7e-16, float32 4.8e-7 / 2.6e-7;
- OPMD, τ = 0, 1, 3, token-mean and seq-mean-token-mean: float64 1.1e-16 / 7.5e-16, float32 3.0e-8 / 3.2e-7;
- sPPO, ε = 0.1, 0.3: float64 1.4e-17 / 1.3e-16, float32 3.7e-9 / 5.2e-8;
- GVPO, β = 0.1, 1, group-centred advantages, verl-recipe's value divided by its number of groups (it
  sums L_g over the micro-batch, pgloss takes the mean): float64 4.4e-16 / 9.0e-16, float32 7.2e-7 / 3.8e-7.
`pytest -s` prints the figures of a run (test_report_measured); asserted: relative 1e-13 (float64),
1e-6 (float32).
"""

from __future__ import annotations

import ast
import os
import tempfile
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import make_batch
from trinity_losses import policy_loss_modules

import pgloss

TRINITY = os.environ.get("PGLOSS_TRINITY_SRC")
RECIPE = os.environ.get("PGLOSS_VERL_RECIPE_SRC")
needs_trinity = pytest.mark.skipif(not TRINITY, reason="PGLOSS_TRINITY_SRC (an unpacked Trinity-RFT 0.6.0) is not set")
needs_recipe = pytest.mark.skipif(not RECIPE, reason="PGLOSS_VERL_RECIPE_SRC (a verl-recipe checkout) is not set")


@pytest.fixture(scope="module")
def trinity():
    """Trinity's loss classes, loaded by path under stub packages that are removed afterwards."""
    with policy_loss_modules(TRINITY, "rec_policy_loss", "opmd_policy_loss", "sppo_loss_fn") as modules:
        yield dict(
            rec=modules["rec_policy_loss"].RECPolicyLossFn,
            opmd=modules["opmd_policy_loss"].OPMDPolicyLossFn,
            sppo=modules["sppo_loss_fn"].sPPOPolicyLossFn,
        )


DTYPES = [torch.float32, torch.float64]
MEASURED: dict[str, float] = {}
"""family and dtype -> the largest relative (and, "abs", absolute) |Δ| of this run, value or gradient."""


def trainer_batch(seed, dtype, spread=0.6):
    return make_batch(batch=8, length=7, seed=seed, spread=spread, dtype=dtype, per_token_adv=True)


def trinity_call(fn, data, lp):
    """Trinity's action_mask is bool: its masked_mean's `+ 1e-8` then adds to an integer count and is lost
    in float32 (with a float64 mask it would make a relative difference of 1e-8 / tokens, 2.5e-10 here)."""
    mask = data["mask"]
    loss, _ = fn(logprob=lp, old_logprob=data["old_log_prob"], action_mask=mask, advantages=data["advantages"] * mask)
    return loss


def compare(family, ours_fn, theirs_fn, data):
    """Loss and gradient w.r.t. log π of both on the same inputs (float32 as the trainers run, or float64):
    the largest |Δ| relative to the largest value compared, asserted under 1e-6 (float32) or 1e-13 (float64)."""
    x = data["log_prob"].clone().requires_grad_()
    y = data["log_prob"].clone().requires_grad_()
    ours, theirs = ours_fn(x), theirs_fn(y)
    ours.backward()
    theirs.backward()
    grads = (x.grad - y.grad)[data["mask"]]
    scale = max(theirs.abs().item(), y.grad.abs().max().item())
    diff = max((ours - theirs).abs().item(), grads.abs().max().item()) / scale
    assert diff <= (1e-6 if x.dtype == torch.float32 else 1e-13), diff
    assert scale > 1e-4  # a case that exercises the loss
    key = f"{family} {x.dtype}"
    absolute = max((ours - theirs).abs().item(), grads.abs().max().item())
    MEASURED[key] = max(MEASURED.get(key, 0.0), diff)
    MEASURED[key + " abs"] = max(MEASURED.get(key + " abs", 0.0), absolute)
    return diff


@needs_trinity
@pytest.mark.parametrize("mode", ["one-side", "two-side", "ring", "none"])
@pytest.mark.parametrize("weight", ["none", "importance_sampling", "advantage"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rec_matches_trinity(trinity, mode, weight, seed, dtype):
    data = trainer_batch(seed, dtype, spread=0.9)
    fn = trinity["rec"](
        epsilon_low=0.2,
        epsilon_high=0.2,
        epsilon_low_prime=0.6,
        epsilon_high_prime=2.0,
        clip_mode=mode,
        weight=weight,
        temp=0.8,
    )
    alg = pgloss.get(
        "rec_ring" if mode == "ring" else "rec_oneside", rec_clip_mode=mode, rec_weight=weight, rec_temp=0.8
    )
    compare(
        "rec",
        lambda x: alg(x, data["old_log_prob"], data["advantages"], data["mask"]).loss,
        lambda y: trinity_call(fn, data, y),
        data,
    )


@needs_trinity
@pytest.mark.parametrize("tau", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_opmd_matches_trinity(trinity, tau, mode, seed, dtype):
    data = trainer_batch(seed, dtype)
    data["mask"][3, 0] = True  # Trinity's seq-mean counts empty rows; pgloss counts non-empty ones
    fn = trinity["opmd"](tau=tau, loss_agg_mode=mode)
    alg = pgloss.get("opmd", opmd_tau=tau, loss_agg_mode=mode)
    compare(
        "opmd",
        lambda x: alg(x, data["old_log_prob"], data["advantages"], data["mask"]).loss,
        lambda y: trinity_call(fn, data, y),
        data,
    )


@needs_trinity
@pytest.mark.parametrize("epsilon", [0.1, 0.3])
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", DTYPES)
def test_sppo_matches_trinity(trinity, epsilon, seed, dtype):
    data = trainer_batch(seed, dtype, spread=0.3)
    fn = trinity["sppo"](epsilon=epsilon)
    alg = pgloss.get("sppo", sppo_epsilon=epsilon)
    compare(
        "sppo",
        lambda x: alg(x, data["old_log_prob"], data["advantages"], data["mask"]).loss,
        lambda y: trinity_call(fn, data, y),
        data,
    )


@pytest.fixture(scope="module")
def verl_recipe_gvpo():
    """verl-recipe's `compute_policy_loss_gvpo`, executed from its source in a one-process gloo group."""
    from verl.utils.torch_functional import allgather_dict_tensors

    source = (Path(RECIPE) / "gvpo" / "gvpo_core_algos.py").read_text()
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compute_policy_loss_gvpo")
    namespace = {"torch": torch, "allgather_dict_tensors": allgather_dict_tensors}
    exec(compile(ast.Module(body=[node], type_ignores=[]), "gvpo_core_algos.py", "exec"), namespace)
    store = tempfile.NamedTemporaryFile(delete=False)
    dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
    try:
        mesh = types.SimpleNamespace(_flatten=lambda: types.SimpleNamespace(get_group=lambda: dist.group.WORLD))
        yield lambda **kw: namespace["compute_policy_loss_gvpo"](device_mesh=mesh, **kw)
    finally:
        dist.destroy_process_group()
        Path(store.name).unlink(missing_ok=True)  # the file store removes its file itself


@needs_recipe
@pytest.mark.parametrize("beta", [0.1, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_gvpo_matches_verl_recipe(verl_recipe_gvpo, beta, dtype, seed):
    """verl-recipe sums L_g over the micro-batch's groups; pgloss takes the mean over the step's groups."""
    data = make_batch(batch=8, length=7, seed=seed, spread=0.5, dtype=dtype, per_token_adv=False)
    data["mask"][3, 0] = True  # verl-recipe divides by each row's length: no empty row
    groups = 2
    ids = torch.arange(8) // 4
    adv = data["advantages"].to(dtype)
    for g in range(groups):  # GRPO without the std division: group-centred
        adv[ids == g] -= adv[ids == g].mean()
    mask = data["mask"]
    alg = pgloss.get("gvpo", gvpo_beta=beta)
    tokens = (adv[:, None] * mask).to(dtype)
    compare(
        "gvpo",
        lambda x: alg(x, data["old_log_prob"], adv, mask, group_ids=ids).loss,
        lambda y: (
            verl_recipe_gvpo(
                old_log_prob=data["old_log_prob"],
                log_prob=y,
                advantages=tokens,
                response_mask=mask.to(dtype),
                beta=beta,
                uid=ids.to(dtype),
                n=4,
            )
            / groups
        ),
        data,
    )


def test_report_measured():
    """Prints the figures of this run (`pytest -s`); the module docstring holds them."""
    for key, value in sorted(MEASURED.items()):
        print(f"parity {key}: max |Δ| {value:.1e}")
