"""TRL's `GRPOConfig` in pgloss's terms: the one owner of the option mapping, read by `pgloss.from_trl`
and by the TRL adapter (`PGLossGRPOTrainer`). It reads the config's attributes and never imports trl.

    algorithm = pgloss.from_trl(GRPOConfig(loss_type="grpo", beta=0.04, epsilon_high=0.28))

TRL 1.16 (`trl/trainer/grpo_trainer.py`, `_compute_loss` and `_generate_and_score_completions`):

| TRL option | pgloss | note |
|---|---|---|
| `loss_type` | the algorithm of the same name | grpo, bnpo, dr_grpo, dapo, cispo, sapo, vespo, luspo |
| `epsilon`, `epsilon_high` (None: = epsilon) | `clip_low`, `clip_high` | CISPO: `clip_high` = TRL's cap `epsilon_high`, `cispo_convention="absolute"` |
| `delta` | `delta` | the clipped losses |
| `importance_sampling_level` | `ratio_level` ("token", "sequence") | |
| `sapo_temperature_pos/neg`, `vespo_*` | `tau_pos/neg`, `vespo_*` | |
| `beta` | `kl_coef`, `kl_estimator="k3"` | `use_bias_correction_kl`: `kl_correction="ratio_weighted"` |
| `entropy_coef` | `entropy_coef` | pgloss aggregates H like the loss (docs/reference.md) |
| `max_completion_length` | `generation_budget` | Dr.GRPO's divisor |
| `scale_rewards` | none: TRL computes the advantages | the adapter warns where it differs from the paper's `pgloss.recipe(name)` |
| vLLM `vllm_importance_sampling_*` | `RolloutCorrection(weight_level, weight_mode, lower, upper)` | token/sequence × truncate/mask |
| `off_policy_mask_threshold` | `RolloutCorrection(off_policy_mask=)` | |
| `top_entropy_quantile` | `pgloss.correction.token_masks` on the mask | not an Algorithm field: the adapter applies it |
| `use_adaptive_entropy`, `entropy_target`, `entropy_coef_delta/min/max` | `pgloss.controllers.AdaptiveEntropy` (`adaptive_entropy`) | state across steps: the adapter steps it; `entropy_coef` is its initial value |

Refused, naming the option: `use_adaptive_entropy` in `from_trl` alone (the coefficient is a
controller's, across steps: pass `entropy_controlled=True` and drive `adaptive_entropy(config)`, as
the adapter does), a sequence-level ratio where pgloss's loss of that name is per token (cispo, sapo) or where
TRL sums a sequence ratio over tokens (bnpo, dr_grpo, dapo: pgloss's sequence ratio is GSPO's,
seq-mean-token-mean), the ratio-weighted KL with a sequence-level ratio, the off-policy mask with
VESPO, and values pgloss's own checks refuse (e.g. `delta <= 1 + epsilon_high`).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from ..algorithms import NAMED, Algorithm, configured, get
from ..controllers import AdaptiveEntropy
from ..core.trainer_names import FIELDS, refuse_misspelt
from ..correction.rollout import RolloutCorrection
from ..losses.cispo import CISPO
from ..losses.ppo import ClippedPolicy
from ..losses.sapo import SAPO
from ..losses.vespo import VESPO

__all__ = [
    "LOSS_TYPES",
    "GRPOOptions",
    "adaptive_entropy",
    "from_trl",
    "rollout_correction",
]

_log = logging.getLogger(__name__)

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
"""TRL 1.16's `loss_type`s; each is the pgloss name of the same loss."""

_VESPO = ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg")
_VLLM_IS = ("vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max")
_LOSS_OPTIONS = (
    "epsilon",
    "epsilon_high",
    "delta",
    "importance_sampling_level",
    "sapo_temperature_pos",
    "sapo_temperature_neg",
    *_VESPO,
)
_ROLLOUT_OPTIONS = (
    "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_min",
    "vllm_importance_sampling_clip_max",
    "off_policy_mask_threshold",
)
_IS_LEVELS = {"token": "token", "sequence": "sequence_product"}


