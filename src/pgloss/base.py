"""The composition every named algorithm shares: an `Algorithm` is a frozen dataclass whose call runs

    1. `TokenBatch.prepare`: checks, float32 upcast, the one effective mask;
    2. the policy term ℓ_{i,t} of its family (`policy_terms`, defined in `losses/<family>.py`);
    3. the rollout correction (`pgloss.rollout.RolloutCorrection`): its weight before the aggregation and
       its rejections in the mask; with only `rollout_log_prob`, truncated importance sampling;
    4. + kl_coef · KL_t(π_θ‖π_ref) (`kl_variants.kl_term`, or the exact `full_kl`) and - entropy_coef · H_t;
    5. `aggregate` with `loss_agg_mode` and the step's `Normalizer`.

A family subclasses `Algorithm` beside its per-token function, adds its hyperparameters as fields
and implements `policy_terms`; `algorithms.py` names the families' configurations.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from .aggregate import AGG_MODES, Normalizer, row_weights, weighted_sum
from .batch import TokenBatch
from .checks import check_fields
from .kl_variants import FULL, KL_CORRECTIONS, KL_OPTIONS, kl_term
from .metrics import masked_mean
from .rollout import RolloutCorrection


@dataclass(frozen=True)
class LossOutput:
    """`loss`: scalar with grad. `metrics`: detached 0-d tensors. `per_token`: the `[B, T]` policy term ℓ."""

    loss: Tensor
    metrics: dict[str, Tensor]
    per_token: Tensor


@dataclass(frozen=True)
class PolicyTerms:
    """What a family's policy term hands back to `Algorithm.__call__`."""

    per_token: Tensor
    metrics: dict[str, Tensor] = field(default_factory=dict)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _seq_advantages(batch: TokenBatch) -> Tensor:
    """Â_i: the `[B]` advantages, or the mean over a row's valid tokens of `[B, T]` ones."""
    if batch.seq_advantages is not None:
        return batch.seq_advantages
    return (batch.advantages * batch.mask).sum(dim=-1) / batch.mask.sum(dim=-1).clamp(min=1)


