"""pgloss's losses in verl's policy-loss registry, as `pgloss_<name>`.

Importing this module registers `pgloss_<name>` for every `pgloss.names()`. The entry point
`pgloss` of group `verl.plugins` makes a bare `import verl` do it (verl >= 0.9.1, < 0.10), so

    actor_rollout_ref.actor.policy_loss.loss_mode=pgloss_dapo actor_rollout_ref.actor.clip_ratio_high=0.28

is all a verl command line needs. `register(name, algorithm)` adds a configured variant that
verl's config has no field for (FIPO's δ, say).

verl calls a policy loss once per micro-batch with the step's global counts in
`config.global_batch_info` (filled by `verl.workers.utils.losses.ppo_loss`); each call maps

    global_batch_info {dp_size, batch_num_tokens, global_batch_size}
        -> Normalizer(tokens=batch_num_tokens, sequences=global_batch_size, world_size=dp_size)
    loss_agg_mode (verl's)       -> loss_agg_mode   (`token-sum` is refused: pgloss has no such mode)
    loss_scale_factor            -> norm_constant   (required by seq-mean-token-sum-norm)
    clip_ratio_low / _high       -> clip_low / clip_high   (None: clip_ratio)
    clip_ratio_c                 -> dual_clip       (only where the algorithm has a dual clip)
    tau_pos / tau_neg            -> tau_pos / tau_neg
    rollout_is_weights w         -> loss = aggregate(w · ℓ)   (ℓ: the algorithm's per-token term)

and returns `(loss, {"actor/<metric>": value})`. A loss that needs per-call inputs verl does not
pass (TOPR's raw scores, REAL's group ids) is a clear error at its first call. KL and entropy stay verl's: `ppo_loss` adds
them after the policy term, so the algorithm runs with `kl_coef = entropy_coef = 0`. verl's
`global_batch_size` counts rows, empty ones included (pgloss's own count skips empty rows).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import torch
from torch import Tensor

import pgloss
from pgloss.aggregate import Normalizer, aggregate
from pgloss.algorithms import Algorithm

__all__ = ["PREFIX", "SUPPORTED", "policy_loss_fn", "register", "registered_name"]

PREFIX = "pgloss_"
SUPPORTED = (">=0.9.1", "<0.10")
"""The verl releases this adapter is tested against."""

_log = logging.getLogger(__name__)


def _check_version() -> None:
    from packaging.specifiers import SpecifierSet

    found = version("verl")
    if found not in SpecifierSet(",".join(SUPPORTED)):
        raise ImportError(f"pgloss.integrations.verl supports verl {','.join(SUPPORTED)}, found verl {found}")


def registered_name(name: str) -> str:
    """The loss_mode under which `name` is registered: `pgloss_<name>`."""
    return PREFIX + name


def _field(config: Any, key: str, default: Any = None) -> Any:
    return config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)


def _algorithm(name: str, base: Algorithm | None, loss_agg_mode: str, config: Any) -> Algorithm:
    """The algorithm with verl's config values for the fields verl has; `base` (or the paper's
    defaults for `name`) supplies the rest."""
    family = type(base if base is not None else pgloss.get(name, norm_constant=1.0))
    missing = getattr(family, "required_inputs", ())
    if missing:
        raise ValueError(f"{registered_name(name)} needs {', '.join(missing)} in each call, which verl does not pass "
                         "to a policy loss")
    if loss_agg_mode == "token-sum":
        raise ValueError(f"{registered_name(name)}: loss_agg_mode 'token-sum' has no pgloss equivalent; "
                         f"use one of {pgloss.AGG_MODES[:4]}")
    values: dict[str, Any] = dict(loss_agg_mode=loss_agg_mode, kl_coef=0.0, entropy_coef=0.0)
    if config is not None:
        scale = _field(config, "loss_scale_factor")
        if scale is not None:
            values["norm_constant"] = float(scale)
        clip = _field(config, "clip_ratio", 0.2)
        low, high = _field(config, "clip_ratio_low"), _field(config, "clip_ratio_high")
        values["clip_low"] = float(clip if low is None else low)
        values["clip_high"] = float(clip if high is None else high)
        values["dual_clip"] = _field(config, "clip_ratio_c")
        values["tau_pos"], values["tau_neg"] = _field(config, "tau_pos"), _field(config, "tau_neg")
    if loss_agg_mode == "seq-mean-token-sum-norm" and values.get("norm_constant") is None:
        raise ValueError(f"{registered_name(name)}: loss_agg_mode 'seq-mean-token-sum-norm' needs "
                         "actor.loss_scale_factor (the generation budget, e.g. data.max_response_length); "
                         "pgloss never divides by the padded width")
    if base is None:
        base = pgloss.get(name, norm_constant=values.get("norm_constant", 1.0))
    fields = {f.name for f in dataclasses.fields(base)}
    if getattr(base, "dual_clip", None) is None:  # verl always sets clip_ratio_c; it applies to dual-clip losses only
        values.pop("dual_clip", None)
    return dataclasses.replace(base, **{k: v for k, v in values.items() if k in fields and v is not None})


def _count(value: Any, device: torch.device) -> Tensor | None:
    return None if value is None else torch.as_tensor(value, dtype=torch.float64, device=device)


def _normalizer(mask: Tensor, mode: str, info: dict[str, Any]) -> Normalizer | None:
    """verl's global counts as a Normalizer; None (counted from this call) when verl gave none."""
    world = int(info.get("dp_size") or 1)
    tokens = _count(info.get("batch_num_tokens"), mask.device)
    sequences = _count(info.get("global_batch_size"), mask.device)
    if tokens is None and sequences is None and world == 1:
        return None  # one micro-batch is the step (verl's legacy actor leaves the info empty)
    needed = tokens if mode == "token-mean" else sequences
    if needed is None:
        what = "batch_num_tokens" if mode == "token-mean" else "global_batch_size"
        raise ValueError(f"loss_agg_mode {mode!r} with dp_size={world} needs global_batch_info[{what!r}]")
    local = Normalizer.count(mask, reduce=False)
    return Normalizer(tokens=local.tokens if tokens is None else tokens,
                      sequences=local.sequences if sequences is None else sequences, world_size=world)