@dataclasses.dataclass(frozen=True)
class GRPOOptions:
    """The options of TRL 1.16's `GRPOConfig` that pgloss reads, at TRL's defaults: what `from_trl` makes of a
    dict (tests/integrations/test_trl_config.py holds every default against the installed TRL's)."""

    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    beta: float = 0.0
    use_bias_correction_kl: bool = True
    entropy_coef: float = 0.0
    max_completion_length: int | None = 512
    use_vllm: bool = False
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_min: float | None = None
    vllm_importance_sampling_clip_max: float = 3.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    use_adaptive_entropy: bool = False
    entropy_target: float = 0.2
    entropy_coef_delta: float = 0.005
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0


def grpo_options(config: Any) -> Any:
    """A `GRPOConfig` as it is; a dict (e.g. `GRPOConfig.to_dict()`, or the few options one sets) as
    `GRPOOptions` with TRL's defaults for what it leaves out. A key that misspells an option pgloss reads is
    refused, naming the option; other keys (TrainingArguments') are not pgloss's to read."""
    if not isinstance(config, Mapping):
        return config
    names = [f.name for f in dataclasses.fields(GRPOOptions)]
    refuse_misspelt(config, names, "TRL's GRPOConfig")
    return GRPOOptions(**{key: value for key, value in config.items() if key in names})


def _ours(option: str) -> str:
    """pgloss's name for a TRL option (`pgloss.core.trainer_names`), the option itself where they agree."""
    return FIELDS[option][0] if option in FIELDS and option not in ("loss_type",) else option


def _default(config: Any, option: str) -> Any:
    return {f.name: f.default for f in dataclasses.fields(config)}[option]


def _is_set(config: Any, option: str) -> bool:
    """Whether `option` differs from GRPOConfig's default (what the caller asked for)."""
    return getattr(config, option) != _default(config, option)


def _show(config: Any, options: tuple[str, ...] | list[str]) -> str:
    return ", ".join(f"{option}={getattr(config, option)!r}" for option in options)


def _loss_fields(config: Any, family: type[Algorithm], *, only_set: bool) -> tuple[dict[str, Any], list[str]]:
    """The pgloss fields of `family` that TRL's loss options mean, and the options it cannot express.

    `only_set`: translate only the options set away from GRPOConfig's defaults (an algorithm given by
    name keeps its own defaults); otherwise every option TRL's loss of that family reads."""
    chosen = (lambda option: _is_set(config, option)) if only_set else (lambda option: True)
    high = config.epsilon if config.epsilon_high is None else config.epsilon_high
    fields: dict[str, Any] = {}
    used: set[str] = set()
    sequence = config.importance_sampling_level == "sequence"
    if issubclass(family, ClippedPolicy):
        if chosen("epsilon"):
            fields[_ours("epsilon")] = config.epsilon
            if config.epsilon_high is None:
                fields[_ours("epsilon_high")] = config.epsilon
        if chosen("epsilon_high") and config.epsilon_high is not None:
            fields[_ours("epsilon_high")] = config.epsilon_high
        if chosen("delta"):
            fields["delta"] = config.delta
        if chosen("importance_sampling_level"):
            fields[_ours("importance_sampling_level")] = config.importance_sampling_level
        used |= {"epsilon", "epsilon_high", "delta", "importance_sampling_level"}
    elif issubclass(family, CISPO):  # TRL's CISPO caps the ratio at epsilon_high itself
        if chosen("epsilon") or chosen("epsilon_high"):
            fields |= dict(clip_high=high, cispo_convention="absolute", clip_low=None)
        used |= {"epsilon", "epsilon_high"} | ({"importance_sampling_level"} if not sequence else set())
    elif issubclass(family, SAPO):
        for option in ("sapo_temperature_pos", "sapo_temperature_neg"):
            if chosen(option):
                fields[_ours(option)] = getattr(config, option)
        used |= {"sapo_temperature_pos", "sapo_temperature_neg"} | (
            {"importance_sampling_level"} if not sequence else set()
        )
    elif issubclass(family, VESPO):  # TRL's VESPO reads no ratio level: its weight is its own
        fields |= {option: getattr(config, option) for option in _VESPO if chosen(option)}
        used |= {*_VESPO, "importance_sampling_level"}
        if config.use_vllm and config.vllm_importance_sampling_correction and any(chosen(o) for o in _VLLM_IS):
            # TRL folds its bounded ratio into VESPO's weight (token_truncate or token_mask, the modes it allows)
            if not config.vllm_importance_sampling_mode.startswith("token_"):
                raise ValueError(
                    f"VESPO folds a per-token ratio: vllm_importance_sampling_mode must be 'token_truncate' "
                    f"or 'token_mask' (TRL refuses the others too), got "
                    f"{config.vllm_importance_sampling_mode!r}"
                )
            fields |= dict(
                vespo_rollout_mode=config.vllm_importance_sampling_mode.removeprefix("token_"),
                vespo_rollout_clip_min=config.vllm_importance_sampling_clip_min,
                vespo_rollout_clip_max=config.vllm_importance_sampling_clip_max,
            )
    # A set option this family has no meaning for: refused when asked for (only_set), or when TRL's own
    # loss reads it and pgloss's cannot (a sequence ratio for cispo and sapo).
    candidates = _LOSS_OPTIONS if only_set else ("importance_sampling_level",)
    unused = [
        option
        for option in candidates
        if option not in used and (_is_set(config, option) or (option == "importance_sampling_level" and sequence))
    ]
    return fields, unused