@dataclass(frozen=True, kw_only=True)
class Algorithm:
    """Fields shared by every algorithm; a subclass adds its family's hyperparameters."""

    name: str = "custom"
    loss_agg_mode: str = "token-mean"
    """How per-token values become the loss (`aggregate.AGG_MODES`)."""
    norm_constant: float | None = None
    """The fixed divisor C of `seq-mean-token-sum-norm` (Dr.GRPO: the generation budget). Required there."""
    kl_coef: float = 0.0
    """β of the KL loss term β·KL(π_θ‖π_ref); 0 disables it and the reference model."""
    kl_estimator: str = "k3"
    """The KL term: k1, abs, k2, k3 on the sampled token; "k1+" ... "k3+": that value with k2's gradient
    (verl); "full": the exact KL over the vocabulary, passed as `full_kl` (`pgloss.full_kl`)."""
    kl_correction: str | None = None
    """None, "ratio_weighted" (KL·r, r differentiable: TRL's use_bias_correction_kl) or "unbiased_gradient"
    (value kept, k2's gradient weighted by sg[min(r, kl_correction_cap)]: OpenRLHF); `kl_variants.py`."""
    kl_correction_cap: float = 10.0
    """The cap of the detached ratio weight of kl_correction="unbiased_gradient" (OpenRLHF's 10)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; the entropy gets a gradient only when this is non-zero."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to ±max_log_ratio before exp (zero gradient beyond)."""
    max_kl: float = 10.0
    """The k3 estimate is clamped to ±max_kl, as verl does (zero gradient beyond)."""
    rollout_is_cap: float = 2.0
    """Cap of the truncated importance weight min(π_old/π_rollout, cap), used when rollout_log_prob is given
    and there is no rollout_correction: `RolloutCorrection(upper=rollout_is_cap)`."""
    rollout_correction: RolloutCorrection | None = None
    """The rollout correction beside the loss (`pgloss.rollout`): its weight multiplies the policy term (and
    the KL term when `weight_kl`) before the aggregation; its rejections enter the mask."""
    scale_rewards: bool = True
    """Whether the paper's group advantages divide by the group std (`advantages.group_advantages(scale=)`)."""
    dynamic_sampling: bool = False
    """Whether the paper drops groups whose rewards are all equal (`advantages.dynamic_sampling_keep`)."""

    couples_rows: ClassVar[bool] = False
    """True when ℓ of a row depends on other rows of the call (a token selection over the batch, a
    group contrast): the fused path then takes one call for the batch, and split invariance needs
    calls that hold whole groups."""
    consumes_rollout_log_prob: ClassVar[bool] = False
    """True when the family uses `rollout_log_prob` itself, instead of the truncated IS weight."""
    required_inputs: ClassVar[tuple[str, ...]] = ()
    """Optional call arguments this family cannot do without (e.g. "scores", "group_ids")."""

    @property
    def fixed_agg_mode(self) -> str | None:
        """The loss_agg_mode the family's definition requires, or None when any mode is allowed."""
        return None

    def __post_init__(self) -> None:
        check_fields(self)
        _check(self.loss_agg_mode in AGG_MODES, f"loss_agg_mode must be one of {AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.fixed_agg_mode is not None:
            _check(
                self.loss_agg_mode == self.fixed_agg_mode,
                f"{self.name} defines its loss over {'groups' if 'group' in self.fixed_agg_mode else 'sequences'} "
                f"and fixes loss_agg_mode={self.fixed_agg_mode!r}; got {self.loss_agg_mode!r}",
            )
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            _check(
                self.norm_constant is not None and self.norm_constant > 0,
                f"loss_agg_mode 'seq-mean-token-sum-norm' requires norm_constant > 0 (the generation budget, "
                f"e.g. max_new_tokens), got {self.norm_constant!r}",
            )
        _check(self.kl_estimator in KL_OPTIONS, f"kl_estimator must be one of {KL_OPTIONS}, got {self.kl_estimator!r}")
        _check(self.kl_correction is None or self.kl_correction in KL_CORRECTIONS,
               f"kl_correction must be None or one of {KL_CORRECTIONS}, got {self.kl_correction!r}")
        _check(not (self.kl_estimator == FULL and self.kl_correction is not None),
               f"kl_estimator='full' is exact and takes no kl_correction, got {self.kl_correction!r}")
        _check(self.kl_correction_cap > 0, f"kl_correction_cap must be > 0, got {self.kl_correction_cap}")
        _check(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        _check(self.max_log_ratio > 0, f"max_log_ratio must be > 0, got {self.max_log_ratio}")
        _check(self.max_kl > 0, f"max_kl must be > 0, got {self.max_kl}")
        _check(self.rollout_is_cap > 0, f"rollout_is_cap must be > 0, got {self.rollout_is_cap}")
        if self.rollout_correction is not None and not isinstance(self.rollout_correction, RolloutCorrection):
            raise TypeError(f"rollout_correction must be a pgloss.rollout.RolloutCorrection or None, "
                            f"got {type(self.rollout_correction).__name__}")
        _check(self.rollout_correction is None or not self.consumes_rollout_log_prob,
               f"{self.name} uses the rollout log-probs in its own weight; it takes no rollout_correction")

    def correction(self, has_rollout: bool) -> RolloutCorrection | None:
        """The rollout correction of a call: `rollout_correction`, or, when only rollout log-probs are
        given, truncated importance sampling min(π_old/π_rollout, rollout_is_cap) (Yao et al. 2025).
        A family that uses the rollout log-probs itself (`consumes_rollout_log_prob`) gets none."""
        if self.rollout_correction is not None:
            return self.rollout_correction
        if not has_rollout or self.consumes_rollout_log_prob:
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

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        """The per-token policy term ℓ_{i,t} (zero at masked positions is not required) and its metrics."""
        raise NotImplementedError

    def __call__(
        self,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        mask: Tensor,
        *,
        ref_log_prob: Tensor | None = None,
        entropy: Tensor | None = None,
        rollout_log_prob: Tensor | None = None,
        normalizer: Normalizer | None = None,
        group_ids: Tensor | None = None,
        scores: Tensor | None = None,
        full_kl: Tensor | None = None,
    ) -> LossOutput:
        """The loss of one (micro-)batch. Token tensors `[B, T]`, `advantages` `[B]` or `[B, T]`.

        Pass the step's `Normalizer` when the step has several micro-batches or ranks; without it
        this batch is the whole step (counted locally, even under torch.distributed).
        `group_ids` `[B]` is needed by `group-mean-token-mean` (and by REAL); `scores` `[B]`, the raw
        sequence rewards, by TOPR; `full_kl` `[B, T]`, the exact KL with its gradient
        (`pgloss.full_kl_from_logits` / `full_kl_from_hidden`), by kl_estimator="full". The metrics
        are means over this call's valid tokens; average them over micro-batches and ranks for a
        step's figure.
        """
        if normalizer is not None and not isinstance(normalizer, Normalizer):
            raise TypeError(f"normalizer must be a pgloss.Normalizer (from Normalizer.count), got {type(normalizer).__name__}")
        if self.uses_full_kl and full_kl is None:
            raise ValueError(f"{self.name} has kl_estimator='full' and kl_coef={self.kl_coef} and needs full_kl=[B, T] "
                             f"(pgloss.full_kl_from_logits or full_kl_from_hidden)")
        if self.uses_reference and not self.uses_full_kl and ref_log_prob is None:
            raise ValueError(f"{self.name} has kl_coef={self.kl_coef} and needs ref_log_prob")
        given = {"group_ids": group_ids, "scores": scores}
        for needed in self.required_inputs:
            if given.get(needed) is None:
                raise ValueError(f"{self.name} needs {needed}=[B] in the call")
        if self.entropy_coef != 0 and entropy is None:
            raise ValueError(f"{self.name} has entropy_coef={self.entropy_coef} and needs entropy")
        batch = TokenBatch.prepare(
            log_prob, old_log_prob, advantages, mask,
            ref_log_prob=ref_log_prob, entropy=entropy, rollout_log_prob=rollout_log_prob, group_ids=group_ids,
            scores=scores, full_kl=full_kl,
        )
        corrected, correction = None, self.correction(batch.rollout_log_prob is not None)
        if correction is not None:
            corrected = correction.apply(
                log_prob=batch.log_prob, old_log_prob=batch.old_log_prob, rollout_log_prob=batch.rollout_log_prob,
                mask=batch.mask, seq_advantages=_seq_advantages(batch),
                weight_mean=getattr(normalizer, "weight_mean", None), whole_step=normalizer is None)
            batch = dataclasses.replace(batch, old_log_prob=corrected.old_log_prob, mask=corrected.mask)
        mask = batch.mask
        terms = self.policy_terms(batch)
        per_token = terms.per_token
        metrics = dict(terms.metrics)
        if corrected is not None:  # the weight enters before the aggregation
            metrics |= corrected.metrics
            if corrected.weight is not None:
                per_token = per_token * corrected.weight
        per_token = torch.where(mask, per_token, 0.0)
        if normalizer is None:  # this batch is the whole step: count it once for every term
            counted = mask if corrected is None else corrected.count_mask
            normalizer = Normalizer.count(counted, group_ids=batch.group_ids, reduce=False)

        rows = row_weights(mask, self.loss_agg_mode, normalizer, norm_constant=self.norm_constant,
                           group_ids=batch.group_ids)

        def reduce(masked_values: Tensor) -> Tensor:
            return weighted_sum(masked_values, rows, normalizer.world_size)

        loss = reduce(per_token)
        metrics["pg_loss"] = loss.detach()
        kl = None
        if self.kl_estimator == FULL:
            kl = batch.full_kl
        elif batch.ref_log_prob is not None:
            kl = kl_term(batch.log_prob, batch.ref_log_prob, batch.old_log_prob, estimator=self.kl_estimator,
                         correction=self.kl_correction, correction_cap=self.kl_correction_cap,
                         max_log_ratio=self.max_log_ratio, max_kl=self.max_kl)
        if kl is not None:
            kl = torch.where(mask, kl, 0.0)
            metrics["kl"] = masked_mean(kl, mask)
            if self.kl_coef != 0:
                if corrected is not None and corrected.weight is not None and correction.weight_kl:
                    kl = kl * corrected.weight
                kl_loss = reduce(kl)
                metrics["kl_loss"] = kl_loss.detach()
                loss = loss + self.kl_coef * kl_loss
        if batch.entropy is not None:
            metrics["entropy"] = masked_mean(batch.entropy, mask)
            if self.entropy_coef != 0:
                loss = loss - self.entropy_coef * reduce(batch.entropy)
        return LossOutput(loss=loss, metrics=metrics, per_token=per_token)

    def from_hidden(self, hidden: Tensor, weight: Tensor, targets: Tensor, **kwargs: Any) -> LossOutput:
        """The same loss computed from hidden states `[B, T, H]` and the output projection `[V, H]`
        without materialising the logits; see `pgloss.fused.loss_from_hidden` for the arguments."""
        from .fused import loss_from_hidden

        return loss_from_hidden(self, hidden, weight, targets, **kwargs)

    def describe(self) -> dict[str, Any]:
        """The hyperparameters as a plain dict (for printing and for run configs)."""
        return dataclasses.asdict(self)


