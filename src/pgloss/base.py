"""The composition every named algorithm shares: an `Algorithm` is a frozen dataclass whose call runs

    1. `TokenBatch.prepare`: checks, float32 upcast, the one effective mask;
    2. the policy term ℓ_{i,t} of its family (`policy_terms`, defined in `losses/<family>.py`);
    3. the rollout correction (`pgloss.RolloutCorrection`): its weight before the aggregation and
       its rejections in the mask; with only `rollout_log_prob`, truncated importance sampling;
    4. + kl_coef · KL_t(π_θ‖π_ref) (`kl_variants.kl_term`, or the exact `full_kl`) and - entropy_coef · H_t;
    5. `aggregate` with `loss_agg_mode` and the step's `Normalizer`;
    6. + positive_nll_coef · (VAPO's NLL on the rewarded sequences, their token mean over the step).

A family subclasses `Algorithm` beside its per-token function, adds its hyperparameters as fields
and implements `policy_terms`; `algorithms.py` names the families' configurations.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor

from .core.aggregate import Aggregation, Normalizer, aggregation, rewarded_row_weights, row_weights, weighted_sum
from .core.batch import TokenBatch
from .core.checks import check_fields
from .core.inputs import OPTIONAL_INPUTS, check_names, keyword_parameters
from .core.metrics import Stat, token_mean
from .core.output import LossOutput, PolicyTerms, check
from .core.sequence_parallel import SequenceParallel
from .core.trainer_names import value_hint
from .correction.rollout import Corrected, RolloutCorrection
from .kl.corrections import FULL, KL_CORRECTIONS, KL_OPTIONS, kl_term

_WHY = {
    "ref_log_prob": lambda a: f"kl_coef={a.kl_coef} with kl_estimator={a.kl_estimator!r}",
    "full_kl": lambda a: (
        f"kl_coef={a.kl_coef} with kl_estimator='full': pgloss.full_kl_from_logits or full_kl_from_hidden, [B, T]"
    ),
    "entropy": lambda a: f"entropy_coef={a.entropy_coef}",
    "rollout_log_prob": lambda a: "its rollout_correction weighs or rejects on the inference engine's log-probs",
    "group_ids": lambda a: (
        "[B], "
        + (
            f"loss_agg_mode={a.grouped_mode!r}"
            if a.grouped_mode is not None
            else "its loss contrasts the rows of a group"
        )
    ),
    "scores": lambda a: (
        "[B], the raw sequence rewards its loss weighs by"
        if "scores" in a.required_inputs
        else f"[B], the sequence rewards: positive_nll_coef={a.positive_nll_coef} trains on the "
        "rewarded (reward > 0) sequences"
    ),
}
"""Why this configuration needs an input of `Algorithm.needs`, for the error of a call without it (the
inputs not here say their table's `doc`)."""


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """Fields shared by every algorithm; a subclass adds its family's hyperparameters."""

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
    (value kept, k2's gradient weighted by sg[min(r, kl_correction_cap)]: OpenRLHF); `kl_variants.py`."""
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

    def step_normalizer(
        self,
        masks: Tensor | Sequence[Tensor],
        *,
        old_log_probs: Tensor | Sequence[Tensor] | None = None,
        rollout_log_probs: Tensor | Sequence[Tensor] | None = None,
        group_ids: Tensor | Sequence[Tensor] | None = None,
        scores: Tensor | Sequence[Tensor] | None = None,
        expert: Tensor | Sequence[Tensor] | None = None,
        count_rejected: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
    ) -> Normalizer:
        """The counts of one optimizer step, for this algorithm: the one rule every path uses.

        Count it once per step over every micro-batch of the step (one tensor per micro-batch in each
        argument) and pass it to each micro-batch's call; a call without a `normalizer` counts itself
        with this rule. With rollout log-probs and a correction (`correction`), the counts leave out the
        tokens its KL-based rejection drops before the step (or keep them, `count_rejected=True`, as
        AReaL) and carry the step's mean weight for `batch_normalize`
        (`RolloutCorrection.normalizer`); otherwise `Normalizer.count` of the masks. Group ids are
        counted when the algorithm needs them (`needs`). A collective under torch.distributed, like
        `Normalizer.count`: every rank calls it at every step, even with empty micro-batches. The
        tokens of rewarded sequences are counted from `scores` when `positive_nll_coef` is set, the
        expert rows apart from `expert` when the family reads it (`takes_expert`). With `sequence_parallel`
        the masks are slices of longer sequences on that group (`pgloss.SequenceParallel`) and
        `process_group` is the data-parallel group beside it; every call given this Normalizer then
        computes over whole sequences (`pgloss.core.sequence_parallel`).
        """
        groups = group_ids if "group_ids" in self.needs else None
        scores = scores if self.positive_nll_coef != 0 else None
        expert = expert if self.takes_expert else None
        correction = self.correction(rollout_log_probs is not None)
        if correction is not None and rollout_log_probs is not None:
            if old_log_probs is None:
                raise ValueError(
                    f"{self.name}'s rollout correction counts the step on the old and rollout log-probs: "
                    "pass old_log_probs beside rollout_log_probs"
                )
            return correction.normalizer(
                masks,
                old_log_probs,
                rollout_log_probs,
                group_ids=groups,
                scores=scores,
                expert=expert,
                count_rejected=count_rejected,
                process_group=process_group,
                reduce=reduce,
                sequence_parallel=sequence_parallel,
            )
        if correction is not None and correction.needs_rollout:
            raise ValueError(f"{self.name} has a rollout correction that needs rollout_log_probs to count the step")
        return Normalizer.count(
            masks,
            group_ids=groups,
            scores=scores,
            expert=expert,
            process_group=process_group,
            reduce=reduce,
            sequence_parallel=sequence_parallel,
        )

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

    def whole_step_normalizer(self, mask: Tensor, old_log_prob: Tensor | None, **inputs: Tensor | None) -> Normalizer:
        """The counts of a call that is the whole step (no `normalizer` given): this batch alone, on this
        process, by `step_normalizer`'s rule, from the call's optional inputs. The call and `from_hidden`
        read it (`old_log_prob` None: on-policy, allowed where the counts do not read it)."""
        return self.step_normalizer(
            mask,
            old_log_probs=old_log_prob,
            rollout_log_probs=inputs.get("rollout_log_prob"),
            group_ids=inputs.get("group_ids"),
            scores=inputs.get("scores"),
            expert=inputs.get("expert"),
            reduce=False,
        )

    def corrected(
        self, batch: TokenBatch, normalizer: Normalizer | None
    ) -> tuple[TokenBatch, Normalizer, Corrected | None]:
        """The prelude of a call, shared with `pgloss.diagnostics.inspect`: the step's counts (this batch
        counted as the whole step by `step_normalizer` when `normalizer` is None) and the rollout
        correction (`correction`) applied, its corrected old log-probs and rejections in the batch.
        Returns (batch, normalizer, the correction's output or None)."""
        if normalizer is None:
            normalizer = self.whole_step_normalizer(
                batch.mask, batch.old_log_prob, **{name: getattr(batch, name) for name in OPTIONAL_INPUTS}
            )
        correction = self.correction(batch.rollout_log_prob is not None)
        if correction is None:
            return batch, normalizer, None
        corrected = correction.apply(
            log_prob=batch.log_prob,
            old_log_prob=batch.old_log_prob,
            rollout_log_prob=batch.rollout_log_prob,
            mask=batch.mask,
            seq_advantages=None if correction.off_policy_mask is None else batch.row_advantages,
            weight_mean=getattr(normalizer, "weight_mean", None),
            sequence_parallel=batch.sequence_parallel,
        )
        batch = dataclasses.replace(batch, old_log_prob=corrected.old_log_prob).restricted(corrected.mask)
        return batch, normalizer, corrected

    def row_weights(self, mask: Tensor, normalizer: Normalizer, group_ids: Tensor | None) -> Tensor:
        """c_i of this algorithm's `loss_agg_mode` (`core.aggregate.row_weights`) with its constants: the
        one place the call and `inspect` take the aggregation weights from."""
        return row_weights(
            mask,
            self.loss_agg_mode,
            normalizer,
            norm_constant=self.norm_constant,
            group_ids=group_ids,
            delta_l_alpha=self.delta_l_alpha,
        )

    def aggregate(
        self, values: Tensor, mask: Tensor, normalizer: Normalizer, group_ids: Tensor | None = None
    ) -> Tensor:
        """Σ_i c_i Σ_t v_{i,t} · world_size: `[B, T]` per-token `values` (ignored where `mask` is False)
        aggregated with this algorithm's `row_weights` over the step's counts, as the call aggregates its
        KL and entropy terms. A trainer that weighs the policy term itself (verl's `rollout_is_weights`)
        aggregates the weighted `LossOutput.per_token` here instead of choosing the mode's divisor again."""
        mask = mask.bool()
        return weighted_sum(
            torch.where(mask, values, 0.0), self.row_weights(mask, normalizer, group_ids), normalizer.world_size
        )

    @classmethod
    def modes_of(cls, values: dict[str, Any]) -> tuple[str, ...]:
        """The loss_agg_modes a configuration of these field `values` (a field left out: the family's
        default) aggregates with: `loss_agg_mode` (CHORD adds its SFT part's). Read before the algorithm
        is built (`pgloss.algorithms.divides_by_budget`) and after (`aggregation_modes`)."""
        return (values.get("loss_agg_mode", _field_default(cls, "loss_agg_mode")),)

    def aggregation_modes(self) -> tuple[str, ...]:
        """The loss_agg_modes the loss aggregates with (`modes_of` this configuration)."""
        return self.modes_of(vars(self))

    @property
    def grouped_mode(self) -> str | None:
        """The first of `aggregation_modes` that divides by per-group counts (it needs `group_ids`), or None."""
        return next((mode for mode in self.aggregation_modes() if aggregation(mode).needs_group_ids), None)

    def policy_row_weights(self, batch: TokenBatch, normalizer: Normalizer, rows: Tensor) -> Tensor:
        """c_i of the policy term, given the call's `rows` (`row_weights`): those rows, unless the family
        aggregates subsets of rows apart (CHORD's on-policy and expert rows). The KL, entropy and NLL
        terms keep `rows`."""
        return rows

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        """The per-token policy term ℓ_{i,t} (zero at masked positions is not required) and its metrics."""
        raise NotImplementedError

    def __call__(
        self,
        log_prob: Tensor,
        old_log_prob: Tensor | None,
        advantages: Tensor,
        mask: Tensor,
        *,
        normalizer: Normalizer | None = None,
        **inputs: Tensor | None,
    ) -> LossOutput:
        """The loss of one (micro-)batch. Token tensors `[B, T]`, `advantages` `[B]` or `[B, T]`.

        `old_log_prob=None` is on-policy (one gradient step per batch): log π_old is `log_prob` detached, the
        ratio exactly 1 and the gradient that of the on-policy loss (`TokenBatch.prepare`); `from_hidden` takes
        it the same way, from the log π of its own pass.

        Pass the step's `Normalizer` when the step has several micro-batches or ranks; without it
        this batch is the whole step (counted locally, even under torch.distributed).
        `inputs` are the optional inputs of `pgloss.core.inputs.OPTIONAL_INPUTS` (`ref_log_prob`,
        `entropy`, `rollout_log_prob`, `teacher_log_prob` `[B, T]`; `group_ids`, `scores`, `expert` `[B]`;
        `full_kl` `[B, T]`, the exact KL with its gradient from `pgloss.full_kl_from_logits` /
        `full_kl_from_hidden`); a call without one the configuration `needs` is refused, saying why,
        and one it does not read is ignored. The metrics are means
        over this call's valid tokens; `pgloss.StepMetrics` combines them over a step's micro-batches and ranks.
        """
        if normalizer is not None and not isinstance(normalizer, Normalizer):
            raise TypeError(
                f"normalizer must be a pgloss.Normalizer (from Normalizer.count), got {type(normalizer).__name__}"
            )
        check_names(inputs)
        for needed in sorted(self.needs):
            if inputs.get(needed) is None:
                why = _WHY[needed](self) if needed in _WHY else OPTIONAL_INPUTS[needed].doc
                raise ValueError(f"{self.name} needs {needed} in the call ({why})")
        split = None if normalizer is None else normalizer.sequence_parallel
        self.check_sequence_split(split)
        batch = TokenBatch.prepare(log_prob, old_log_prob, advantages, mask, sequence_parallel=split, **inputs)
        batch, normalizer, corrected = self.corrected(batch, normalizer)
        correction = self.correction(batch.rollout_log_prob is not None)
        mask = batch.mask
        terms = self.policy_terms(batch)
        per_token = terms.per_token
        metrics = dict(terms.metrics)
        if corrected is not None:  # the weight enters before the aggregation
            metrics |= corrected.metrics
            if corrected.weight is not None:
                per_token = per_token * corrected.weight
        per_token = torch.where(mask, per_token, 0.0)
        rows = self.row_weights(mask, normalizer, batch.group_ids)

        def reduce(masked_values: Tensor) -> Tensor:
            return weighted_sum(masked_values, rows, normalizer.world_size)

        loss = weighted_sum(per_token, self.policy_row_weights(batch, normalizer, rows), normalizer.world_size)
        metrics["pg_loss"] = Stat.loss(loss)
        kl = None
        if self.kl_estimator == FULL:
            kl = batch.full_kl
        elif batch.ref_log_prob is not None:
            kl = kl_term(
                batch.log_prob,
                batch.ref_log_prob,
                batch.old_log_prob,
                estimator=self.kl_estimator,
                correction=self.kl_correction,
                correction_cap=self.kl_correction_cap,
                max_log_ratio=self.max_log_ratio,
                max_kl=self.max_kl,
            )
        if kl is not None:
            kl = torch.where(mask, kl, 0.0)
            metrics["kl"] = token_mean(kl, mask)
            if self.kl_coef != 0:
                if corrected is not None and corrected.weight is not None and correction.weight_kl:
                    kl = kl * corrected.weight
                kl_loss = reduce(kl)
                metrics["kl_loss"] = Stat.loss(kl_loss)
                loss = loss + self.kl_coef * kl_loss
        if batch.entropy is not None:
            metrics["entropy"] = token_mean(batch.entropy, mask)
            if self.entropy_coef != 0:
                loss = loss - self.entropy_coef * reduce(batch.entropy)
        if self.positive_nll_coef != 0:
            nll = weighted_sum(
                torch.where(mask, -batch.log_prob, 0.0),
                rewarded_row_weights(mask, batch.scores > 0, normalizer),
                normalizer.world_size,
            )
            metrics["positive_nll_loss"] = Stat.loss(nll)
            loss = loss + self.positive_nll_coef * nll
        return LossOutput.of(loss, metrics, per_token)

    def from_hidden(self, hidden: Tensor, weight: Tensor, targets: Tensor, **kwargs: Any) -> LossOutput:
        """The same loss computed from hidden states `[B, T, H]` and the output projection `[V, H]`
        without materialising the logits; see `pgloss.vocab.fused.loss_from_hidden` for the arguments."""
        from .vocab.fused import loss_from_hidden

        return loss_from_hidden(self, hidden, weight, targets, **kwargs)

    def describe(self) -> dict[str, Any]:
        """The hyperparameters as a plain dict (for printing and for run configs)."""
        return dataclasses.asdict(self)


def _field_default(cls: type, name: str) -> Any:
    """The default of dataclass field `name` of `cls` (`MISSING` when it has none)."""
    return cls.__dataclass_fields__[name].default


ROLLOUT_USES = ("own weight", "correction", "truncated IS")
"""The values of `Algorithm.rollout_use`."""


def _call_signature() -> inspect.Signature:
    """`Algorithm.__call__`'s signature with the optional inputs spelled out (for help() and editors)."""
    signature = inspect.signature(Algorithm.__call__)
    fixed = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    return signature.replace(parameters=fixed + keyword_parameters())


Algorithm.__call__.__signature__ = _call_signature()