def _kl_fields(config: Any) -> dict[str, Any]:
    """TRL's KL term: β·k3, times the differentiable token ratio with `use_bias_correction_kl`."""
    beta = config.beta
    correction = "ratio_weighted" if beta != 0 and config.use_bias_correction_kl else None
    return {_ours("beta"): beta, "kl_estimator": "k3", "kl_correction": correction}


def rollout_correction(config: Any) -> RolloutCorrection | None:
    """TRL's vLLM importance sampling (`use_vllm` and `vllm_importance_sampling_correction`) and
    off-policy mask as one `RolloutCorrection`, or None when neither is on.

        mode          TRL (ρ = π_old/π_vllm per token; sequence: exp Σ_t log ρ_t)     pgloss
        *_truncate    clamp(ρ, clip_min, clip_max)                                       weight_mode="truncate"
        *_mask        ρ · 1[clip_min ≤ ρ ≤ clip_max] (0 outside: kept in the count)      weight_mode="mask"

    token_* is weight_level "token", sequence_* "sequence_product"; a None bound is no bound (a mask
    without bounds masks nothing: the plain ratio). `off_policy_mask_threshold` is `off_policy_mask`.
    """
    weighted = bool(config.use_vllm and config.vllm_importance_sampling_correction)
    if not weighted and config.off_policy_mask_threshold is None:
        return None
    values: dict[str, Any] = dict(weight_level=None)  # the off-policy mask alone: no weight
    if weighted:
        level, _, how = str(config.vllm_importance_sampling_mode).partition("_")
        if level not in _IS_LEVELS or how not in ("truncate", "mask"):
            raise ValueError(
                f"vllm_importance_sampling_mode={config.vllm_importance_sampling_mode!r} is not one of "
                "TRL's token_truncate, token_mask, sequence_truncate, sequence_mask"
            )
        lower, upper = config.vllm_importance_sampling_clip_min, config.vllm_importance_sampling_clip_max
        if how == "mask" and lower is None and upper is None:
            how = "truncate"  # no band: nothing is masked, the weight is the plain ratio
        values = dict(weight_level=_IS_LEVELS[level], weight_mode=how, lower=lower, upper=upper)
    try:
        return RolloutCorrection(off_policy_mask=config.off_policy_mask_threshold, **values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{_show(config, _ROLLOUT_OPTIONS)}: no pgloss rollout correction ({error})") from error


def _build(name: str, fields: dict[str, Any], config: Any, options: list[str]) -> Algorithm:
    family = NAMED[name][0]
    level = fields.get("ratio_level")
    mode = configured(name, **fields)["loss_agg_mode"]  # the mode get() builds with, as it resolves it
    if (
        level == "sequence"
        and issubclass(family, ClippedPolicy)
        and family.fixed_agg_mode is ClippedPolicy.fixed_agg_mode
        and mode != "seq-mean-token-mean"
    ):
        raise ValueError(
            f"importance_sampling_level='sequence' with the {name} loss: TRL sums the sequence ratio's "
            f"loss over tokens (it warns so), pgloss's sequence ratio is GSPO's, one vote per sequence "
            f"(seq-mean-token-mean); use loss_type='grpo' (or algorithm='gspo'), as TRL's warning advises"
        )
    try:
        return get(name, generation_budget=float(config.max_completion_length), **fields)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{_show(config, options) or name}: no pgloss equivalent ({error})") from error


def from_trl(config: Any, *, entropy_mask_applied: bool = False, entropy_controlled: bool = False) -> Algorithm:
    """The pgloss `Algorithm` that computes the loss a TRL `GRPOConfig` asks for (TRL 1.16), or a
    ValueError naming the option pgloss cannot express (see the module's table).

    `top_entropy_quantile < 1` selects tokens, which is a mask (`pgloss.correction.token_masks`), not a field of
    the loss: apply it to each micro-batch's mask before counting the step (the TRL adapter does) and
    pass `entropy_mask_applied=True`; without it such a config is refused.
    `use_adaptive_entropy=True` moves the coefficient between steps: drive `adaptive_entropy(config)`
    (its `algorithm(...)` sets each step's `entropy_coef`, the adapter does) and pass
    `entropy_controlled=True`; without it such a config is refused. The returned `entropy_coef` is then
    the controller's initial coefficient.

    `config`: a `GRPOConfig`, or a dict of its options (`grpo_options`: TRL's defaults for the rest).
    """
    config = grpo_options(config)
    problems = _unexpressible(config, entropy_controlled)
    if config.top_entropy_quantile < 1 and not entropy_mask_applied:
        problems.append(
            f"top_entropy_quantile={config.top_entropy_quantile} is a token mask, not a field of the "
            "loss: apply pgloss.token_masks.top_entropy_mask to the masks before counting the step "
            "(PGLossGRPOTrainer does) and call from_trl(config, entropy_mask_applied=True)"
        )
    name = config.loss_type
    if name not in LOSS_TYPES:
        raise ValueError(f"loss_type={name!r} is not one of TRL 1.16's {LOSS_TYPES}")
    fields, unused = _loss_fields(config, NAMED[name][0], only_set=False)
    problems += [
        f"{_show(config, [option])} with loss_type={name!r} (pgloss's {name} has no such ratio level)"
        for option in unused
    ]
    fields |= _kl_fields(config)
    if fields["kl_correction"] is not None and config.importance_sampling_level == "sequence":
        problems.append(
            "use_bias_correction_kl=True with importance_sampling_level='sequence' (TRL multiplies k3 "
            "by the sequence ratio; pgloss's ratio_weighted KL uses the token ratio): set "
            "use_bias_correction_kl=False"
        )
    if problems:
        raise ValueError("pgloss cannot express these TRL options: " + "; ".join(problems))
    fields |= dict(entropy_coef=config.entropy_coef)
    if NAMED[name][0].takes_rollout_correction():
        fields["rollout_correction"] = rollout_correction(config)
    elif config.off_policy_mask_threshold is not None:
        raise ValueError(
            f"pgloss cannot express these TRL options: off_policy_mask_threshold with loss_type={name!r} "
            f"({name} folds the rollout log-probs into its own weight and takes no rollout correction)"
        )
    return _build(name, fields, config, [option for option in ("loss_type", *_LOSS_OPTIONS) if _is_set(config, option)])


def _unexpressible(config: Any, entropy_controlled: bool) -> list[str]:
    problems = []
    if config.use_adaptive_entropy and not entropy_controlled:
        problems.append(
            "use_adaptive_entropy=True (the entropy coefficient moves between steps from the measured "
            "entropy; one Algorithm's entropy_coef is fixed): step "
            "pgloss.trainer_options.trl.adaptive_entropy(config) once per optimizer step, take each "
            "step's algorithm from its .algorithm(...) and call from_trl(config, entropy_controlled=True) "
            "(PGLossGRPOTrainer does), or set use_adaptive_entropy=False and a fixed entropy_coef"
        )
    return problems


def adaptive_entropy(config: Any) -> AdaptiveEntropy | None:
    """TRL's adaptive entropy control of `config` (`use_adaptive_entropy`) as a `pgloss.controllers.AdaptiveEntropy`
    starting at `entropy_coef`, with `entropy_target`, `entropy_coef_delta`, `entropy_coef_min`,
    `entropy_coef_max`; None when the option is off."""
    if not config.use_adaptive_entropy:
        return None
    try:
        return AdaptiveEntropy(
            config.entropy_coef,
            target=config.entropy_target,
            delta=config.entropy_coef_delta,
            coef_min=config.entropy_coef_min,
            coef_max=config.entropy_coef_max,
        )
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"use_adaptive_entropy with entropy_target={config.entropy_target}, entropy_coef_delta="
            f"{config.entropy_coef_delta}, entropy_coef_min={config.entropy_coef_min}, entropy_coef_max="
            f"{config.entropy_coef_max}: {error}"
        ) from error
