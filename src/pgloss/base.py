"""The composition every named algorithm shares: an `Algorithm` is a frozen dataclass whose call runs

    1. `TokenBatch.prepare`: checks, float32 upcast, the one effective mask;
    2. the policy term ℓ_{i,t} of its family (`policy_terms`, defined in `losses/<family>.py`);
    3. the rollout correction (`pgloss.RolloutCorrection`): its weight before the aggregation and
       its rejections in the mask; with only `rollout_log_prob`, truncated importance sampling;
    4. + kl_coef · KL_t(π_θ‖π_ref) (`kl.corrections.kl_term`, or the exact `full_kl`) and - entropy_coef · H_t;
    5. `aggregate` with `loss_agg_mode` and the step's `Normalizer`;
    6. + positive_nll_coef · (VAPO's NLL on the rewarded sequences, their token mean over the step).

A family subclasses `Algorithm` beside its per-token function, adds its hyperparameters as fields
and implements `policy_terms`; `algorithms.py` names the families' configurations. The fields every
algorithm shares, their checks and what they imply (`needs`, `rollout_use`, the aggregation modes) are
`AlgorithmFields` (algorithm_fields.py).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .algorithm_fields import AlgorithmFields
from .core.aggregate import rewarded_row_weights, row_weights, weighted_sum
from .core.batch import TokenBatch
from .core.inputs import OPTIONAL_INPUTS, check_names, keyword_parameters
from .core.metrics import Stat, token_mean
from .core.normalizer import Normalizer
from .core.output import LossOutput, PolicyTerms
from .core.sequence_parallel import SequenceParallel
from .correction.rollout import Corrected
from .kl.corrections import FULL, kl_term

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
class Algorithm(AlgorithmFields):
    """A configured loss: the fields every algorithm shares (`AlgorithmFields`: their checks, `needs`,
    `rollout_use`, the aggregation modes) and the call that composes its terms; a subclass adds its
    family's hyperparameters and its `policy_terms`."""

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
                if (
                    correction is not None
                    and correction.weight_kl
                    and corrected is not None
                    and corrected.weight is not None
                ):
                    kl = kl * corrected.weight
                kl_loss = reduce(kl)
                metrics["kl_loss"] = Stat.loss(kl_loss)
                loss = loss + self.kl_coef * kl_loss
        if batch.entropy is not None:
            metrics["entropy"] = token_mean(batch.entropy, mask)
            if self.entropy_coef != 0:
                loss = loss - self.entropy_coef * reduce(batch.entropy)
        if self.positive_nll_coef != 0:
            assert batch.scores is not None  # in `needs`: a call without scores was refused above
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
        without materialising the logits; see [`pgloss.loss_from_hidden`][] for the arguments."""
        from .vocab.fused import loss_from_hidden

        return loss_from_hidden(self, hidden, weight, targets, **kwargs)


def _call_signature() -> inspect.Signature:
    """`Algorithm.__call__`'s signature with the optional inputs spelled out (for help() and editors)."""
    signature = inspect.signature(Algorithm.__call__)
    fixed = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    return signature.replace(parameters=fixed + keyword_parameters())


Algorithm.__call__.__signature__ = _call_signature()  # type: ignore[attr-defined]  # read by inspect.signature
