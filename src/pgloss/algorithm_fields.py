"""The fields every algorithm shares, their checks, and what a configuration implies: the optional inputs
a call cannot do without (`needs`), what the rollout log-probs do (`rollout_use`, `correction`), the
`loss_agg_mode`s it aggregates with, whether its loss can be split over a sequence group.

`pgloss.Algorithm` (base.py) adds the call to these fields; a family subclasses `Algorithm`, adds its
hyperparameters as fields and declares what it reads (`required_inputs`, `takes_expert`, ...).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from .core.aggregate import Aggregation, aggregation
from .core.checks import check_fields
from .core.output import check
from .core.sequence_parallel import SequenceParallel
from .core.trainer_names import value_hint
from .correction.rollout import RolloutCorrection
from .kl.corrections import FULL, KL_CORRECTIONS, KL_OPTIONS


@dataclass(frozen=True, kw_only=True)
class AlgorithmFields:
    """Fields shared by every algorithm, their checks and what they imply; `pgloss.Algorithm` adds the call."""

    name: str = "custom"
    loss_agg_mode: str = "token-mean"
    """How per-token values become the loss (a key of `aggregate.AGGREGATIONS`)."""
    norm_constant: float | None = None
    """The fixed divisor C of `seq-mean-token-sum-norm` (Dr.GRPO) and `delta-l-norm` (ΔL Norm): the
    generation budget. Required there."""
    delta_l_alpha: float = 1.0
    """α of `delta-l-norm`: sequence i's token sum weighs |y_i|^-α / (C·Σ_j |y_j|^-α) (arXiv 2509.07558;
    1 is the minimum-variance weight, 0 is Dr.GRPO). Ignored by the other modes."""
    kl_coef: float = 0.0
    """β of the KL loss term β·KL(π_θ‖π_ref); 0 disables it and the reference model."""
    kl_estimator: str = "k3"
    """The KL term: k1, abs, k2, k3 on the sampled token; "k1+" ... "k3+": that value with k2's gradient
    (verl); "full": the exact KL over the vocabulary, passed as `full_kl` (`pgloss.vocab.full_kl`)."""
    kl_correction: str | None = None
    """None, "ratio_weighted" (KL·r, r differentiable: TRL's use_bias_correction_kl) or "unbiased_gradient"
    (value kept, k2's gradient weighted by sg[min(r, kl_correction_cap)]: OpenRLHF); `kl/corrections.py`."""
    kl_correction_cap: float = 10.0
    """The cap of the detached ratio weight of kl_correction="unbiased_gradient" (OpenRLHF's 10)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; the entropy gets a gradient only when this is non-zero."""
    positive_nll_coef: float = 0.0
    """μ of VAPO's positive-example NLL (arXiv 2504.05118, eq. 10; NeMo-RL `positive_example_nll_weight`):
    + μ·(-Σ_{i: s_i>0} Σ_t m log π / N_rew), N_rew the step's tokens of rewarded sequences; needs `scores`."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to ±max_log_ratio before exp (zero gradient beyond)."""
    max_kl: float = 10.0
    """The k3 estimate is clamped to ±max_kl, as verl does (zero gradient beyond)."""
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
    takes_expert: ClassVar[bool] = False
    """True when the family reads `expert` (the `[B]` flags of demonstration rows, CHORD): the step's
    Normalizer then counts the expert rows apart (`Normalizer.expert`)."""

    @property
    def fixed_agg_mode(self) -> str | None:
        """The loss_agg_mode the family's definition requires, or None when any mode is allowed."""
        return None

    def __post_init__(self) -> None:
        check_fields(self)
        agg = aggregation(self.loss_agg_mode)
        if self.fixed_agg_mode is not None:
            over = "groups" if aggregation(self.fixed_agg_mode).needs_group_ids else "sequences"
            check(
                self.loss_agg_mode == self.fixed_agg_mode,
                f"{self.name} defines its loss over {over} "
                f"and fixes loss_agg_mode={self.fixed_agg_mode!r}; got {self.loss_agg_mode!r}",
            )
        self.check_budget(agg)
        check(self.delta_l_alpha >= 0, f"delta_l_alpha must be >= 0, got {self.delta_l_alpha}")
        check(
            self.kl_estimator in KL_OPTIONS,
            f"kl_estimator must be one of {KL_OPTIONS}, got {self.kl_estimator!r}"
            + value_hint("kl_estimator", self.kl_estimator),
        )
        check(
            self.kl_correction is None or self.kl_correction in KL_CORRECTIONS,
            f"kl_correction must be None or one of {KL_CORRECTIONS}, got {self.kl_correction!r}",
        )
        check(
            not (self.kl_estimator == FULL and self.kl_correction is not None),
            f"kl_estimator='full' is exact and takes no kl_correction, got {self.kl_correction!r}",
        )
        check(self.kl_correction_cap > 0, f"kl_correction_cap must be > 0, got {self.kl_correction_cap}")
        check(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        check(self.positive_nll_coef >= 0, f"positive_nll_coef must be >= 0, got {self.positive_nll_coef}")
        check(self.max_log_ratio > 0, f"max_log_ratio must be > 0, got {self.max_log_ratio}")
        check(self.max_kl > 0, f"max_kl must be > 0, got {self.max_kl}")
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

    @property
    def uses_reference(self) -> bool:
        """True when the loss needs a frozen reference model: its log-probs (`ref_log_prob`), or with
        kl_estimator="full" the exact KL to it (`full_kl`)."""
        return self.kl_coef != 0

    @property
    def uses_full_kl(self) -> bool:
        """True when the KL term is the exact full-vocabulary KL, passed as `full_kl`."""
        return self.kl_coef != 0 and self.kl_estimator == FULL

    @property
    def needs(self) -> frozenset[str]:
        """The optional call inputs this configured algorithm cannot do without, read by every path
        (the plain call's checks, `from_hidden`, the adapters, the lab): names of core/inputs.py's
        `OPTIONAL_INPUTS`. The family declares its own
        in `required_inputs`; the rest follow from the fields (kl_coef, kl_estimator, entropy_coef,
        loss_agg_mode, rollout_correction)."""
        needed = set(self.required_inputs)
        if self.uses_full_kl:
            needed.add("full_kl")
        elif self.uses_reference:
            needed.add("ref_log_prob")
        if self.entropy_coef != 0:
            needed.add("entropy")
        if self.positive_nll_coef != 0:
            needed.add("scores")
        if self.grouped_mode is not None:
            needed.add("group_ids")
        if self.rollout_correction is not None and self.rollout_correction.needs_rollout:
            needed.add("rollout_log_prob")
        return frozenset(needed)

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

    @classmethod
    def modes_of(cls, values: dict[str, Any]) -> tuple[str, ...]:
        """The loss_agg_modes a configuration of these field `values` (a field left out: the family's
        default) aggregates with: `loss_agg_mode` (CHORD adds its SFT part's). Read before the algorithm
        is built (`pgloss.algorithms.divides_by_budget`) and after (`aggregation_modes`)."""
        return (values.get("loss_agg_mode", field_default(cls, "loss_agg_mode")),)

    def aggregation_modes(self) -> tuple[str, ...]:
        """The loss_agg_modes the loss aggregates with (`modes_of` this configuration)."""
        return self.modes_of(vars(self))

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
