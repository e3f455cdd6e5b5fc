"""pgloss against OpenRLHF's own actor loss: `PolicyLoss`, `compute_approx_kl` and `aggregate_loss`, value and gradient.

OpenRLHF's `openrlhf.models` imports its Actor (deepspeed, flash-attn), so its loss code is run from its files
(`openrlhf/models/loss.py`: `aggregate_loss`, `PolicyLoss`; `openrlhf/models/utils.py`: `masked_mean`,
`compute_approx_kl`, `KL_IS_WEIGHT_CLIP`), found under `$PGLOSS_OPENRLHF_SRC` or in the installed
distribution (`pgloss.conformance.sources`). They are composed as `PPOActor.training_step` composes them
(`openrlhf/trainer/ray/ppo_actor.py`, 0.11.2):

    actor_loss = PolicyLoss(...)(log π, log π_old, Â, action_mask, rollout_log_probs, **loss_batch_info)
    loss = actor_loss + kl_coef · aggregate_loss(compute_approx_kl(...), action_mask, **loss_batch_info)
                      − entropy_coef · aggregate_loss(H, action_mask, **loss_batch_info)

with one micro-batch on one process (`loss_batch_info`: dp_size 1, the batch's token count and non-empty
sequences, as `get_loss_batch_info` counts them). OpenRLHF's options in pgloss's terms (`algorithm`):

| OpenRLHF | pgloss |
|---|---|
| `policy_loss_type="ppo"`, `token_level_loss` True / False | `ppo` with `loss_agg_mode` token-mean / seq-mean-token-mean |
| `policy_loss_type="gspo"` (sequence aggregation forced) | `gspo` (the sequence ratio exp(mean δ), gradient through the mean) |
| `clip_eps_low`, `clip_eps_high`, `dual_clip` | `clip_low`, `clip_high`, `dual_clip` |
| `algo.kl.use_loss` with `init_coef`, `estimator` k1/k2/k3, `unbiased_gradient` | `kl_coef`, `kl_estimator`, `kl_correction="unbiased_gradient"` (cap 10) |
| `actor.entropy_coef` | `entropy_coef` |
| `is_correction_level="token"`, mode clip / mask, gating ratio, threshold [lo, hi] | `RolloutCorrection(weight_level="token", weight_mode="truncate"/"mask", lower=lo, upper=hi)` |
| `is_correction_level="seq"`, mode mask, gating ratio | a token weight ρ_t with `Rejection("seq_mean_k1", lower=1/hi, upper=1/lo)`, counted on the original masks (`count_rejected=True`): the rejected tokens stay in OpenRLHF's token count |
| `is_correction_level` token / seq, mode mask, gating `binary_kl` / `tv`, threshold [0, δ] | a token weight ρ_t (untruncated) with `Gate("binary_kl"/"tv", level="token"/"seq_mean", lower=0, upper=δ)`, counted on the original masks |
| gspo with `is_correction_level` on | gspo against the rollout policy: `old_log_prob` = the rollout log-probs |
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import torch

from .case import Case, batch, flat_grad, relative
from .sources import load, locate_all

__all__ = ["TRAINER", "available", "cases", "compare"]

TRAINER = "OpenRLHF"
VARIABLE = "PGLOSS_OPENRLHF_SRC"
PIN = "openrlhf==0.11.2"
FILES = ("openrlhf/models/loss.py", "openrlhf/models/utils.py")
TOLERANCE = 1e-9
KL_TOLERANCE = 1e-6
"""Relative: `compute_approx_kl` computes in float32 (`log_probs.float()`), about 1e-7 on these batches."""
_REF = "docs/reference.md, 'Conformance with OpenRLHF'"


def _files() -> tuple[Path, ...] | str:
    return locate_all(
        "openrlhf", FILES, VARIABLE, f"pip install --no-deps {PIN}: pgloss reads its loss files, which need only torch"
    )


def available() -> str | None:
    """None when OpenRLHF's loss files can be found (installed, or under $PGLOSS_OPENRLHF_SRC), else why not."""
    found = _files()
    if isinstance(found, str):
        return found
    try:
        _namespace()
    except Exception as error:
        return f"OpenRLHF's loss code cannot be loaded ({type(error).__name__}: {error})"
    return None


@functools.cache
def _namespace() -> dict:
    """OpenRLHF's loss functions, executed from its files."""
    files = _files()
    if isinstance(files, str):
        raise LookupError(files)
    loss_file, utils_file = files
    namespace = dict(
        torch=torch, nn=torch.nn, F=torch.nn.functional, dist=torch.distributed, Optional=Optional, Tuple=tuple
    )
    load(utils_file, ("KL_IS_WEIGHT_CLIP", "masked_mean", "compute_approx_kl"), namespace)
    return load(loss_file, ("aggregate_loss", "PolicyLoss"), namespace)


