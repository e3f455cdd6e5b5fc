"""pgloss's losses in verl's policy-loss registry, as `pgloss_<name>`.

Importing this module registers `pgloss_<name>` for every `pgloss.names()`. The entry point
`pgloss` of group `verl.plugins` makes a bare `import verl` do it (verl >= 0.9.1, < 0.10), so

    actor_rollout_ref.actor.policy_loss.loss_mode=pgloss_dapo actor_rollout_ref.actor.clip_ratio_high=0.28

is all a verl command line needs. `register(name, algorithm)` adds a configured variant that
verl's config has no field for (FIPO's δ, say).

verl calls a policy loss once per micro-batch with the step's global counts in
`config.global_batch_info` (filled by `verl.workers.utils.losses.ppo_loss`). The algorithm is built from
verl's config with `pgloss.trainer_options.verl.algorithm_from_verl` (the translation `pgloss.from_verl`
uses: every `policy_loss` field, the clip ratios, `clip_ratio_c`, `tau_*`, `loss_agg_mode`,
`loss_scale_factor`; see that module), once per configuration, and each call runs through a `pgloss.Step`
whose counts are verl's:

    global_batch_info {dp_size, batch_num_tokens, global_batch_size}
        -> Normalizer(tokens=batch_num_tokens, sequences=global_batch_size, world_size=dp_size)
    rollout_is_weights w         -> the call's rollout_is_weight: w · ℓ before the aggregation
                                    (ℓ: the algorithm's per-token policy term, its only term here)

and returns `(loss, {"actor/<metric>": value})`: the call's metrics except its loss terms (`Stat.reduce ==
"loss"`: `pg_loss`, which verl records itself). verl reduces them over its micro-batches and dp ranks with its own
`Metric(MEAN)`, an unweighted mean of the calls' values (a policy loss function sees neither the step's
other calls nor their number, so no per-call value can make that mean token-weighted; `pgloss.StepMetrics`
gives a step's metrics in a loop that sees its calls). A loss that needs per-call inputs verl does not
pass (`Algorithm.needs`: TOPR's raw scores, REAL's group ids) is a clear error at its first call.
KL and entropy stay verl's: `ppo_loss` adds them after the policy term, so the algorithm runs with
`kl_coef = entropy_coef = 0`. verl's `global_batch_size` counts rows, empty ones included
(pgloss's own count skips empty rows).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping
from importlib.metadata import version
from typing import Any

import torch
from torch import Tensor

import pgloss

from ..algorithms import Algorithm
from ..core.aggregate import aggregate, aggregation
from ..core.inputs import OPTIONAL_INPUTS
from ..core.metrics import LOSS
from ..core.normalizer import Normalizer
from ..step import Step
from ..trainer_options.verl import PREFIX, VARIANTS, algorithm_from_verl, config_get, configuration

__all__ = ["PREFIX", "SUPPORTED", "agg_loss", "policy_loss_fn", "register", "registered_name"]

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


_NOT_PASSED = frozenset(OPTIONAL_INPUTS)
"""The optional inputs a loss cannot need in a verl call: verl passes none of them (its KL and entropy terms
are its own), except its `rollout_is_weights` as the call's `rollout_is_weight`, which no loss needs."""


def _algorithm(name: str, base: Algorithm | None, loss_agg_mode: str, config: Any) -> Algorithm:
    """The algorithm with verl's config values for the fields verl has (`algorithm_from_verl`);
    `base` (or pgloss's `name`) supplies the rest."""
    alg = algorithm_from_verl(
        config, name=None if base is not None else name, algorithm=base, loss_agg_mode=loss_agg_mode, policy_only=True
    )
    missing = sorted(alg.needs & _NOT_PASSED)
    if missing:
        raise ValueError(
            f"{registered_name(name)} needs {', '.join(missing)} in each call, which verl does not pass "
            "to a policy loss"
        )
    return alg


def _count(value: Any, device: torch.device) -> Tensor | None:
    return None if value is None else torch.as_tensor(value, dtype=torch.float64, device=device)


GLOBAL_COUNTS = {"tokens": "batch_num_tokens", "sequences": "global_batch_size"}
"""The `Normalizer` counts verl's `global_batch_info` carries -> its key there."""


