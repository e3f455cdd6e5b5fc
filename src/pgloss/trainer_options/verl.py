"""verl's actor config as a pgloss `Algorithm`: the one translation of verl's loss options.

`pgloss.from_verl(actor_config)` and every call of a `pgloss_<name>` policy loss inside verl
(`pgloss.integrations.verl`) go through `algorithm_from_verl`, so a verl option means one thing on
both paths. This module reads attributes (or keys) of the config it is given and never imports
verl: it takes verl's `ActorConfig` / `FSDPActorConfig`, its OmegaConf `DictConfig` and plain dicts.

    verl (actor.*)                               pgloss
    policy_loss.loss_mode                        the algorithm (`LOSS_MODES`; pgloss_<name>: pgloss's own)
    loss_agg_mode                                loss_agg_mode (verl's sapo and geo_mean force seq-mean-token-mean)
    loss_scale_factor                            norm_constant, where the loss divides by a budget
    clip_ratio, clip_ratio_low, clip_ratio_high  clip_low, clip_high (None: clip_ratio)
    clip_ratio_c                                 dual_clip (where the algorithm has one), DPPO's truncation
    tau_pos, tau_neg                             tau_pos, tau_neg (SAPO)
    policy_loss.dro_beta                         dro_beta (required, as verl, unless registered with one)
    policy_loss.ppo_kl_coef, kl_cov_ratio        ppo_kl_coef, kl_cov_ratio (KL-Cov)
    policy_loss.clip_cov_ratio, _lb, _ub         clip_cov_ratio, clip_cov_lb, clip_cov_ub (Clip-Cov)
    use_kl_loss, kl_loss_coef, kl_loss_type      kl_coef, kl_estimator (`pgloss.core.trainer_names`)
    entropy_coeff                                entropy_coef
    rollout_correction (bypass_mode, or given)   rollout_correction (`RolloutCorrection`)

verl's code falls back to fixed values when a policy_loss field is None (`VERL_FALLBACKS`); the
same values are used here. Options pgloss cannot compute are refused by name (ValueError).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from ..algorithms import NAMED, Algorithm, get, names
from ..core.aggregate import needs_budget
from ..core.trainer_names import VALUES, closest, refuse_misspelt, translate_value
from ..correction.rejection import Rejection
from ..correction.rollout import RolloutCorrection
from .verl_distillation import distillation_fields

__all__ = [
    "LOSS_MODES",
    "PREFIX",
    "VARIANTS",
    "algorithm_from_verl",
    "config_get",
    "configuration",
    "from_verl",
    "rollout_correction_from_verl",
]

PREFIX = "pgloss_"
"""pgloss's losses are verl loss_modes `pgloss_<name>`."""

LOSS_MODES: dict[str, str] = {
    "vanilla": "dual_clip_ppo",  # always dual-clipped at clip_ratio_c
    "gspo": "gspo_token",  # verl's gspo is the sequence-token form
    "sapo": "sapo",
    "cispo": "cispo",
    "gpg": "gpg",
    "clip_cov": "clip_cov",
    "kl_cov": "kl_cov",
    "geo_mean": "gmpo",
    "dro": "dro",
    "dppo_tv": "dppo_tv",
    "dppo_kl": "dppo_kl",
}
"""verl 0.9.1's own policy losses (`verl/trainer/ppo/core_algos.py`) -> the pgloss name computing the
same loss. `bypass_mode` is `vanilla` (loss_type ppo_clip) or `gpg` (reinforce) with a bypass
`RolloutCorrection`."""

FORCED_MODES = {"sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-token-mean"}
"""verl losses that ignore `loss_agg_mode`: sapo aggregates seq-mean-token-mean, geo_mean a mean over rows."""

ACTOR_FIELDS: dict[str, tuple[str, ...]] = {
    "clip_ratio_low": ("clip_low",),
    "clip_ratio_high": ("clip_high",),
    "clip_ratio_c": ("dual_clip", "truncation"),
    "tau_pos": ("tau_pos",),
    "tau_neg": ("tau_neg",),
}
"""verl `ActorConfig` field -> the pgloss fields of the same meaning (set where the algorithm has them)."""

