"""What `PGLossGRPOTrainer(args=config, algorithm=...)` trains with: the caller's name or Algorithm read against
TRL's `GRPOConfig` (its loss options translated or refused, its `beta` kept unless asked for, its vLLM importance
sampling as the rollout correction), and whether TRL can build the reference model the KL term needs.
`trl.py` beside it translates a config alone (`pgloss.from_trl`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ..algorithms import NAMED, Algorithm, configured, get
from .trl import (
    _LOSS_OPTIONS,
    _ROLLOUT_OPTIONS,
    _build,
    _is_set,
    _kl_fields,
    _loss_fields,
    _show,
    _unexpressible,
    from_trl,
    rollout_correction,
)

__all__ = ["reference_model_refusal", "trainer_algorithm"]

_log = logging.getLogger("pgloss.trainer_options.trl")  # the logger the trainer's messages have always used


def trainer_algorithm(config: Any, algorithm: str | Algorithm | None) -> Algorithm:
    """The algorithm `PGLossGRPOTrainer(args=config, algorithm=...)` runs.

    - None: `from_trl(config, entropy_mask_applied=True, entropy_controlled=True)`, the loss the config
      asks for (with `use_adaptive_entropy` the trainer drives `adaptive_entropy(config)`).
    - a name: that algorithm with its own defaults, and TRL's loss options the caller set (away from
      GRPOConfig's defaults) translated onto it: `epsilon`, `epsilon_high`, `delta`,
      `importance_sampling_level`, `sapo_temperature_*`, `vespo_*`, `beta` (with
      `use_bias_correction_kl`), `entropy_coef`; `loss_type` set to another name is refused. The KL term is
      TRL's `beta` even at its default (0, TRL 1.16's): `algorithm="grpo"` has no KL term and TRL loads no
      reference model unless `beta` is set (or `pgloss.get("grpo")`, with the paper's kl_coef=0.04, is passed).
    - an Algorithm: as given; a TRL loss option set to a value the algorithm does not have is refused.

    Then TRL's vLLM importance sampling and off-policy mask become the algorithm's rollout correction
    (`rollout_correction`) when it has none. An algorithm that carries its own keeps it: refused when
    TRL's options were also set (two corrections), used with a warning when TRL's are its defaults.
    """
    if algorithm is None:
        return from_trl(config, entropy_mask_applied=True, entropy_controlled=True)
    problems = _unexpressible(config, entropy_controlled=True)
    if isinstance(algorithm, str):
        if algorithm not in NAMED:
            get(algorithm)  # the registry's own error, listing the names
        if _is_set(config, "loss_type") and config.loss_type != algorithm:
            problems.append(
                f"loss_type={config.loss_type!r} with algorithm={algorithm!r} (the loss is the algorithm's): "
                f"pass algorithm={config.loss_type!r}, or algorithm=None to take it from loss_type, or leave "
                "loss_type at its default"
            )
        fields, unused = _loss_fields(config, NAMED[algorithm][0], only_set=True)
        problems += [
            f"{_show(config, [option])} (pgloss's {algorithm} has no field of that meaning: leave it at its "
            "default, or pass algorithm=None to take the loss from loss_type)"
            for option in unused
        ]
        if _is_set(config, "beta"):
            fields |= _kl_fields(config)
        elif configured(algorithm).get("kl_coef"):  # TRL's beta (0) is kept: no reference model unasked
            fields |= _kl_fields(config)
            _log.info(
                "%s: TRL's beta=%s is kept (kl_coef=0, no reference model); for %s's KL term set GRPOConfig(beta=%s) "
                "or pass algorithm=pgloss.get(%r).",
                algorithm,
                config.beta,
                algorithm,
                configured(algorithm)["kl_coef"],
                algorithm,
            )
        if config.entropy_coef != 0:
            fields["entropy_coef"] = config.entropy_coef
        if problems:
            raise ValueError("PGLossGRPOTrainer cannot honour: " + "; ".join(problems))
        algorithm = _build(algorithm, fields, config, [o for o in _LOSS_OPTIONS if _is_set(config, o)])
    elif isinstance(algorithm, Algorithm):
        problems += _conflicts(config, algorithm)
        if problems:
            raise ValueError("PGLossGRPOTrainer cannot honour: " + "; ".join(problems))
    else:
        raise TypeError(f"algorithm must be None, a name or a pgloss.Algorithm, got {type(algorithm).__name__}")
    return _with_rollout_correction(config, algorithm)


def reference_model_refusal(model: Any, algorithm: Algorithm) -> str | None:
    """Why TRL cannot build the reference model `algorithm`'s KL term needs from `model`, or None.

    TRL 1.16's GRPOTrainer takes no reference model: with `beta != 0` it loads one from the policy's
    `config._name_or_path`, which a model built in memory (from a config, not `from_pretrained`) leaves empty, and
    the hub's loader then fails on the empty id. A PEFT model needs none (its adapter is switched off)."""
    if algorithm.kl_coef == 0 or isinstance(model, str) or hasattr(model, "peft_config"):
        return None
    path: Any = getattr(getattr(model, "config", None), "_name_or_path", None)
    if path is None or path != "":  # no transformers model, or one TRL can load again
        return None
    return (
        f"{algorithm.name} with kl_coef={algorithm.kl_coef} on a model built in memory (its config has no "
        "_name_or_path): TRL's GRPOTrainer takes no ref_model and loads the reference from that path. Save the "
        "model (model.save_pretrained(path)) and pass model=path, or drop the KL term "
        f"(algorithm=pgloss.get({algorithm.name!r}, kl_coef=0), GRPOConfig(beta=0))"
    )


def _conflicts(config: Any, algorithm: Algorithm) -> list[str]:
    """TRL options set away from their defaults to values the given Algorithm does not have."""
    conflicts = []
    if _is_set(config, "loss_type") and config.loss_type != algorithm.name:
        conflicts.append(
            f"loss_type={config.loss_type!r} (the loss is the algorithm's, {algorithm.name}): leave "
            "loss_type at its default, or pass algorithm=None to take the loss from loss_type"
        )
    fields, unused = _loss_fields(config, type(algorithm), only_set=True)
    if _is_set(config, "beta"):
        fields |= _kl_fields(config)
    if config.entropy_coef != 0:
        fields["entropy_coef"] = config.entropy_coef
    conflicts += [
        f"{_show(config, [option])} ({type(algorithm).__name__} has no field of that meaning: leave it at its default)"
        for option in unused
    ]
    for field, value in fields.items():
        if getattr(algorithm, field) != value:
            conflicts.append(
                f"a TRL option meaning {field}={value!r} (the algorithm has {field}="
                f"{getattr(algorithm, field)!r}: set it on the algorithm, dataclasses.replace(algorithm, "
                f"{field}={value!r}), or leave the TRL option at its default)"
            )
    return conflicts


def _with_rollout_correction(config: Any, algorithm: Algorithm) -> Algorithm:
    if algorithm.rollout_use == "own weight":  # VESPO folds the rollout log-probs into its own weight
        if config.off_policy_mask_threshold is not None:
            raise ValueError(
                f"PGLossGRPOTrainer cannot honour: off_policy_mask_threshold with {algorithm.name}, which "
                "takes no rollout correction"
            )
        return algorithm
    theirs = rollout_correction(config)
    if theirs is None or algorithm.rollout_correction == theirs:
        return algorithm
    if algorithm.rollout_correction is None:
        return dataclasses.replace(algorithm, rollout_correction=theirs)
    asked = [option for option in _ROLLOUT_OPTIONS if _is_set(config, option)]
    if asked:
        raise ValueError(
            f"PGLossGRPOTrainer cannot honour: {_show(config, asked)} beside the algorithm's own "
            f"rollout_correction={algorithm.rollout_correction} (two corrections of one sampler): keep the "
            "algorithm's with vllm_importance_sampling_correction=False and those options at their "
            "defaults, or TRL's with dataclasses.replace(algorithm, rollout_correction=None)"
        )
    _log.warning(
        "%s carries its own rollout_correction (%s), used instead of TRL's default vLLM importance sampling (%s).",
        algorithm.name,
        algorithm.rollout_correction,
        _show(config, _ROLLOUT_OPTIONS[:3]),
    )
    return algorithm