_POLICY = (
    "clip_eps_low",
    "clip_eps_high",
    "dual_clip",
    "token_level_loss",
    "policy_loss_type",
    "is_correction_level",
    "is_correction_mode",
    "is_correction_gating",
    "is_correction_threshold",
)


def algorithm(options: dict[str, Any]) -> tuple[Any, bool]:
    """The pgloss algorithm for OpenRLHF's `options` (PolicyLoss's arguments and kl_coef, kl_estimator,
    unbiased_gradient, entropy_coef), and whether its rollout rejection is counted on the original masks."""
    import pgloss
    from pgloss.correction.gating import Gate
    from pgloss.correction.rejection import Rejection
    from pgloss.correction.rollout import RolloutCorrection

    gspo = options.get("policy_loss_type", "ppo") == "gspo"
    level = options.get("is_correction_level", "off")
    fields: dict[str, Any] = dict(
        clip_low=options.get("clip_eps_low", 0.2),
        clip_high=options.get("clip_eps_high", 0.2),
        kl_coef=options.get("kl_coef", 0.0),
        kl_estimator=options.get("kl_estimator", "k1"),
        kl_correction="unbiased_gradient" if options.get("unbiased_gradient") else None,
        entropy_coef=options.get("entropy_coef", 0.0),
    )
    if options.get("dual_clip") is not None:
        fields["dual_clip"] = options["dual_clip"]
    if not gspo:
        fields["loss_agg_mode"] = "token-mean" if options.get("token_level_loss", True) else "seq-mean-token-mean"
    counted = False
    if level != "off" and not gspo:
        gating = options.get("is_correction_gating", "ratio")
        low, high = options.get("is_correction_threshold", (0.5, 5.0))
        mode = options.get("is_correction_mode", "mask")
        if gating != "ratio":  # mask mode (OpenRLHF refuses clip): kept tokens keep their untruncated ρ_t
            gate = Gate(gating, level="token" if level == "token" else "seq_mean", lower=low, upper=high)
            fields["rollout_correction"] = RolloutCorrection(weight_level="token", upper=None, gates=(gate,))
            counted = True
        elif level == "token":
            fields["rollout_correction"] = RolloutCorrection(
                weight_level="token", lower=low, upper=high, weight_mode="truncate" if mode == "clip" else "mask"
            )
        else:  # seq: the token ratio, rows whose geometric-mean ratio leaves [low, high] rejected
            fields["rollout_correction"] = RolloutCorrection(
                weight_level="token", upper=None, rejection=(Rejection("seq_mean_k1", upper=1 / low, lower=1 / high),)
            )
            counted = True
    return pgloss.get("gspo" if gspo else "ppo", **fields), counted


def compare(options: dict[str, Any], *, seed: int = 0, empty_row: bool = False) -> tuple[float, float]:
    """(relative loss error, relative gradient error w.r.t. the log-probs and entropies) of OpenRLHF's actor
    loss with `options` against pgloss's `algorithm(options)`, on one random float64 batch."""
    from pgloss.core.normalizer import Normalizer

    theirs_code = _namespace()
    data = batch(seed, empty_row=empty_row)
    mask = data["mask"].bool()
    advantages = data["advantages"][:, None].expand_as(data["old"]).clone()  # OpenRLHF's are per token
    rollout = data["sampling"] if options.get("is_correction_level", "off") != "off" else None
    ours, counted = algorithm(options)
    losses, grads = [], []
    for side in ("openrlhf", "pgloss"):
        log_prob = data["log_prob"].clone().requires_grad_(True)
        entropy = data["entropy"].clone().requires_grad_(True)
        if side == "openrlhf":
            info = dict(
                dp_size=1,
                batch_num_tokens=mask.sum().to(torch.float32),
                global_batch_size=(mask.sum(-1) > 0).sum().to(torch.float32),
            )
            policy = theirs_code["PolicyLoss"](**{k: options[k] for k in _POLICY if k in options})
            loss = policy(log_prob, data["old"], advantages, action_mask=mask, rollout_log_probs=rollout, **info)[0]
            if options.get("kl_coef", 0.0):
                kl = theirs_code["compute_approx_kl"](
                    log_prob,
                    data["ref"],
                    log_probs_old=data["old"],
                    kl_estimator=options.get("kl_estimator", "k1"),
                    unbiased_gradient=options.get("unbiased_gradient", False),
                )
                loss = loss + theirs_code["aggregate_loss"](kl, mask, **info) * options["kl_coef"]
            if options.get("entropy_coef"):
                loss = loss - theirs_code["aggregate_loss"](entropy, mask, **info) * options["entropy_coef"]
        else:
            old = rollout if rollout is not None and ours.ratio_level == "sequence" else data["old"]
            normalizer = None
            if counted:
                normalizer = ours.rollout_correction.normalizer(mask, data["old"], rollout, count_rejected=True)
            elif ours.entropy_coef:
                normalizer = Normalizer.count(mask)
            loss = ours(
                log_prob,
                old,
                advantages,
                mask,
                ref_log_prob=data["ref"],
                entropy=entropy,
                rollout_log_prob=rollout,
                normalizer=normalizer,
            ).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(torch.cat([flat_grad(log_prob), flat_grad(entropy)]))
    return relative(losses[1], losses[0]), relative(grads[1], grads[0])


