"""The named algorithms: a short, declarative table of (name, family, source, defaults).

Each family is one file of `losses/`: its config class (a frozen `Algorithm` dataclass, see
`base.py` for what a call does) beside its per-token function. A name is a family with the
defaults of its paper or reference implementation. `get(name, **hyperparameters)` builds one;
`register(name, family, **defaults)` adds a user's own variant. docs/reference.md has the formulas,
the defaults, the sources and where pgloss deliberately differs from them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .base import Algorithm
from .core.aggregate import needs_budget
from .core.checks import check_number
from .core.output import LossOutput, PolicyTerms
from .core.trainer_names import closest, field_hint
from .losses.a2po import A2PO
from .losses.ce_gppo import CEGPPO
from .losses.chord import CHORD
from .losses.cispo import CISPO
from .losses.clip_cov import ClipCov
from .losses.dppo import DPPO
from .losses.dro import DRO
from .losses.fipo import FIPO
from .losses.gmpo import GMPO
from .losses.gvpo import GVPO
from .losses.importance_sampling import ImportanceSampling
from .losses.kl_cov import KLCov
from .losses.luspo import LUSPO
from .losses.opd import OPD
from .losses.opmd import OPMD
from .losses.ppo import ClippedPolicy
from .losses.real import REAL
from .losses.rec import REC
from .losses.reinforce import GPG, TISPG, TOPR
from .losses.sapo import SAPO
from .losses.sppo import SPPO
from .losses.vespo import VESPO

__all__ = [
    "Algorithm",
    "LossOutput",
    "PolicyTerms",
    "NAMED",
    "SOURCES",
    "RECIPES",
    "Recipe",
    "recipe",
    "register",
    "names",
    "get",
    "families",
    "CEGPPO",
    "CHORD",
    "CISPO",
    "ClipCov",
    "ClippedPolicy",
    "DPPO",
    "DRO",
    "FIPO",
    "GMPO",
    "GPG",
    "GVPO",
    "KLCov",
    "LUSPO",
    "OPD",
    "OPMD",
    "REAL",
    "REC",
    "SAPO",
    "SPPO",
    "TISPG",
    "TOPR",
    "VESPO",
]

NAMED: dict[str, tuple[type[Algorithm], dict[str, Any]]] = {}
"""name -> (family, defaults), in registration order."""
SOURCES: dict[str, str] = {}
"""name -> where its formula and defaults come from."""

SEQ, TOK = "seq-mean-token-mean", "token-mean"
_TABLE: list[tuple[str, type[Algorithm], str, dict[str, Any]]] = [
    ("ppo", ClippedPolicy, "Schulman et al. 2017, arXiv 1707.06347", dict(loss_agg_mode=SEQ)),
    (
        "dual_clip_ppo",
        ClippedPolicy,
        "Ye et al. 2020, arXiv 1912.09729; verl vanilla",
        dict(loss_agg_mode=SEQ, dual_clip=3.0),
    ),
    (
        "grpo",
        ClippedPolicy,
        "Shao et al. 2024, arXiv 2402.03300",
        dict(loss_agg_mode=SEQ, kl_coef=0.04, kl_estimator="k3"),
    ),
    (
        "sample_grpo",
        ClippedPolicy,
        "OpenR1 in practice (6), 2025-06-04",
        dict(loss_agg_mode=SEQ, ratio_level="sequence_product"),
    ),
    (
        "gspo",
        ClippedPolicy,
        "Zheng et al. 2025, arXiv 2507.18071",
        dict(loss_agg_mode=SEQ, ratio_level="sequence", clip_low=3e-4, clip_high=4e-4),
    ),
    (
        "gspo_token",
        ClippedPolicy,
        "arXiv 2507.18071 eq. 13; verl gspo",
        dict(loss_agg_mode=SEQ, ratio_level="sequence_token", clip_low=3e-4, clip_high=4e-4),
    ),
    ("dapo", ClippedPolicy, "Yu et al. 2025, arXiv 2503.14476", dict(loss_agg_mode=TOK, clip_low=0.2, clip_high=0.28)),
    ("bnpo", ClippedPolicy, "TRL / ms-swift loss_type=bnpo", dict(loss_agg_mode=TOK)),
    ("dr_grpo", ClippedPolicy, "Liu et al. 2025, arXiv 2503.20783", dict(loss_agg_mode="seq-mean-token-sum-norm")),
    (
        "distill_ppo",
        ClippedPolicy,
        "verl 0.9.1 distillation with use_policy_gradient (verl/trainer/distillation/losses.py distillation_ppo_loss; "
        "verl/workers/config/distillation.py)",
        dict(loss_agg_mode=TOK, dual_clip=3.0, distill_coef=1.0),
    ),
    (
        "sdpo",
        ClippedPolicy,
        "SDPO, arXiv 2601.20802; TRL sdpo (trl/experimental/sdpo/sdpo_trainer.py _compute_self_distillation_loss)",
        dict(loss_agg_mode=TOK, policy_coef=0.0, self_distill_coef=1.0),
    ),
    ("cispo", CISPO, "MiniMax-M1, arXiv 2506.13585", dict(loss_agg_mode=TOK)),
    ("sapo", SAPO, "Gao et al. 2025, arXiv 2511.20347", dict(loss_agg_mode=SEQ)),
    (
        "fipo",
        FIPO,
        "Ma et al. 2026, arXiv 2603.19835; ms-swift fipo",
        dict(
            loss_agg_mode=TOK,
            clip_low=0.2,
            clip_high=0.28,
            delta=10.0,
            fipo_clip_high_only=True,
            fipo_safety_threshold=10.0,
        ),
    ),
    ("gmpo", GMPO, "Zhao et al. 2025, arXiv 2507.20673; verl geo_mean (trainer/ppo/core_algos.py)", dict()),
    ("clip_cov", ClipCov, "Cui et al. 2025, arXiv 2505.22617; verl clip_cov (trainer/ppo/core_algos.py)", dict()),
    ("kl_cov", KLCov, "Cui et al. 2025, arXiv 2505.22617; verl kl_cov (trainer/ppo/core_algos.py)", dict()),
    ("gpg", GPG, "Chu et al. 2025, arXiv 2504.02546; verl gpg (trainer/ppo/core_algos.py)", dict()),
    ("tis_pg", TISPG, "ROLL tis (roll/pipeline/rlvr/actor_pg_worker.py)", dict()),
    ("topr", TOPR, "Le Roux et al. 2025, arXiv 2503.14286; ROLL topr (roll/pipeline/rlvr/actor_pg_worker.py)", dict()),
    ("dppo_tv", DPPO, "arXiv 2602.04879; verl dppo_tv (trainer/ppo/core_algos.py)", dict(divergence="tv")),
    ("dppo_kl", DPPO, "arXiv 2602.04879; verl dppo_kl (trainer/ppo/core_algos.py)", dict(divergence="kl")),
    ("dro", DRO, "Kimi k1.5, arXiv 2501.12599; verl dro, ROLL kimi15", dict()),
    ("vespo", VESPO, "TRL vespo (trl/trainer/grpo_trainer.py); Liger grpo_loss", dict()),
    ("luspo", LUSPO, "TRL luspo (trl/trainer/grpo_trainer.py)", dict()),
    ("ce_gppo", CEGPPO, "Su et al. 2025, Kwai-Klear/CE-GPPO compute_gppo_loss_general_beta", dict()),
    ("real", REAL, "arXiv 2602.05630; ms-swift real (swift/rlhf_trainers/grpo_trainer.py)", dict()),
    (
        "rec_oneside",
        REC,
        "Yao et al. 2025, arXiv 2509.24203; Trinity-RFT rec REC-OneSide-NoIS "
        "(trinity/algorithm/policy_loss_fn/rec_policy_loss.py)",
        dict(rec_clip_mode="one-side"),
    ),
    (
        "rec_ring",
        REC,
        "Yao et al. 2025, arXiv 2509.24203; Trinity-RFT rec REC-Ring-NoIS "
        "(trinity/algorithm/policy_loss_fn/rec_policy_loss.py)",
        dict(rec_clip_mode="ring", ring_low=0.6, ring_high=2.0),
    ),
    (
        "rollout_is",
        REC,
        "GLM-5 report, arXiv 2602.15763; SkyRL rollout_is_policy_loss (skyrl/backends/skyrl_train/utils/ppo_utils.py)",
        dict(rec_clip_mode="two-side", rec_weight="importance_sampling"),
    ),
    (
        "opmd",
        OPMD,
        "Kimi k1.5, arXiv 2501.12599; Trinity-RFT opmd (trinity/algorithm/policy_loss_fn/opmd_policy_loss.py)",
        dict(),
    ),
    ("sppo", SPPO, "arXiv 2108.05828; Trinity-RFT sppo (trinity/algorithm/policy_loss_fn/sppo_loss_fn.py)", dict()),
    ("gvpo", GVPO, "Zhang et al. 2025, arXiv 2504.19599; verl-recipe gvpo (gvpo/gvpo_core_algos.py)", dict()),
    (
        "opd",
        OPD,
        "On-Policy Distillation (Thinking Machines, 2025), GKD arXiv 2306.13649; tinker-cookbook "
        "distillation/train_on_policy.py",
        dict(loss_agg_mode=TOK),
    ),
    (
        "iw_opd",
        OPD,
        "Xie et al. 2026, arXiv 2606.22600; TRL iw_opd (trl/experimental/iw_opd/iw_opd_trainer.py)",
        dict(loss_agg_mode=TOK, opd_position_gamma=0.5, opd_surrogate="log_prob"),
    ),
    (
        "chord",
        CHORD,
        "CHORD, arXiv 2508.11408; Trinity-RFT mix_chord (trinity/algorithm/policy_loss_fn/chord_policy_loss.py)",
        dict(loss_agg_mode=TOK, dual_clip=3.0),
    ),
    (
        "importance_sampling",
        ImportanceSampling,
        "Tinker importance_sampling (tinker-cookbook rl/train.py); SkyRL importance_sampling_loss "
        "(skyrl/backends/skyrl_train/utils/ppo_utils.py)",
        dict(loss_agg_mode="token-sum"),
    ),
    (
        "ipo",
        ImportanceSampling,
        "prime-rl ipo_loss_fn (src/prime_rl/trainer/rl/loss.py)",
        dict(loss_agg_mode=TOK, ipo_threshold=0.1, ipo_kl_tau=1e-3),
    ),
    (
        "a2po",
        A2PO,
        "A*-PO, arXiv 2505.20686; TRL a2po (trl/experimental/a2po/a2po_trainer.py)",
        dict(loss_agg_mode=SEQ),
    ),
]


@dataclass(frozen=True)
class Recipe:
    """What a name's paper does around its loss: how the trainer computes the advantages and samples
    the groups. The loss never reads it; the lab follows it and the adapters report where the
    trainer's own settings differ (the trainer computes its advantages)."""

    scale_rewards: bool = True
    """Whether the group advantages divide by the group std (`pgloss.advantages.group_advantages(scale=)`)."""
    dynamic_sampling: bool = False
    """Whether groups whose rewards are all equal are dropped (`pgloss.advantages.dynamic_sampling_keep`)."""


