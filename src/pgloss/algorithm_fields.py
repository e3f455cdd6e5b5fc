"""The fields every algorithm shares, their checks, and what a configuration implies: its objective's declared
terms (`terms`, the fields of `pgloss.terms`), the optional inputs a call cannot do without (`needs`, from the
family's, the terms', the aggregation's and the correction's declarations), what the rollout log-probs do
(`rollout_use`, `correction`), how its policy term is aggregated (`policy_parts`) and whether its loss can be
split over a sequence group.

`pgloss.Algorithm` (base.py) adds the call to these fields; a family subclasses `Algorithm`, adds its
hyperparameters as fields and declares what it reads (`required_inputs`, `policy_parts`, ...).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from .core.aggregate import Aggregation, aggregation
from .core.checks import check_fields
from .core.inputs import OPTIONAL_INPUTS
from .core.output import check
from .core.row_set import Part, RowSet
from .core.sequence_parallel import SequenceParallel
from .correction.rollout import RolloutCorrection
from .terms import Term, TermOptions

F = TypeVar("F", bound="AlgorithmFields")


@dataclass(frozen=True, kw_only=True)
class AlgorithmFields(TermOptions):
    """Fields shared by every algorithm (the terms' among them: `pgloss.terms`), their checks and what they
    imply; `pgloss.Algorithm` adds the call."""

    name: str = "custom"
    loss_agg_mode: str = "token-mean"
    """How per-token values become the loss (a key of `aggregate.AGGREGATIONS`)."""
    norm_constant: float | None = None
    """The fixed divisor C of `seq-mean-token-sum-norm` (Dr.GRPO) and `delta-l-norm` (ΔL Norm): the
    generation budget. Required there."""
    delta_l_alpha: float = 1.0
    """α of `delta-l-norm`: sequence i's token sum weighs |y_i|^-α / (C·Σ_j |y_j|^-α) (arXiv 2509.07558;
    1 is the minimum-variance weight, 0 is Dr.GRPO). Ignored by the other modes."""
    policy_coef: float = 1.0
    """The weight of the policy term, L = policy_coef·Agg(w·ℓ) + Σ_k c_k·Agg_k(v_k): 1 - w of a blend with a
    distillation term (TRL SDPO's `distillation_weight` w), 0 for the terms alone (verl's distillation with
    `use_task_rewards=False`). The metric `pg_loss`, `per_token` and `inspect`'s closed form are the policy
    term's at weight 1."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to ±max_log_ratio before exp (zero gradient beyond)."""
    rollout_is_cap: float = 2.0
    """Cap of the truncated importance weight min(π_old/π_rollout, cap), used when rollout_log_prob is given
    and there is no rollout_correction: `RolloutCorrection(upper=rollout_is_cap)`."""
    rollout_correction: RolloutCorrection | None = None
    """The rollout correction beside the loss (`pgloss.correction.rollout`): its weight multiplies the policy term (and
    the KL term when `weight_kl`) before the aggregation; its rejections enter the mask."""

    couples_rows: ClassVar[bool] = False
    """True when ℓ of a row depends on other rows of the call (a token selection over the batch, a
    group contrast): the fused path then takes one call for the batch, and split invariance needs
    calls that hold whole groups."""
    consumes_rollout_log_prob: ClassVar[bool] = False
    """True when the family uses `rollout_log_prob` itself, instead of the truncated IS weight (the family's
    declaration; paths ask `rollout_use`)."""
    required_inputs: ClassVar[tuple[str, ...]] = ()
    """Optional call arguments this family cannot do without (e.g. "scores", "group_ids")."""
    required_input_reasons: ClassVar[Mapping[str, str]] = {}
    """Why the family reads one of its `required_inputs`, where the input's own description does not say."""

    @property
    def fixed_agg_mode(self) -> str | None:
        """The loss_agg_mode the family's definition requires, or None when any mode is allowed."""
        return None

    def __post_init__(self) -> None:
        check_fields(self)
        self.declared_terms  # noqa: B018  # built once, here: their checks run with the others
        if self.fixed_agg_mode is not None:
            over = "groups" if aggregation(self.fixed_agg_mode).needs_group_ids else "sequences"
            check(
                self.loss_agg_mode == self.fixed_agg_mode,
                f"{self.name} defines its loss over {over} "
                f"and fixes loss_agg_mode={self.fixed_agg_mode!r}; got {self.loss_agg_mode!r}",
            )
        for part in self.policy_parts():
            self.check_budget(aggregation(part.mode, field=part.field), field=part.field)
        check(self.delta_l_alpha >= 0, f"delta_l_alpha must be >= 0, got {self.delta_l_alpha}")
        check(self.policy_coef >= 0, f"policy_coef must be >= 0, got {self.policy_coef}")
        check(self.max_log_ratio > 0, f"max_log_ratio must be > 0, got {self.max_log_ratio}")
        check(self.rollout_is_cap > 0, f"rollout_is_cap must be > 0, got {self.rollout_is_cap}")
        if self.rollout_correction is not None and not isinstance(self.rollout_correction, RolloutCorrection):
            raise TypeError(
                f"rollout_correction must be a pgloss.RolloutCorrection or None, "
                f"got {type(self.rollout_correction).__name__}"
            )
        check(
            self.rollout_correction is None or self.takes_rollout_correction(),
            f"{self.name} uses the rollout log-probs in its own weight; it takes no rollout_correction",
        )
        self.input_reasons  # noqa: B018  # derived once, here, never while a call is traced

    def check_budget(self, agg: Aggregation, field: str = "loss_agg_mode") -> None:
        """Refuse a mode that divides by the generation budget (`Aggregation.needs_budget`) without
        `norm_constant` > 0; `field` names the option that chose it."""
        check(
            not agg.needs_budget or (self.norm_constant is not None and self.norm_constant > 0),
            f"{field} {agg.name!r} requires norm_constant > 0 (the generation budget, "
            f"e.g. max_new_tokens), got {self.norm_constant!r}",
        )

    @classmethod
    def takes_rollout_correction(cls) -> bool:
        """Whether the family takes a `rollout_correction`: every family but one that folds the rollout
        log-probs into its own weight (`consumes_rollout_log_prob`, VESPO). A translator asks it before
        building the algorithm."""
        return not cls.consumes_rollout_log_prob

    @property
    def rollout_use(self) -> str:
        """What the rollout log-probs (`rollout_log_prob`) do to this configured loss: the one answer
        the call (`correction`), the adapters and the lab read (`ROLLOUT_USES`).

        - "own weight": the family folds them into its own weight (`consumes_rollout_log_prob`, VESPO);
        - "correction": its `rollout_correction` weighs and rejects on them;
        - "truncated IS": no correction is configured: a call given them applies truncated importance
          sampling min(π_old/π_rollout, rollout_is_cap) (Yao et al. 2025); a call without them, none.

        A trainer whose rollout log-probs should change nothing unless it asks for a correction (TRL
        without its vLLM importance sampling) passes them only where this is not "truncated IS"."""
        if not self.takes_rollout_correction():
            return "own weight"
        return "correction" if self.rollout_correction is not None else "truncated IS"

    def correction(self, has_rollout: bool) -> RolloutCorrection | None:
        """The rollout correction of a call (`rollout_use`): `rollout_correction`, or, when only rollout
        log-probs are given, truncated importance sampling min(π_old/π_rollout, rollout_is_cap) (Yao et
        al. 2025). A family that uses the rollout log-probs itself gets none."""
        use = self.rollout_use
        if use == "correction":
            return self.rollout_correction
        if not has_rollout or use == "own weight":
            return None
        return RolloutCorrection(upper=self.rollout_is_cap, max_log_ratio=self.max_log_ratio)

    def policy_only(self: F) -> F:
        """This configuration's policy term alone, at weight 1: every declared term off (`TermOptions.policy_only`)
        and `policy_coef` = 1."""
        alone = super().policy_only()
        return dataclasses.replace(alone, policy_coef=1.0) if alone.policy_coef != 1 else alone

    @functools.cached_property
    def declared_terms(self) -> tuple[Term, ...]:
        """The objective's terms beside the policy term (`pgloss.terms`), configured by these fields."""
        return self.terms(self.max_log_ratio)

    def policy_parts(self) -> tuple[Part, ...]:
        """How the policy term is aggregated (`pgloss.core.row_set`): every row with `loss_agg_mode`. A family
        whose policy term treats subsets of rows apart (on-policy and demonstration rows) declares its
        parts; the step's count then counts their rows apart."""
        return (Part(self.loss_agg_mode),)

    @functools.cached_property
    def input_reasons(self) -> dict[str, str]:
        """The optional inputs this configuration cannot do without -> why, for the error of a call without
        one: the terms' (`Term.needs`), the family's (`required_inputs`), the aggregation's (group ids of a
        per-group mode) and the rollout correction's. Derived once per configuration."""
        reasons: dict[str, str] = {}
        for term in self.declared_terms:
            reasons |= term.needs()
        for name in self.required_inputs:
            reasons[name] = self.required_input_reasons.get(name, OPTIONAL_INPUTS[name].doc)
        if self.grouped_mode is not None:
            reasons["group_ids"] = f"[B], loss_agg_mode={self.grouped_mode!r}"
        if self.rollout_correction is not None and self.rollout_correction.needs_rollout:
            reasons["rollout_log_prob"] = "its rollout_correction weighs or rejects on the inference engine's log-probs"
        return reasons

    @property
    def needs(self) -> frozenset[str]:
        """The optional call inputs this configured algorithm cannot do without, read by every path
        (the plain call's checks, `from_hidden`, the adapters, the lab): names of core/inputs.py's
        `OPTIONAL_INPUTS`, derived from the declarations (`input_reasons`)."""
        return frozenset(self.input_reasons)

    @property
    def reads(self) -> frozenset[str]:
        """The optional inputs the loss reads: those it `needs` and those its aggregation's row sets read when
        given (the flags of a row set a family's parts declare)."""
        parts = self.policy_parts() + tuple(p for t in self.declared_terms for p in t.parts() or ())
        return self.needs | {part.rows.input for part in parts if part.rows is not None}

    def counted_row_sets(self) -> tuple[RowSet, ...]:
        """The row sets the step's count counts apart: those of the policy's and the terms' parts."""
        parts = self.policy_parts() + tuple(p for t in self.declared_terms for p in t.parts() or ())
        return tuple(dict.fromkeys(part.rows for part in parts if part.rows is not None))

    def sequence_split_refusal(self) -> str | None:
        """Why this configured loss cannot be computed over sequences split across a sequence group, or None
        (every built-in one can, but a selection drawn among a call's own tokens: Clip-Cov, KL-Cov)."""
        return None

    def check_sequence_split(self, sequence_parallel: SequenceParallel | None) -> None:
        """Refuse by name, under a sequence group, a loss that cannot be split (`sequence_split_refusal`): every
        call given a Normalizer counted with `sequence_parallel` asks."""
        reason = None if sequence_parallel is None else self.sequence_split_refusal()
        if reason is not None:
            raise ValueError(f"{self.name} cannot be computed over sequences split across ranks: {reason}")

    def aggregation_modes(self) -> tuple[str, ...]:
        """The loss_agg_modes the policy term aggregates with (`policy_parts`)."""
        return tuple(part.mode for part in self.policy_parts())

    @property
    def grouped_mode(self) -> str | None:
        """The first of `aggregation_modes` that divides by per-group counts (it needs `group_ids`), or None."""
        return next((mode for mode in self.aggregation_modes() if aggregation(mode).needs_group_ids), None)

    def describe(self) -> dict[str, Any]:
        """The hyperparameters as a plain dict (for printing and for run configs)."""
        return dataclasses.asdict(self)


def field_default(cls: type[AlgorithmFields], name: str) -> Any:
    """The default of dataclass field `name` of `cls` (`MISSING` when it has none)."""
    return cls.__dataclass_fields__[name].default


ROLLOUT_USES = ("own weight", "correction", "truncated IS")
"""The values of `Algorithm.rollout_use`."""
