"""The composition every named algorithm shares: an `Algorithm` is a frozen dataclass whose call computes

    L = Agg_policy(w · ℓ) + Σ_k c_k · Agg_k(v_k)

    1. `TokenBatch.prepare`: checks, float32 upcast, the one effective mask;
    2. the step's counts (`count_step`; a call without a `normalizer` is the whole step) and the rollout
       correction (`pgloss.RolloutCorrection`): its weight w before the aggregation and its rejections in
       the mask; with only `rollout_log_prob`, truncated importance sampling;
    3. the policy term ℓ_{i,t} of its family (`policy_terms`, defined in `losses/<family>.py`), aggregated
       in its `policy_parts` (every row with `loss_agg_mode`, unless the family declares subsets of rows),
       weighed by `policy_coef` (1);
    4. each declared term of `pgloss.terms` (the KL penalty, the entropy bonus, the positive-example NLL):
       its per-token value v_k aggregated in its own parts, times its coefficient c_k.

A family subclasses `Algorithm` beside its per-token function, adds its hyperparameters as fields
and implements `policy_terms`; `algorithms.py` names the families' configurations. The fields every
algorithm shares, their checks and what they imply (`needs`, `rollout_use`, the aggregation) are
`AlgorithmFields` (algorithm_fields.py); the terms' fields are theirs (`pgloss.terms`).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .algorithm_fields import AlgorithmFields
from .core.aggregate import parts_row_weights, weighted_sum
from .core.batch import TokenBatch, per_micro_batch
from .core.checks import host_reads
from .core.inputs import OPTIONAL_INPUTS, STEP_INPUTS, check_names, keyword_parameters
from .core.metrics import Stat
from .core.normalizer import Normalizer
from .core.output import LossOutput, PolicyTerms
from .core.row_set import Part
from .core.sequence_parallel import SequenceParallel
from .correction.rollout import Corrected
from .correction.weighting import weighted


class PartialGroupWarning(UserWarning):
    """A call of a loss that contrasts the rows of a group holds only part of a group of its step: that part's
    loss is computed from the rows it holds, not from the whole group. Put whole groups in each micro-batch;
    `warnings.simplefilter("error", pgloss.PartialGroupWarning)` makes it an error."""


@dataclass(frozen=True, kw_only=True)
class Algorithm(AlgorithmFields):
    """A configured loss: the fields every algorithm shares (`AlgorithmFields`: their checks, `needs`,
    `rollout_use`, the aggregation modes) and the call that composes its terms; a subclass adds its
    family's hyperparameters and its `policy_terms`."""

    def count_step(
        self,
        mask: Tensor | Sequence[Tensor],
        *,
        count_rejected: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
        **inputs: Tensor | Sequence[Tensor] | None,
    ) -> Normalizer:
        """The counts of one optimizer step: the one entry point every path counts a step with.

        `mask` and `inputs` are the step's micro-batches as its calls take them, by the same names (one tensor,
        or one tensor per micro-batch): `old_log_prob`, `rollout_log_prob`, `group_ids`, the `[B]` inputs that
        choose rows, and any other input of the call, which the count ignores unless this configuration counts it. Pass the
        returned `Normalizer` to every micro-batch's call; a call without one counts itself here.

        What is counted is what the objective declared: the tokens, sequences and lengths of the masks, the
        tokens per group when the loss needs `group_ids`, each subset of rows a part of its aggregation holds
        (`policy_parts`, the terms' parts: the rewarded sequences of the positive-example NLL, a family's
        demonstration rows), and with rollout log-probs and a correction (`correction`) the masks after its KL-based rejection
        (or before it, `count_rejected=True`, as AReaL) and the step's weight sums for `batch_normalize`.

        A collective under torch.distributed: every rank of `process_group` calls it at every step, even with
        empty micro-batches; one MAX and one SUM all-reduce (`Normalizer.count`). With `sequence_parallel` the
        masks are slices of longer sequences on that group (`pgloss.SequenceParallel`) and `process_group` is the
        data-parallel group beside it; every call given this Normalizer then computes over whole sequences.
        """
        check_names(inputs, STEP_INPUTS)
        masks = per_micro_batch("mask", mask)
        old, rollout = inputs.get("old_log_prob"), inputs.get("rollout_log_prob")
        correction = self.correction(rollout is not None)
        sums: dict[str, Tensor] = {}
        if correction is not None and rollout is not None:
            if old is None:
                raise ValueError(
                    f"{self.name}'s rollout correction counts the step on the old and rollout log-probs: "
                    "pass old_log_prob beside rollout_log_prob (to step_normalizer: old_log_probs beside "
                    "rollout_log_probs)"
                )
            masks, sums = correction.step_count_inputs(
                masks,
                old,
                rollout,
                count_rejected=count_rejected,
                sequence_parallel=sequence_parallel,
                names=("mask", "old_log_prob", "rollout_log_prob"),
            )
        elif correction is not None and correction.needs_rollout:
            raise ValueError(
                f"{self.name} has a rollout correction that needs rollout_log_prob to count the step "
                "(to step_normalizer: rollout_log_probs)"
            )
        return Normalizer.count(
            masks,
            group_ids=inputs.get("group_ids") if "group_ids" in self.needs else None,
            row_sets={
                rows: values for rows in self.counted_row_sets() if (values := inputs.get(rows.input)) is not None
            },
            sums=sums,
            process_group=process_group,
            reduce=reduce,
            sequence_parallel=sequence_parallel,
        )

    def step_normalizer(
        self,
        masks: Tensor | Sequence[Tensor],
        *,
        old_log_probs: Tensor | Sequence[Tensor] | None = None,
        rollout_log_probs: Tensor | Sequence[Tensor] | None = None,
        **options: Any,
    ) -> Normalizer:
        """`count_step` under the names of its first release (plural): kept for the documented API."""
        return self.count_step(masks, old_log_prob=old_log_probs, rollout_log_prob=rollout_log_probs, **options)

    def corrected(
        self, batch: TokenBatch, normalizer: Normalizer | None
    ) -> tuple[TokenBatch, Normalizer, Corrected | None]:
        """The prelude of a call, shared with `pgloss.diagnostics.inspect`: the step's counts (this batch
        counted as the whole step by `count_step` when `normalizer` is None) and the rollout correction
        (`correction`) applied, its corrected old log-probs and rejections in the batch.
        Returns (batch, normalizer, the correction's output or None)."""
        if normalizer is None:
            given: dict[str, Any] = {name: getattr(batch, name) for name in OPTIONAL_INPUTS}
            normalizer = self.count_step(batch.mask, old_log_prob=batch.old_log_prob, reduce=False, **given)
        correction = self.correction(batch.rollout_log_prob is not None)
        if correction is None:
            return batch, normalizer, None
        corrected = correction.apply(
            log_prob=batch.log_prob,
            old_log_prob=batch.old_log_prob,
            rollout_log_prob=batch.rollout_log_prob,
            mask=batch.mask,
            seq_advantages=None if correction.off_policy_mask is None else batch.row_advantages,
            weight_mean=correction.weight_mean(normalizer),
            sequence_parallel=batch.sequence_parallel,
        )
        batch = dataclasses.replace(batch, old_log_prob=corrected.old_log_prob).restricted(corrected.mask)
        return batch, normalizer, corrected

    def row_weights(self, batch: TokenBatch, normalizer: Normalizer, parts: tuple[Part, ...] | None = None) -> Tensor:
        """c_i of the aggregation `parts` (None: the plain one, every row with `loss_agg_mode`) with this
        algorithm's constants, `[B]`: the one place the call and `inspect` take the aggregation weights from."""
        rows = {name: getattr(batch, name) for name, spec in OPTIONAL_INPUTS.items() if spec.per == "row"}
        return self._weights(batch.mask, normalizer, batch.group_ids, rows, parts)

    def aggregate(
        self, values: Tensor, mask: Tensor, normalizer: Normalizer, group_ids: Tensor | None = None
    ) -> Tensor:
        """Σ_i c_i Σ_t v_{i,t} · world_size: `[B, T]` per-token `values` (ignored where `mask` is False)
        aggregated as the call aggregates its KL and entropy terms (every row, `loss_agg_mode`), over the
        step's counts."""
        mask = mask.bool()
        rows = self._weights(mask, normalizer, group_ids, {}, None)
        return weighted_sum(torch.where(mask, values, 0.0), rows, normalizer.world_size)

    def _weights(
        self,
        mask: Tensor,
        normalizer: Normalizer,
        group_ids: Tensor | None,
        inputs: dict[str, Tensor | None],
        parts: tuple[Part, ...] | None,
    ) -> Tensor:
        """`parts_row_weights` with this algorithm's constants (`parts` None: every row with `loss_agg_mode`)."""
        return parts_row_weights(
            mask,
            (Part(self.loss_agg_mode),) if parts is None else parts,
            normalizer,
            inputs,
            owner=self.name,
            norm_constant=self.norm_constant,
            group_ids=group_ids,
            delta_l_alpha=self.delta_l_alpha,
        )

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
        """The loss of one (micro-)batch: token tensors `[B, T]`, `advantages` `[B]` or `[B, T]`, `old_log_prob`
        None on-policy (log π_old = sg[log π]); the step's `Normalizer` (`count_step`; none: this batch is the
        whole step); `inputs` from `pgloss.core.inputs.OPTIONAL_INPUTS` (a missing one the configuration
        `needs` is refused, saying why; one it does not read is ignored). Metrics are over this call's valid
        tokens (`pgloss.StepMetrics` combines a step's); the module docstring has the formula."""
        self.check_call(normalizer, inputs)
        split = None if normalizer is None else normalizer.sequence_parallel
        batch = TokenBatch.prepare(log_prob, old_log_prob, advantages, mask, sequence_parallel=split, **inputs)
        batch, normalizer, corrected = self.corrected(batch, normalizer)
        self.check_whole_groups(batch, normalizer)
        terms = self.policy_terms(batch)
        per_token, metrics = terms.per_token, terms.metrics | ({} if corrected is None else corrected.metrics)
        per_token = torch.where(batch.mask, weighted(per_token, corrected, batch.rollout_is_weight), 0.0)
        plain, policy = self.row_weights(batch, normalizer), self.policy_parts()
        rows = plain if policy == (Part(self.loss_agg_mode),) else self.row_weights(batch, normalizer, policy)
        loss = weighted_sum(per_token, rows, normalizer.world_size)
        metrics["pg_loss"] = Stat.loss(loss)
        if self.policy_coef != 1:  # a blend's weight; at 1 no kernel is launched for it
            loss = self.policy_coef * loss
        for term in self.declared_terms:
            value = term.evaluate(batch, corrected)
            metrics |= value.metrics
            if value.per_token is not None:
                weights = plain if term.parts() is None else self.row_weights(batch, normalizer, term.parts())
                total = weighted_sum(value.per_token, weights, normalizer.world_size)
                if term.loss_metric is not None:
                    metrics[term.loss_metric] = Stat.loss(total)
                loss = loss + term.coef * total
        return LossOutput.of(loss, metrics, per_token)

    def check_call(self, normalizer: Normalizer | None, inputs: dict[str, Tensor | None]) -> None:
        """Refuse a call's arguments by name before any arithmetic: a `normalizer` of another type, an
        unknown input, a missing input the configuration `needs` (saying why), a sequence split it cannot take."""
        if normalizer is not None and not isinstance(normalizer, Normalizer):
            raise TypeError(
                f"normalizer must be a pgloss.Normalizer (from algorithm.count_step), got {type(normalizer).__name__}"
            )
        check_names(inputs)
        reasons = self.input_reasons
        for needed in sorted(reasons):
            if inputs.get(needed) is None:
                raise ValueError(f"{self.name} needs {needed} in the call ({reasons[needed]})")
        self.check_sequence_split(None if normalizer is None else normalizer.sequence_parallel)

    def check_whole_groups(self, batch: TokenBatch, normalizer: Normalizer) -> None:
        """Warn (`PartialGroupWarning`) when a loss that contrasts the rows of a group gets part of a group of
        its step: a group of this call with fewer valid tokens than the step counted in it. A value check: on
        tensors the host reads for free (`host_reads`), never a sync."""
        counted = normalizer.group_tokens
        if not self.couples_rows or batch.group_ids is None or counted is None or not host_reads(batch.mask):
            return
        ids = batch.group_ids.long()
        held = torch.zeros_like(counted).index_add_(0, ids, batch.mask.sum(dim=-1, dtype=torch.float64))
        if bool(((held > 0) & (held < counted)).any()):
            warnings.warn(
                f"{self.name} contrasts the rows of a group, but this call holds only part of a group of its step; "
                "that part's loss is computed from the rows it holds. Put whole groups in each micro-batch "
                "(and on each rank)",
                PartialGroupWarning,
                stacklevel=3,
            )

    def from_hidden(self, hidden: Tensor, weight: Tensor, targets: Tensor, **kwargs: Any) -> LossOutput:
        """The same loss computed from hidden states `[B, T, H]` and the output projection `[V, H]`
        without materialising the logits; see [`pgloss.loss_from_hidden`][] for the arguments."""
        from .from_hidden import loss_from_hidden

        return loss_from_hidden(self, hidden, weight, targets, **kwargs)


def _call_signature() -> inspect.Signature:
    """`Algorithm.__call__`'s signature with the optional inputs spelled out (for help() and editors)."""
    signature = inspect.signature(Algorithm.__call__)
    fixed = [p for p in signature.parameters.values() if p.kind != inspect.Parameter.VAR_KEYWORD]
    return signature.replace(parameters=fixed + keyword_parameters())


Algorithm.__call__.__signature__ = _call_signature()  # type: ignore[attr-defined]  # read by inspect.signature