def policy_loss_fn(name: str, algorithm: Algorithm | None = None) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    """A verl `PolicyLossFn` computing `algorithm` (default: `pgloss.get(name)`) with verl's config."""

    def fn(old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor,
           loss_agg_mode: str = "token-mean", config: Any = None,
           rollout_is_weights: Tensor | None = None) -> tuple[Tensor, dict[str, Any]]:
        alg = _algorithm(name, algorithm, loss_agg_mode, config)
        info = dict(_field(config, "global_batch_info", None) or {}) if config is not None else {}
        normalizer = _normalizer(response_mask, loss_agg_mode, info)
        dtype = torch.promote_types(log_prob.dtype, torch.float32)
        out = alg(log_prob=log_prob.to(dtype), old_log_prob=old_log_prob.to(dtype), advantages=advantages,
                  mask=response_mask, normalizer=normalizer)
        loss = out.loss
        if rollout_is_weights is not None:
            weighted = out.per_token * rollout_is_weights.detach().to(out.per_token.dtype)
            loss = aggregate(weighted, response_mask.bool(), alg.loss_agg_mode, normalizer=normalizer,
                             norm_constant=alg.norm_constant)
        metrics = {f"actor/{key}": value for key, value in out.metrics.items() if key != "pg_loss"}
        return loss, metrics

    fn.__name__ = fn.__qualname__ = f"pgloss_{name}_policy_loss"
    fn.__doc__ = f"pgloss's {name!r} as a verl policy loss (pgloss.integrations.verl)."
    return fn


def register(name: str, algorithm: Algorithm | None = None, *, overwrite: bool = False) -> str:
    """Register `algorithm` (default: pgloss's `name`) as verl loss_mode `pgloss_<name>`; returns it.

    Refuses a name already in verl's registry unless `overwrite` (verl's own decorator replaces
    silently). Without `algorithm`, `name` must be one of `pgloss.names()`.
    """
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier, got {name!r}")
    if algorithm is None:
        if name not in pgloss.names():
            raise ValueError(f"unknown algorithm {name!r}; pass algorithm= or one of: {', '.join(pgloss.names())}")
    elif not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be a pgloss.Algorithm, got {type(algorithm).__name__}")
    key = registered_name(name)
    if key in POLICY_LOSS_REGISTRY and not overwrite:
        raise ValueError(f"verl already has a policy loss {key!r}; pass overwrite=True to replace it")
    POLICY_LOSS_REGISTRY[key] = policy_loss_fn(name, algorithm)
    return key


def _register_all() -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    _check_version()
    for name in pgloss.names():
        if registered_name(name) not in POLICY_LOSS_REGISTRY:  # a second import is harmless
            register(name)


try:
    _register_all()
except Exception:
    # verl's plugin loader logs entry-point failures at DEBUG and carries on; say it loudly.
    _log.error("pgloss could not register its policy losses into verl", exc_info=True)
    raise