POLICY_LOSS_FIELDS = ("dro_beta", "ppo_kl_coef", "kl_cov_ratio", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")
"""verl `PolicyLossConfig` fields that have a pgloss field of the same name and meaning."""

VERL_FALLBACKS = {
    "ppo_kl_coef": 1.0,
    "kl_cov_ratio": 2e-4,
    "clip_cov_ratio": 2e-4,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
}
"""What verl's loss uses when the policy_loss field is None (`dro_beta` has none: verl refuses)."""

READ_KEYS = {
    "actor": (
        *ACTOR_FIELDS,
        "clip_ratio",
        "loss_agg_mode",
        "loss_scale_factor",
        "use_kl_loss",
        "kl_loss_coef",
        "kl_loss_type",
        "entropy_coeff",
        "policy_loss",
    ),
    "policy_loss": ("loss_mode", "rollout_correction", *POLICY_LOSS_FIELDS),
}
"""The keys of verl's actor config and of its `policy_loss` that pgloss reads: a dict's key a typo away from one
of them is refused (`trainer_names.misspelt`), not ignored."""

ACTOR_FALLBACKS = {"truncation": 20.0}
"""What verl's loss uses when the actor field is absent (a dict-like config): dppo's `clip_ratio_c` 20."""

VARIANTS: dict[str, Algorithm] = {}
"""Variants registered with `pgloss.integrations.verl.register`: name -> algorithm (loss_mode pgloss_<name>)."""


def config_get(config: Any, key: str, default: Any = None) -> Any:
    """`config[key]` of a dict-like (verl's BaseConfig, DictConfig, dict) or `config.key`."""
    if config is None:
        return default
    if hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


def _float(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where} must be a number, got {value!r}")
    return float(value)


def _ratio_bounds(where: str, spec: Any, *, ratio: bool) -> tuple[float | None, float]:
    """(lower, upper) of verl's threshold spec: a number (upper) or "lower_upper"."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise TypeError(f"{where} must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    try:
        lower, upper = (float(part) for part in text.split("_", 1)) if "_" in text else (None, float(text))
    except ValueError:
        raise ValueError(f"{where} must be a number or a 'lower_upper' string, got {spec!r}") from None
    if "_" in text and not ratio:
        raise ValueError(f"{where} takes one upper bound (a KL), got {spec!r}")
    return lower, upper


def _rejections(options: Any, thresholds: Any) -> tuple[Rejection, ...]:
    """verl's `rollout_rs` (comma-separated, duplicates dropped) and `rollout_rs_threshold` (one
    value shared, or one per option) as pgloss `Rejection`s."""
    if options is None:
        return ()
    names_ = list(dict.fromkeys(part.strip() for part in str(options).split(",") if part.strip()))
    if thresholds is None:
        raise ValueError("rollout_correction.rollout_rs needs rollout_rs_threshold (verl refuses it unset)")
    specs = [part.strip() for part in str(thresholds).split(",") if part.strip()]
    if len(specs) == 1:
        specs = specs * len(names_)
    if len(specs) != len(names_):
        raise ValueError(
            f"rollout_correction.rollout_rs_threshold needs one value or one per option of {names_}, got {thresholds!r}"
        )
    out = []
    for option, spec in zip(names_, specs, strict=True):
        lower, upper = _ratio_bounds(f"rollout_rs_threshold of {option}", spec, ratio=option.endswith("k1"))
        out.append(Rejection(option, upper=upper, lower=lower))
    return tuple(out)


def rollout_correction_from_verl(config: Any, *, bypass: bool | None = None) -> RolloutCorrection | None:
    """verl's `RolloutCorrectionConfig` (algorithm.rollout_correction) as a `RolloutCorrection`.

    rollout_is token / sequence -> weight_level token / sequence_product; rollout_is_threshold x ->
    truncate at x, "l_u" -> mask outside [l, u] (IcePop); rollout_rs, rollout_rs_threshold -> the
    `Rejection`s; rollout_is_batch_normalize -> batch_normalize; bypass_mode -> bypass. In bypass
    mode with loss_type ppo_clip verl applies no weight (the ratio is against the rollout already).
    """
    if config is None:
        return None
    bypass = bool(config_get(config, "bypass_mode", False)) if bypass is None else bypass
    level = config_get(config, "rollout_is", None)
    threshold = config_get(config, "rollout_is_threshold", 2.0)
    if bypass and config_get(config, "loss_type", "ppo_clip") == "ppo_clip":
        level = None
    levels = {"token": "token", "sequence": "sequence_product"}
    if level is not None and level not in levels:
        raise ValueError(f"rollout_correction.rollout_is must be one of {sorted(levels)} or None, got {level!r}")
    weight: dict[str, Any] = dict(weight_level=None)
    if level is not None and threshold is not None:
        lower, upper = _ratio_bounds("rollout_correction.rollout_is_threshold", threshold, ratio=True)
        weight = dict(
            weight_level=levels[level], upper=upper, lower=lower, weight_mode="truncate" if lower is None else "mask"
        )
    normalize = bool(config_get(config, "rollout_is_batch_normalize", False)) and weight["weight_level"] is not None
    if normalize and bypass:
        raise ValueError(
            "rollout_correction.rollout_is_batch_normalize with bypass_mode has no pgloss equivalent: "
            "the weight then depends on π_θ, and verl normalises it per micro-batch, so the step "
            "depends on how it is cut"
        )
    rejection = _rejections(config_get(config, "rollout_rs", None), config_get(config, "rollout_rs_threshold", None))
    if weight["weight_level"] is None and not rejection and not bypass:
        return None
    return RolloutCorrection(
        **weight, rejection=rejection, bypass=bypass, batch_normalize=normalize, max_log_ratio=20.0
    )


def _named(mode: str) -> tuple[str | None, Algorithm | None]:
    """(pgloss name, registered variant) for a verl loss_mode, or a refusal."""
    if mode.startswith(PREFIX):
        key = mode[len(PREFIX) :]
        if key in VARIANTS:
            return None, VARIANTS[key]
        if key in names():
            return key, None
    elif mode in LOSS_MODES:
        return LOSS_MODES[mode], None
    known = sorted(LOSS_MODES) + ["bypass_mode"] + [PREFIX + n for n in names()]
    raise ValueError(f"policy_loss.loss_mode {mode!r} has no pgloss equivalent; pgloss computes: {', '.join(known)}")


def _default(family: type[Algorithm], base: Algorithm | str, field: str) -> Any:
    """The value of `field` before verl's config: the variant's, else the name's default, else the family's."""
    if isinstance(base, Algorithm):
        return getattr(base, field)
    defaults = {f.name: f.default for f in dataclasses.fields(family)}
    return NAMED[base][1].get(field, defaults.get(field))


def _own_value(base: Algorithm | str, field: str) -> bool:
    """Whether the algorithm verl runs brings its own value of `field`, to stand where verl's field is
    unset: a variant (`register(name, algorithm)`) always does, a name does when it was registered with
    one (`pgloss.register("my_dro", DRO, dro_beta=0.3)`). A family's default is not one: verl refuses
    its own dro without dro_beta, and pgloss_dro does the same."""
    return isinstance(base, Algorithm) or field in NAMED[base][1]


def algorithm_from_verl(
    config: Any,
    *,
    name: str | None = None,
    algorithm: Algorithm | None = None,
    loss_agg_mode: str | None = None,
    rollout_correction: Any = None,
    policy_only: bool = False,
) -> Algorithm:
    """The pgloss algorithm computing what verl's actor `config` computes (see the module table).

    `name` / `algorithm`: the pgloss algorithm verl runs (a `pgloss_<name>` loss_mode, or a registered
    variant whose own values stand where verl's field is unset); None: the one `policy_loss.loss_mode`
    names. `loss_agg_mode`: verl's call argument (default: the config's). `rollout_correction`: verl's
    `algorithm.rollout_correction` (decoupled mode; with bypass_mode verl swaps the loss for its own
    `bypass_mode`). `policy_only`: the policy term alone, without verl's KL and entropy terms (the
    adapter: verl's `ppo_loss` adds them after the policy loss).
    """
    verl_native = name is None and algorithm is None
    policy = config_get(config, "policy_loss", None)
    for part, where in ((config, "actor"), (policy, "policy_loss")):
        if isinstance(part, Mapping) and not dataclasses.is_dataclass(part):  # a user's dict or DictConfig
            refuse_misspelt(part, READ_KEYS[where], f"verl's {where} config")
    mode = config_get(policy, "loss_mode", "vanilla") or "vanilla"
    correction_config = config_get(policy, "rollout_correction", None) if mode == "bypass_mode" else None
    if rollout_correction is not None and name is None and algorithm is None:
        if config_get(rollout_correction, "bypass_mode", False):
            mode, correction_config = "bypass_mode", rollout_correction  # what verl's trainer does
        else:
            correction_config = rollout_correction
    if name is None and algorithm is None:
        if mode == "bypass_mode":
            loss_type = config_get(correction_config, "loss_type", "ppo_clip")
            if loss_type not in ("ppo_clip", "reinforce"):
                raise ValueError(f"rollout_correction.loss_type must be 'ppo_clip' or 'reinforce', got {loss_type!r}")
            if correction_config is None:
                raise ValueError("policy_loss.loss_mode 'bypass_mode' needs policy_loss.rollout_correction (as verl)")
            name = "dual_clip_ppo" if loss_type == "ppo_clip" else "gpg"
        else:
            name, algorithm = _named(mode)
    # What verl runs: a variant (its own values stand where verl's field is unset) or a registered name
    base: Algorithm | str
    if algorithm is not None:
        base, family = algorithm, type(algorithm)
    elif name is not None and name in NAMED:
        base, family = name, NAMED[name][0]
    else:
        raise ValueError(f"unknown algorithm {name!r}; valid names: {', '.join(names())}")
    own = {f.name for f in dataclasses.fields(family)}
    label = (
        f"policy_loss.loss_mode={mode!r}"
        if verl_native
        else f"the variant {base.name!r}"
        if isinstance(base, Algorithm)
        else f"{PREFIX}{base}"
    )

    values: dict[str, Any] = {}
    agg = loss_agg_mode if loss_agg_mode is not None else config_get(config, "loss_agg_mode", "token-mean")
    values["loss_agg_mode"] = FORCED_MODES.get(mode, agg) if verl_native else agg

    clip = config_get(config, "clip_ratio", 0.2)
    for verl_name, ours in ACTOR_FIELDS.items():
        value = config_get(config, verl_name, None)
        if verl_name in ("clip_ratio_low", "clip_ratio_high") and value is None:
            value = clip
        for field in ours:
            if field in own and (value is not None or field in ACTOR_FALLBACKS and not isinstance(base, Algorithm)):
                values[field] = _float(verl_name, ACTOR_FALLBACKS[field] if value is None else value)
    if "dual_clip" in values and _default(family, base, "dual_clip") is None:
        del values["dual_clip"]  # verl always sets clip_ratio_c; it applies to losses with a dual clip only
    for field in POLICY_LOSS_FIELDS:
        if field not in own:
            continue
        value = config_get(policy, field, None)
        registered = _own_value(base, field)
        if value is None and field in VERL_FALLBACKS and not registered:
            value = VERL_FALLBACKS[field]
        if value is None and not registered:
            raise ValueError(
                f"{label} needs policy_loss.{field} > 0 (verl refuses it unset; pgloss uses no default in verl's place)"
            )
        if value is not None:
            values[field] = _float(f"policy_loss.{field}", value)

    scale = config_get(config, "loss_scale_factor", None)
    if needs_budget(values["loss_agg_mode"]):  # the mode divides by the generation budget (AGGREGATIONS)
        if scale is not None:
            values["norm_constant"] = _float("loss_scale_factor", scale)
        elif not (isinstance(base, Algorithm) and base.norm_constant is not None):
            raise ValueError(
                f"{label}: loss_agg_mode {values['loss_agg_mode']!r} needs actor.loss_scale_factor (the "
                "generation budget, e.g. data.max_response_length); verl would divide by each "
                "micro-batch's padded width, which pgloss never does"
            )

    forced = FORCED_MODES.get(mode) if verl_native else None
    extra = not policy_only and (config_get(config, "use_kl_loss", False) or config_get(config, "entropy_coeff", 0.0))
    if forced is not None and extra and agg != forced:
        raise ValueError(
            f"{label}: verl aggregates this policy term {forced!r} but its KL and entropy terms with "
            f"loss_agg_mode={agg!r}; a pgloss algorithm aggregates every term one way: set "
            f"loss_agg_mode={forced!r}"
        )
    if policy_only:
        values |= dict(kl_coef=0.0, entropy_coef=0.0)
    else:
        if config_get(config, "use_kl_loss", False):
            kind = config_get(config, "kl_loss_type", "low_var_kl")
            verl_kinds = (
                *VALUES["kl_estimator"],
                *(k + plus for k in ("k1", "k2", "k3", "abs") for plus in ("", "+")),
                "full",
            )
            if kind not in verl_kinds:
                raise ValueError(
                    f"kl_loss_type={kind!r} is not one of verl's KL types {verl_kinds}{closest(kind, verl_kinds)}"
                )
            estimator = translate_value("kl_estimator", kind)
            if estimator == "full":
                raise ValueError(
                    "kl_loss_type 'full' is not implemented by verl 0.9.1 (NotImplementedError); for the "
                    "exact KL use pgloss's kl_estimator='full' with full_kl"
                )
            values |= dict(
                kl_coef=_float("kl_loss_coef", config_get(config, "kl_loss_coef", 0.001)), kl_estimator=estimator
            )
        else:
            values["kl_coef"] = 0.0
        values["entropy_coef"] = _float("entropy_coeff", config_get(config, "entropy_coeff", 0.0))
    if correction_config is not None:
        values["rollout_correction"] = rollout_correction_from_verl(correction_config, bypass=mode == "bypass_mode")
    try:
        if isinstance(base, Algorithm):
            return dataclasses.replace(base, **values)
        return get(base, **values)
    except ValueError as error:  # the algorithm's own check, named in verl's words
        raise ValueError(f"{label} with verl's config: {error}") from None


_ABSENT = object()


def configuration(config: Any) -> Hashable | None:
    """What `algorithm_from_verl` reads of verl's actor `config`, as one hashable value: the values of
    `READ_KEYS` in it and in its `policy_loss` (absent keys apart from None), and the keys of a dict-like part
    (a key a typo away from a read one is refused). Equal values build equal algorithms, so an adapter keeps
    the one it built under this key. None when a value read cannot be hashed (then build each time)."""
    policy = config_get(config, "policy_loss", None)
    parts = []
    for part, where in ((config, "actor"), (policy, "policy_loss")):
        read = tuple(_frozen(config_get(part, key, _ABSENT)) for key in READ_KEYS[where] if key != "policy_loss")
        dict_like = isinstance(part, Mapping) and not dataclasses.is_dataclass(part)
        parts.append((read, frozenset(part) if dict_like else None))
    key = (config is None, tuple(parts))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(value: Any) -> Any:
    """`value` with its mappings, sequences and dataclasses as tuples (a nested config read whole)."""
    if isinstance(value, (str, bytes, int, float, bool)):
        return (type(value).__name__, value)  # True == 1 == 1.0, but verl's config may refuse one of them
    if value is None or value is _ABSENT:
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping) or (hasattr(value, "items") and hasattr(value, "keys")):
        return (type(value).__name__, tuple(sorted((str(k), _frozen(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)) or (hasattr(value, "__iter__") and hasattr(value, "__len__")):
        return (type(value).__name__, tuple(_frozen(v) for v in value))
    return value


def from_verl(actor_config: Any, *, rollout_correction: Any = None, distillation: Any = None) -> Algorithm:
    """The pgloss `Algorithm` that computes what verl's actor config computes, or a ValueError naming
    the verl option pgloss has no equivalent for.

    `actor_config`: verl's `actor_rollout_ref.actor` (an `ActorConfig`, its OmegaConf `DictConfig`
    or a dict); its `policy_loss.loss_mode` names the loss (verl's own, `bypass_mode`, or
    `pgloss_<name>`). `rollout_correction`: verl's `algorithm.rollout_correction`, for the
    correction verl's trainer applies before the loss (decoupled mode: the weights on π_old /
    π_rollout and the rejections; bypass_mode: the loss verl then runs). Loss, KL (`use_kl_loss`,
    `kl_loss_coef`, `kl_loss_type`) and entropy (`entropy_coeff`) terms are included, aggregated as
    verl's `ppo_loss` does. `distillation`: verl's `distillation` config, whose term (verl's distillation through
    the policy loss) is then added (`verl_distillation.distillation_fields`: the option map).

        algorithm = pgloss.from_verl(config.actor_rollout_ref.actor)

    One exception, the row count. verl's seq-mean modes (`seq-mean-token-mean`, `seq-mean-token-sum`,
    `seq-mean-token-sum-norm`) divide by `global_batch_size`, the step's rows, empty ones included;
    pgloss's count (a call without `normalizer`, `algorithm.step_normalizer`) skips a row without a
    valid token, whether it came empty or the rollout rejection (`rollout_rs`) emptied it. With B rows
    of which N keep a token, pgloss's loss and gradient are then verl's × B/N (6 rows, 3 emptied by
    `rollout_rs="seq_mean_k3"` at 0.02: 0.195322 against verl's 0.097661 under seq-mean-token-mean).
    `token-mean` (verl's `batch_num_tokens` counts the kept tokens, as pgloss) and `token-sum` agree.
    For verl's number, replace the step's row count by verl's:

        step = algorithm.step_normalizer(masks, old_log_probs=olds, rollout_log_probs=rollouts)
        step = dataclasses.replace(step, sequences=torch.tensor(float(rows), dtype=torch.float64))

    Inside verl the adapter (`pgloss_<name>`) takes verl's own counts and so equals verl.
    """
    if actor_config is None:
        raise TypeError("actor_config must be verl's actor config (ActorConfig, DictConfig or dict), got None")
    algorithm = algorithm_from_verl(actor_config, rollout_correction=rollout_correction)
    return algorithm if distillation is None else dataclasses.replace(algorithm, **distillation_fields(distillation))