_IS = [
    dict(is_correction_level=level, is_correction_mode=mode, is_correction_threshold=band)
    for level, mode in (("token", "clip"), ("token", "mask"), ("seq", "mask"))
    for band in ((0.5, 5.0), (0.8, 1.25))
]
_GATES = [
    dict(is_correction_level=level, is_correction_gating=gating, is_correction_threshold=(0.0, delta))
    for level, gating, delta in (
        ("token", "binary_kl", 0.02),
        ("token", "tv", 0.08),
        ("seq", "binary_kl", 0.04),
        ("seq", "tv", 0.1),
    )
]
"""Bounds that keep about half the tokens (rows) of the random batches."""

_AGREE: list[dict[str, Any]] = [
    dict(),
    dict(token_level_loss=False),
    dict(clip_eps_low=0.2, clip_eps_high=0.28),
    dict(dual_clip=3.0),
    dict(dual_clip=3.0, token_level_loss=False),
    dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4),
    dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, is_correction_level="token"),
    *[dict(o) for o in _IS],
    dict(_IS[0], token_level_loss=False),
    dict(_IS[4], token_level_loss=False),
    dict(entropy_coef=0.01),
    *[dict(o) for o in _GATES],
    dict(_GATES[2], token_level_loss=False),
]
_KL: list[dict[str, Any]] = [
    dict(kl_coef=0.01, kl_estimator=kind, unbiased_gradient=unbiased)
    for kind in ("k1", "k2", "k3")
    for unbiased in (False, True)
]

_DOCUMENTED: list[tuple[dict[str, Any], str]] = [
    (
        dict(kl_coef=0.01, kl_estimator="k3", token_level_loss=False),
        f"OpenRLHF's KL term is a token mean beside the policy's sequence mean; pgloss aggregates every term one way "
        f"({_REF})",
    ),
    (
        dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, kl_coef=0.01, kl_estimator="k3"),
        f"the KL term: a token mean beside GSPO's sequence mean in OpenRLHF ({_REF})",
    ),
    (
        dict(policy_loss_type="gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, entropy_coef=0.01),
        f"the entropy bonus: a token mean beside GSPO's sequence mean in OpenRLHF; one aggregation in pgloss ({_REF})",
    ),
]


def cases() -> Iterator[Case]:
    """PPO (token and sequence aggregation, clip-higher, dual clip), GSPO, the ratio-, binary-KL- and TV-gated
    IS corrections,
    the entropy bonus, and each KL estimator with and without the unbiased gradient, each on a random batch."""

    def one(options: dict[str, Any], seed: int, reason: str | None, tolerance: float) -> Case:
        setting = ", ".join(f"{k}={v!r}" for k, v in options.items() if k != "policy_loss_type") or "defaults"
        try:
            loss_error, grad_error = compare(options, seed=seed)
        except Exception as error:
            loss_error = grad_error = math.inf
            setting += f" [{type(error).__name__}: {error}]"
            reason = None
        kind = options.get("policy_loss_type", "ppo")
        function = "PolicyLoss" + (" + compute_approx_kl" if options.get("kl_coef") else "")
        return Case(
            trainer=TRAINER,
            function=function,
            algorithm=kind,
            setting=setting,
            loss_error=loss_error,
            grad_error=grad_error,
            tolerance=tolerance,
            reason=reason,
        )

    for seed, options in enumerate(_AGREE):
        yield one(options, seed, None, TOLERANCE)
    for seed, options in enumerate(_KL):
        yield one(options, 100 + seed, None, KL_TOLERANCE)
    for seed, (options, reason) in enumerate(_DOCUMENTED):
        yield one(options, 200 + seed, reason, KL_TOLERANCE)