RECIPES: dict[str, Recipe] = {}
"""name -> its paper's advantage and sampling recipe (`Recipe()` unless the paper says otherwise)."""
_PAPER_RECIPES = {
    "dapo": Recipe(dynamic_sampling=True),  # arXiv 2503.14476 eq. 11
    "fipo": Recipe(dynamic_sampling=True),  # FIPO trains on DAPO's recipe
    "dr_grpo": Recipe(scale_rewards=False),  # arXiv 2503.20783: no std division
    "rec_oneside": Recipe(scale_rewards=False),  # Trinity RECGroupedAdvantage std_normalize=False
    "rec_ring": Recipe(scale_rewards=False),
    "opmd": Recipe(scale_rewards=False),  # r - mean(r) (Trinity opmd_baseline="mean"), or τ·logavgexp(r/τ)
    "sppo": Recipe(scale_rewards=False),  # Trinity sPPOAlgorithm: OPMD's advantages
    "gvpo": Recipe(scale_rewards=False),  # arXiv 2504.19599: R - mean(R); verl-recipe norm_adv_by_std_in_grpo=False
}


def unknown_name(name: object) -> ValueError:
    """The error for an algorithm name that is not registered: the closest name first, then every name."""
    return ValueError(f"unknown algorithm {name!r}{closest(name, NAMED)}; valid names: {', '.join(NAMED)}")