def _normalizer(mask: Tensor, mode: str, info: Mapping[str, Any], local: Callable[[], Normalizer]) -> Normalizer | None:
    """verl's global counts as a Normalizer: the one place `global_batch_info` is read. None when verl gave
    none (the call is the step, counted on itself).

    As verl's `agg_loss`: a count verl did not give is this call's own (`local()`), which with dp_size > 1 is
    refused for the mode that divides by it (the count its `Aggregation` reads: token-mean's
    batch_num_tokens, the seq-mean modes' global_batch_size; token-sum reads none). A mode that reads a
    count verl does not carry (the group and length counts) is refused."""
    world = int(info.get("dp_size") or 1)
    tokens = _count(info.get("batch_num_tokens"), mask.device)
    sequences = _count(info.get("global_batch_size"), mask.device)
    if tokens is None and sequences is None and world == 1:
        return None  # one micro-batch is the step (verl's legacy actor leaves the info empty)
    count = aggregation(mode).count
    if count is not None and count not in GLOBAL_COUNTS:
        raise ValueError(
            f"loss_agg_mode {mode!r} divides by the step's {count}, which verl's global_batch_info does "
            f"not carry (it holds {', '.join(GLOBAL_COUNTS.values())})"
        )
    key = None if count is None else GLOBAL_COUNTS.get(count)
    if key is not None and info.get(key) is None and world > 1:
        raise ValueError(f"loss_agg_mode {mode!r} with dp_size={world} needs global_batch_info[{key!r}]")
    if tokens is None or sequences is None:
        own = local()
        tokens = own.tokens if tokens is None else tokens
        sequences = own.sequences if sequences is None else sequences
    return Normalizer(tokens=tokens, sequences=sequences, world_size=world)


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: Any = None,
    global_batch_size: Any = None,
    loss_scale_factor: Any = None,
) -> Tensor:
    """verl's `core_algos.agg_loss` signature over `pgloss.core.aggregate`: the same counts
    (`global_batch_info`) as a `Normalizer`, `loss_scale_factor` as `norm_constant` (required by
    seq-mean-token-sum-norm: pgloss never divides by the padded width)."""
    info = dict(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    mask = loss_mask.bool()
    norm_constant = None if loss_scale_factor is None else float(loss_scale_factor)
    # no algorithm here (verl aggregates its KL, entropy and value terms with it): the mask's own counts
    normalizer = _normalizer(mask, loss_agg_mode, info, lambda: Normalizer.count(mask, reduce=False))
    return aggregate(loss_mat, mask, loss_agg_mode, normalizer=normalizer, norm_constant=norm_constant)


def _step(algorithm: Algorithm, call: dict[str, Any], info: Mapping[str, Any]) -> Step:
    """The `pgloss.Step` one call of verl's belongs to: verl's global counts (`global_batch_info`, `_normalizer`)
    as its Normalizer, a count verl left out taken from this call; none given, this call is the step."""

    normalizer = _normalizer(
        call["mask"], algorithm.loss_agg_mode, info, lambda: Step(algorithm, [call], reduce=False).normalizer
    )
    return Step(algorithm, [call], reduce=False) if normalizer is None else Step(algorithm, normalizer=normalizer)


def policy_loss_fn(name: str, algorithm: Algorithm | None = None) -> Callable[..., tuple[Tensor, dict[str, Any]]]:
    """A verl `PolicyLossFn` computing `algorithm` (default: `pgloss.get(name)`) with verl's config.

    The algorithm is built once per configuration: under what `algorithm_from_verl` reads of the config
    (`pgloss.trainer_options.verl.configuration`) and the call's loss_agg_mode, not at every micro-batch."""
    built: dict[Hashable, Algorithm] = {}

    def configured(loss_agg_mode: str, config: Any) -> Algorithm:
        key = configuration(config)
        if key is None:  # a value that cannot be a key: build it for this call
            return _algorithm(name, algorithm, loss_agg_mode, config)
        key = (loss_agg_mode, key)
        if key not in built:
            if len(built) >= _CONFIGURATIONS:
                built.clear()
            built[key] = _algorithm(name, algorithm, loss_agg_mode, config)
        return built[key]

    def fn(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        alg = configured(loss_agg_mode, config)
        info = dict(config_get(config, "global_batch_info", None) or {}) if config is not None else {}
        dtype = torch.promote_types(log_prob.dtype, torch.float32)
        # verl's own rollout correction weighs the policy term before its aggregation: an input of the call
        call = dict(
            log_prob=log_prob.to(dtype),
            old_log_prob=old_log_prob.to(dtype),
            advantages=advantages,
            mask=response_mask,
            rollout_is_weight=rollout_is_weights,
        )
        out = _step(alg, call, info)(**call)
        # The call's metrics; verl reduces them over its micro-batches and dp ranks itself. Loss terms (pg_loss)
        # are not returned: verl records the policy loss as actor/pg_loss, summed over micro-batches.
        metrics = {f"actor/{key}": stat.value for key, stat in out.stats.items() if stat.reduce != LOSS}
        return out.loss, metrics

    fn.__name__ = fn.__qualname__ = f"pgloss_{name}_policy_loss"
    fn.__doc__ = f"pgloss's {name!r} as a verl policy loss (pgloss.integrations.verl)."
    return fn


_CONFIGURATIONS = 64
"""The most configurations a policy loss keeps an algorithm for (a run has one or a few)."""


def register(name: str, algorithm: Algorithm | None = None, *, overwrite: bool = False) -> str:
    """Register `algorithm` (default: pgloss's `name`) as verl loss_mode `pgloss_<name>`; returns it.

    Refuses a name already in verl's registry unless `overwrite` (verl's own decorator replaces
    silently). Without `algorithm`, `name` must be one of `pgloss.names()`.
    """
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier, got {name!r}")
    if not isinstance(overwrite, bool):
        raise TypeError(f"overwrite must be a bool, got {overwrite!r}")
    if algorithm is None:
        if name not in pgloss.names():
            raise ValueError(f"unknown algorithm {name!r}; pass algorithm= or one of: {', '.join(pgloss.names())}")
    elif not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be a pgloss.Algorithm, got {type(algorithm).__name__}")
    key = registered_name(name)
    if key in POLICY_LOSS_REGISTRY and not overwrite:
        raise ValueError(f"verl already has a policy loss {key!r}; pass overwrite=True to replace it")
    POLICY_LOSS_REGISTRY[key] = policy_loss_fn(name, algorithm)
    if algorithm is not None:
        VARIANTS[name] = algorithm  # so that pgloss.from_verl reads loss_mode=pgloss_<name> too
    else:
        VARIANTS.pop(name, None)
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