def recipe(name: str) -> Recipe:
    """The advantage and sampling recipe of `name`'s paper (`Recipe`); ValueError for an unknown name."""
    if name not in NAMED:
        raise unknown_name(name)
    return RECIPES[name]


def _valid_fields(family: type[Algorithm]) -> set[str]:
    return {f.name for f in dataclasses.fields(family)} - {"name"}


def _check_hyperparameters(name: str, family: type[Algorithm], values: dict[str, Any]) -> None:
    unknown = sorted(set(values) - _valid_fields(family))
    if unknown:
        hints = "".join(field_hint(key) or closest(key, _valid_fields(family)) for key in unknown)
        recipe_fields = sorted(set(unknown) & {f.name for f in dataclasses.fields(Recipe)})
        if recipe_fields:
            hints += (
                f" ({', '.join(recipe_fields)} belongs to the advantages and sampling, not the loss: "
                f"pgloss.recipe({name!r}), or register(..., recipe=pgloss.algorithms.Recipe(...)))"
            )
        raise TypeError(
            f"{name} has no hyperparameter {', '.join(map(repr, unknown))}{hints}; "
            f"valid: {', '.join(sorted(_valid_fields(family)))}"
        )


def register(
    name: str,
    family: type[Algorithm] | str,
    *,
    source: str = "user-registered",
    recipe: Recipe | None = None,
    **defaults: Any,
) -> None:
    """Add `name`: `family` (an `Algorithm` subclass, or the name of a registered family as `pgloss list` prints
    it, e.g. "ClippedPolicy") with `defaults` over the family's own.

    Refuses a name already taken (ValueError, listing the taken names), a family that is not an
    `Algorithm` subclass (TypeError) and an unknown hyperparameter (TypeError naming it); values
    are checked when `get` builds the algorithm (a default may leave a required value to the
    caller, as Dr.GRPO's `norm_constant`). The name then works everywhere a built-in one does:
    `get`, `names`, `pgloss list`, the lab and the adapters. `source` is shown by `pgloss list`;
    `recipe` (`Recipe`, default `Recipe()`) is what the lab does around the loss.

        pgloss.register("dapo_wide", pgloss.algorithms.ClippedPolicy, clip_high=0.4, loss_agg_mode="token-mean")
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name must be an identifier-like string, got {name!r}")
    if name in NAMED:
        raise ValueError(f"algorithm {name!r} is already registered; taken names: {', '.join(NAMED)}")
    if isinstance(family, str):
        classes = {cls.__name__: cls for cls, _ in NAMED.values()}
        if family not in classes:
            raise ValueError(
                f"family {family!r} is not a registered family{closest(family, classes)}; "
                f"families: {', '.join(classes)}"
            )
        family = classes[family]
    if not (isinstance(family, type) and issubclass(family, Algorithm)) or family is Algorithm:
        raise TypeError(f"family must be a subclass of pgloss.Algorithm, got {family!r}")
    if not isinstance(source, str):
        raise TypeError(f"source must be a string, got {type(source).__name__}")
    if recipe is not None and not isinstance(recipe, Recipe):
        raise TypeError(f"recipe must be a pgloss.algorithms.Recipe or None, got {type(recipe).__name__}")
    _check_hyperparameters(name, family, defaults)
    NAMED[name] = (family, dict(defaults))
    SOURCES[name] = source
    RECIPES[name] = recipe or Recipe()


for _name, _family, _source, _defaults in _TABLE:
    register(_name, _family, source=_source, recipe=_PAPER_RECIPES.get(_name), **_defaults)


def names() -> list[str]:
    """Every named algorithm, in registration order."""
    return list(NAMED)


def families() -> dict[str, list[str]]:
    """Family class name -> its names, in registration order."""
    out: dict[str, list[str]] = {}
    for name, (family, _) in NAMED.items():
        out.setdefault(family.__name__, []).append(name)
    return out


def _resolved(name: str, hyperparameters: dict[str, Any]) -> tuple[type[Algorithm], dict[str, Any]]:
    if name not in NAMED:
        raise unknown_name(name)
    family, defaults = NAMED[name]
    _check_hyperparameters(name, family, hyperparameters)
    return family, {**defaults, **hyperparameters}


def configured(name: str, **hyperparameters: Any) -> dict[str, Any]:
    """The field values `get(name, **hyperparameters)` builds with, before its checks: `hyperparameters`
    over the name's defaults over the family's. A translator that must read a resolved value before
    building (TRL's `loss_agg_mode` under a sequence ratio) reads it here, never from the table alone."""
    family, values = _resolved(name, hyperparameters)
    return {f.name: f.default for f in dataclasses.fields(family) if f.default is not dataclasses.MISSING} | values


def divides_by_budget(name: str, **hyperparameters: Any) -> bool:
    """True when `name` with `hyperparameters` aggregates with a mode that divides by a fixed generation
    budget (`pgloss.core.aggregate.AGGREGATIONS`' `needs_budget`: Dr.GRPO's `seq-mean-token-sum-norm`,
    `delta-l-norm`; CHORD's SFT part counts too) and no `norm_constant` is set: `get` then needs
    `generation_budget=` (or `norm_constant=`)."""
    family, values = _resolved(name, hyperparameters)
    if values.get("norm_constant") is not None:
        return False
    probe = family(name=name, **{**values, "norm_constant": 1.0})  # a budget of 1 only to read its modes
    return any(needs_budget(mode) for mode in probe.aggregation_modes())


def get(name: str, *, generation_budget: float | None = None, **hyperparameters: Any) -> Algorithm:
    """The algorithm `name` with its defaults, overridden by `hyperparameters`.

    `generation_budget`: the trainer's response budget (max new tokens). It becomes `norm_constant`
    where the loss divides by a fixed budget (`divides_by_budget`: Dr.GRPO's
    `seq-mean-token-sum-norm`, `delta-l-norm`) and no `norm_constant` is given; every other algorithm ignores it.
    Trainers and the lab pass their budget here, so no path decides by name which loss needs one.

    Raises ValueError for an unknown name (listing the valid ones), TypeError for an unknown
    hyperparameter (naming it and listing the valid ones), ValueError for an impossible value.
    """
    family, values = _resolved(name, hyperparameters)
    if generation_budget is not None and divides_by_budget(name, **hyperparameters):
        budget = check_number("generation_budget", generation_budget)
        if not budget > 0:
            raise ValueError(f"generation_budget must be > 0 (max new tokens), got {generation_budget!r}")
        values["norm_constant"] = float(budget)
    return family(name=name, **values)
