"""Rollout correction: the inference engine sampled from π_rollout, not from the trainer's π_old.

One explicit configuration beside the loss (`RolloutCorrection`), composable with every
algorithm: its weight multiplies the per-token loss before the aggregation, its rejections
enter the one effective mask, and both use the loss's mask and the step's normaliser.

With π_train = π_old (decoupled mode) or sg(π_θ) (bypass mode, where π_old := π_rollout), the
log-ratio of a valid token is log ρ_t = clamp(log π_train - log π_rollout, ±max_log_ratio) and

    weight level        w                                            used by
    token               ρ_t                                          verl `rollout_is=token`, TRL/ms-swift `token_*`
    sequence_product    exp(clamp(Σ_t log ρ_t, ±max_log_ratio))      verl `rollout_is=sequence`, TRL `sequence_*`,
                                                                     ROLL `sequence`
    sequence_geometric  exp(Σ_t log ρ_t / |y_i|)                     ms-swift `sequence_*`, OpenRLHF `seq`,
                                                                     ROLL `geometric`
    segment_geometric   exp(Σ_{t∈s} log ρ_t / |s|), s the token's    ROLL `segment` (`weight_type`)
                        segment (a run of consecutive valid tokens)

then, with bounds [lower, upper] (either may be None: unbounded),

    truncate (TIS, Yao et al. 2025)   w ← clamp(w, lower, upper)
    mask (IcePop)                     w ← w · 1[lower ≤ w ≤ upper]

detached. The sequence weight is a separate choice from GSPO's sequence ratio: a product of
ratios collapses or explodes on long sequences, the geometric mean does not.

Rejected tokens (the KL-based rejection and the off-policy sequence mask: `pgloss.correction.rejection`;
the probability gates: `pgloss.correction.gating`) leave the effective mask: the loss's numerator and every
metric. The normaliser counts what the caller counted. Rejections known before the step (the KL rules and the gates in decoupled mode,
on π_old and π_rollout) can leave it too: without a `Normalizer` the call counts the mask after
them (verl: the response mask is multiplied), and so does a step's `Normalizer` counted on
`keep_mask(...)` (`RolloutCorrection.normalizer`); one counted on the original masks keeps them in
the denominator (AReaL). Masks that depend on π_θ (the off-policy mask; the rejection in bypass
mode) cannot be counted before the step: their tokens get zero weight but stay in the denominator,
as TRL's off-policy mask does, so the loss does not depend on how the step is cut.

Batch normalisation (verl `rollout_is_batch_normalize`): w ← w / mean(w), the mean over the step's
valid tokens (token and segment levels) or non-empty sequences (sequence levels), global over micro-batches and
ranks: the step's count carries the sums (`step_count_inputs`, in `Normalizer.sums`), so the loss stays split-invariant.

`Algorithm.count_step(...)` counts a step with its correction: a `Normalizer` counted on the kept masks (or on
the original ones, `count_rejected=True`, as AReaL) that also carries the step's weight sums, in the same two
all-reduces as every count (`step_count_inputs`); pass it to every micro-batch's loss call.
`RolloutCorrection.normalizer(...)` is the same count for a correction alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.batch import check_device, check_mask, check_tensor, compute_dtype, per_micro_batch
from ..core.checks import check_log_prob, check_number
from ..core.metrics import Stat, token_fraction
from ..core.normalizer import Normalizer
from ..core.sequence_parallel import (
    SequenceParallel,
    row_lengths,
    row_total_and_length,
)
from .gating import Gate, segment_mean
from .mismatch import mismatch_metrics
from .rejection import Rejection, off_policy_sequence_mask
from .weight_stats import mean_of, row_max, weight_metrics

WEIGHT_LEVELS = ("token", "sequence_product", "sequence_geometric", "segment_geometric")
PER_TOKEN_LEVELS = ("token", "segment_geometric")
"""Weight levels whose weight varies along a row: counted per valid token (`batch_normalize`, metrics)."""
WEIGHT_MODES = ("truncate", "mask")


@dataclass(frozen=True)
class Corrected:
    """What a correction hands to the loss: the old log-probs the loss's ratio uses, the detached
    weight `[B, T]` (None: no weight), the effective mask, and its metrics (`Stat`s of detached 0-d values)."""

    old_log_prob: Tensor
    weight: Tensor | None
    mask: Tensor
    metrics: dict[str, Stat]
    weight_kl: bool = False
    """Whether the weight also multiplies the KL term (`RolloutCorrection.weight_kl`)."""


WEIGHT_SUM = "rollout_is_weight"
"""The key of the step's (Σ w, count) in `Normalizer.sums`, for `batch_normalize`."""


@dataclass(frozen=True, kw_only=True)
class RolloutCorrection:
    """Rollout correction beside the loss (see the module docstring for the formulas).

    `RolloutCorrection()` is token-level truncated importance sampling with cap 2 (verl's default).
    """

    weight_level: str | None = "token"
    """token | sequence_product | sequence_geometric | segment_geometric; None: no importance weight (masks only)."""
    weight_mode: str = "truncate"
    """truncate (TIS: clamp to the bounds) or mask (IcePop: zero outside the bounds)."""
    lower: float | None = None
    """Lower bound of the weight; None: unbounded below (TIS as verl, TRL, ms-swift)."""
    upper: float | None = 2.0
    """Upper bound of the weight; None: unbounded above."""
    rejection: tuple[Rejection, ...] = ()
    """KL-based rejection rules, all applied (AND)."""
    gates: tuple[Gate, ...] = ()
    """Probability gates (binary KL, total variation, probability difference: `pgloss.correction.gating`), all
    applied (AND) with the rejection rules."""
    off_policy_mask: float | None = None
    """δ of off-policy sequence masking (DeepSeek-V3.2); None disables it."""
    bypass: bool = False
    """π_old := π_rollout: the loss's ratio is against the rollout, the weight uses sg(π_θ)/π_rollout."""
    batch_normalize: bool = False
    """Divide the weights by their mean over the step (`step_weight_mean`)."""
    weight_kl: bool = False
    """Whether the weight also multiplies the KL term (TRL and Liger: no; ms-swift: yes)."""
    max_log_ratio: float = 20.0
    """log ρ (and a sequence's summed log ρ) is clamped to ±max_log_ratio before exp."""

    def __post_init__(self) -> None:
        if self.weight_level is not None and self.weight_level not in WEIGHT_LEVELS:
            raise ValueError(f"weight_level must be one of {WEIGHT_LEVELS} or None, got {self.weight_level!r}")
        if self.weight_mode not in WEIGHT_MODES:
            raise ValueError(f"weight_mode must be one of {WEIGHT_MODES}, got {self.weight_mode!r}")
        lower = check_number("lower", self.lower, optional=True)
        upper = check_number("upper", self.upper, optional=True)
        if lower is not None and lower < 0 or upper is not None and upper <= 0:
            raise ValueError(f"need lower >= 0 and upper > 0 (weights are ratios), got lower={lower}, upper={upper}")
        if lower is not None and upper is not None and lower > upper:
            raise ValueError(f"need lower <= upper, got lower={lower}, upper={upper}")
        if self.weight_level is not None and self.weight_mode == "mask" and lower is None and upper is None:
            raise ValueError("weight_mode 'mask' needs a lower or an upper bound")
        rejection = tuple(self.rejection) if isinstance(self.rejection, (list, tuple)) else self.rejection
        if not isinstance(rejection, tuple) or not all(isinstance(r, Rejection) for r in rejection):
            raise TypeError(f"rejection must be a tuple of pgloss.Rejection, got {self.rejection!r}")
        gates = tuple(self.gates) if isinstance(self.gates, (list, tuple)) else self.gates
        if not isinstance(gates, tuple) or not all(isinstance(g, Gate) for g in gates):
            raise TypeError(f"gates must be a tuple of pgloss.correction.gating.Gate, got {self.gates!r}")
        delta = check_number("off_policy_mask", self.off_policy_mask, optional=True)
        if delta is not None and delta < 0:
            raise ValueError(f"off_policy_mask must be >= 0 (a KL threshold), got {delta}")
        for name in ("bypass", "batch_normalize", "weight_kl"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        max_log_ratio = check_number("max_log_ratio", self.max_log_ratio, optional=False)
        if max_log_ratio <= 0:
            raise ValueError(f"max_log_ratio must be > 0, got {max_log_ratio}")
        if self.batch_normalize and self.weight_level is None:
            raise ValueError("batch_normalize needs a weight_level")
        if self.batch_normalize and self.bypass:
            raise ValueError(
                "batch_normalize cannot be combined with bypass: the weight then depends on π_θ, "
                "so its mean over the step is not known before the step"
            )
        for name, value in (
            ("lower", lower),
            ("upper", upper),
            ("rejection", rejection),
            ("gates", gates),
            ("off_policy_mask", delta),
            ("max_log_ratio", max_log_ratio),
        ):
            object.__setattr__(self, name, value)

    @property
    def needs_rollout(self) -> bool:
        """True when the correction needs `rollout_log_prob` (everything but a lone off-policy mask)."""
        return self.weight_level is not None or self.rejects or self.bypass

    @property
    def rejects(self) -> bool:
        """True when the correction has rejection rules or gates (`kept`)."""
        return bool(self.rejection) or bool(self.gates)

    # -- the pieces -------------------------------------------------------------------------------

    def _log_rho(self, train: Tensor, rollout: Tensor, mask: Tensor) -> Tensor:
        return torch.where(mask, (train - rollout).clamp(-self.max_log_ratio, self.max_log_ratio), 0.0)

    def _raw_weight(
        self, train: Tensor, rollout: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None
    ) -> Tensor:
        """The unbounded weight ρ, `[B, T]` (sequence levels broadcast over the row, their sums over the whole
        sequence under a `sequence_parallel` group)."""
        if self.weight_level == "token":
            return torch.exp(self._log_rho(train, rollout, mask))
        if self.weight_level == "segment_geometric":
            mean = segment_mean(torch.where(mask, train - rollout, 0.0), mask, sequence_parallel)
            return torch.exp(mean.clamp(-self.max_log_ratio, self.max_log_ratio))
        total, length = row_total_and_length(
            torch.where(mask, train - rollout, 0.0), mask, sequence_parallel, keepdim=True
        )
        if self.weight_level == "sequence_geometric":
            total = total / length.clamp(min=1)
        return torch.exp(total.clamp(-self.max_log_ratio, self.max_log_ratio)).expand(mask.shape)

    def _bound(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        """(bounded weight, out-of-band flags)."""
        out = torch.zeros_like(raw, dtype=torch.bool)
        if self.lower is not None:
            out = out | (raw < self.lower)
        if self.upper is not None:
            out = out | (raw > self.upper)
        if self.weight_mode == "mask":
            return torch.where(out, 0.0, raw), out
        if self.lower is None and self.upper is None:
            return raw, out
        return raw.clamp(min=self.lower, max=self.upper), out

    def keep_mask(
        self,
        mask: Tensor,
        old_log_prob: Tensor,
        rollout_log_prob: Tensor,
        sequence_parallel: SequenceParallel | None = None,
    ) -> Tensor:
        """The mask after the KL-based rejection, known before the step (decoupled mode): count a
        step's `Normalizer` on these to leave rejected tokens out of the denominator."""
        if self.bypass and self.rejects:
            raise ValueError("with bypass the rejection depends on π_θ; count the Normalizer on the original masks")
        ((mask, old_log_prob, rollout_log_prob),) = _micro_batches(
            mask, old_log_prob, rollout_log_prob, names=("mask", "old_log_prob", "rollout_log_prob")
        )
        dtype = compute_dtype(old_log_prob.dtype)  # the loss call's arithmetic, so both see one mask
        return self.kept(old_log_prob.detach().to(dtype), rollout_log_prob.detach().to(dtype), mask, sequence_parallel)

    def kept(
        self, train: Tensor, rollout: Tensor, mask: Tensor, sequence_parallel: SequenceParallel | None = None
    ) -> Tensor:
        """The tokens the KL-based rejection and the gates keep, bool `[B, T]`: mask ∧ keep_1 ∧ … ∧ keep_n,
        where every rule (and gate) computes its statistic over the original `mask` (a sequence rule after a token rule
        averages over the sequence's valid tokens, not over the ones the token rule kept), as verl's
        `compute_rollout_rejection_mask`. The one rule the step's count (`keep_mask`) and the call
        (`apply`) use."""
        log_rho = self._log_rho(train, rollout, mask)
        keep = mask
        for rule in self.rejection:
            keep = keep & rule.keep(log_rho, mask, sequence_parallel)
        for gate in self.gates:
            keep = keep & gate.keep(train, rollout, mask, sequence_parallel)
        return keep

    def _weight_totals(
        self,
        masks: Sequence[Tensor],
        old_log_probs: Sequence[Tensor],
        rollout_log_probs: Sequence[Tensor],
        sequence_parallel: SequenceParallel | None,
    ) -> Tensor:
        """(Σ w, n) of the bounded weight over the valid tokens (token level) or the non-empty sequences
        (sequence levels) of checked micro-batches (`masks` bool), on this rank, float64."""
        totals = torch.zeros(2, dtype=torch.float64, device=masks[0].device)
        for mask, old, rollout in zip(masks, old_log_probs, rollout_log_probs, strict=True):
            weight, _ = self._bound(
                self._raw_weight(old.detach().double(), rollout.detach().double(), mask, sequence_parallel)
            )
            if self.weight_level in PER_TOKEN_LEVELS:  # per row, then over the sequence group: every token once
                totals += torch.stack(
                    row_total_and_length(torch.where(mask, weight, 0.0), mask, sequence_parallel)
                ).sum(dim=-1)
            else:  # a sequence weight is the same on every rank of the sequence group: each sequence once
                rows = row_lengths(mask, sequence_parallel) > 0
                totals += torch.stack([torch.where(rows, row_max(weight)[:, 0], 0.0).sum(), rows.sum().double()])
        return totals

    def weight_mean(self, normalizer: Normalizer) -> Tensor | None:
        """The step's mean bounded weight, from the sums the step's count carries (`step_count_inputs`); None
        without `batch_normalize`, or from a Normalizer that did not count them."""
        totals = normalizer.sums.get(WEIGHT_SUM) if self.batch_normalize else None
        return None if totals is None else mean_of(totals)

    def step_count_inputs(
        self,
        masks: Tensor | Sequence[Tensor],
        old_log_probs: Tensor | Sequence[Tensor],
        rollout_log_probs: Tensor | Sequence[Tensor],
        *,
        count_rejected: bool = False,
        sequence_parallel: SequenceParallel | None = None,
        names: tuple[str, str, str] = ("masks", "old_log_probs", "rollout_log_probs"),
    ) -> tuple[list[Tensor], dict[str, Tensor]]:
        """What the step's count reads of this correction: the masks it counts (after the KL-based rejection,
        known before the step; the original ones with `count_rejected=True`, as AReaL, or in bypass mode) and
        this rank's share of the step-wide sums (with `batch_normalize`, (Σ w, n) of the bounded weight).
        `Algorithm.count_step` passes both to `Normalizer.count`."""
        parts = _micro_batches(masks, old_log_probs, rollout_log_probs, names=names)
        mask_list, olds, rollouts = (list(column) for column in zip(*parts, strict=True))
        counted = (
            mask_list
            if count_rejected or self.bypass or not self.rejects
            else [self.keep_mask(m, o, r, sequence_parallel) for m, o, r in zip(mask_list, olds, rollouts, strict=True)]
        )
        if not self.batch_normalize:
            return counted, {}
        return counted, {WEIGHT_SUM: self._weight_totals(mask_list, olds, rollouts, sequence_parallel)}

    def step_weight_mean(
        self,
        masks: Tensor | Sequence[Tensor],
        old_log_probs: Tensor | Sequence[Tensor],
        rollout_log_probs: Tensor | Sequence[Tensor],
        *,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
    ) -> Tensor:
        """The mean bounded weight over the step's micro-batches (and, when torch.distributed is
        initialized and `reduce`, all ranks of `process_group`): over valid tokens at token level,
        over non-empty sequences at the sequence levels. A collective, like `Normalizer.count`
        (`sequence_parallel` as there). The step's count carries it (`weight_mean`)."""
        if self.weight_level is None:
            raise ValueError("step_weight_mean needs a weight_level")
        parts = _micro_batches(masks, old_log_probs, rollout_log_probs)
        mask_list, olds, rollouts = (list(column) for column in zip(*parts, strict=True))
        totals = self._weight_totals(mask_list, olds, rollouts, sequence_parallel)
        counted = Normalizer.count(
            mask_list,
            sums={WEIGHT_SUM: totals},
            process_group=process_group,
            reduce=reduce,
            sequence_parallel=sequence_parallel,
        )
        return mean_of(counted.sums[WEIGHT_SUM])

    def normalizer(
        self,
        masks: Tensor | Sequence[Tensor],
        old_log_probs: Tensor | Sequence[Tensor],
        rollout_log_probs: Tensor | Sequence[Tensor],
        *,
        group_ids: Tensor | Sequence[Tensor] | None = None,
        count_rejected: bool = False,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        sequence_parallel: SequenceParallel | None = None,
    ) -> Normalizer:
        """The step's counts over the masks after the KL-based rejection (`count_rejected=True`, or
        bypass mode: over the original masks), with the step's weight sums when `batch_normalize`
        (`weight_mean`). A collective under torch.distributed, like `Normalizer.count` (and
        `sequence_parallel` as there). `Algorithm.count_step` counts the same, with the algorithm's own
        counts beside."""
        counted, sums = self.step_count_inputs(
            masks, old_log_probs, rollout_log_probs, count_rejected=count_rejected, sequence_parallel=sequence_parallel
        )
        return Normalizer.count(
            counted,
            group_ids=group_ids,
            sums=sums,
            process_group=process_group,
            reduce=reduce,
            sequence_parallel=sequence_parallel,
        )

    # -- the call -------------------------------------------------------------------------------

    def apply(
        self,
        *,
        log_prob: Tensor,
        old_log_prob: Tensor,
        rollout_log_prob: Tensor | None,
        mask: Tensor,
        seq_advantages: Tensor | None = None,
        weight_mean: Tensor | None = None,
        sequence_parallel: SequenceParallel | None = None,
    ) -> Corrected:
        """Correct one (micro-)batch. Inputs `[B, T]` already checked and zeroed at masked positions
        (`TokenBatch.prepare`); `seq_advantages` `[B]` (needed by the off-policy mask).
        `weight_mean`: the step's mean weight (`step_weight_mean`, carried by the step's normalizer),
        required by `batch_normalize`. `sequence_parallel`: the sequence group of split rows (the step's
        normalizer's): every sequence statistic is then over the whole sequence."""
        rollout = None if rollout_log_prob is None else rollout_log_prob.detach()
        if rollout is None and self.needs_rollout:
            raise ValueError("this rollout correction needs rollout_log_prob (the inference engine's log-probs)")
        if weight_mean is not None and not self.batch_normalize:
            raise ValueError("weight_mean was given but batch_normalize is False")
        if self.batch_normalize and weight_mean is None:
            raise ValueError(
                "batch_normalize needs the step's mean weight: count the step with "
                "algorithm.count_step(...) (or its alias algorithm.step_normalizer) and pass that normalizer"
            )
        # without rollout log-probs: neither bypass nor a weight (needs_rollout, refused above)
        old = rollout if self.bypass and rollout is not None else old_log_prob.detach()
        train = log_prob.detach() if self.bypass else old
        effective = mask
        metrics: dict[str, Stat] = {}
        count = mask.sum()
        if rollout is not None:
            metrics |= mismatch_metrics(train, rollout, mask, sequence_parallel)
            if self.rejects:
                effective = self.kept(train, rollout, mask, sequence_parallel)
                metrics["rollout_rejected_frac"] = token_fraction(~effective, mask, count)
        if self.off_policy_mask is not None:
            if seq_advantages is None:
                raise ValueError("off_policy_mask needs advantages")
            behave = old_log_prob.detach() if rollout is None else rollout
            opsm = off_policy_sequence_mask(
                log_prob, behave, seq_advantages, mask, delta=self.off_policy_mask, sequence_parallel=sequence_parallel
            )
            metrics["rollout_opsm_frac"] = token_fraction(~opsm, mask, count)
            effective = effective & opsm
        weight = None
        if self.weight_level is not None and rollout is not None:
            weight, out = self._bound(self._raw_weight(train, rollout, mask, sequence_parallel))
            metrics["rollout_is_bounded_frac"] = token_fraction(out, effective)
            if weight_mean is not None:  # batch_normalize (checked above)
                weight = weight / weight_mean.to(weight.dtype).clamp(min=torch.finfo(weight.dtype).tiny)
            weight = torch.where(effective, weight, 0.0).detach()
            metrics |= weight_metrics(weight, effective, per_sequence=self.weight_level not in PER_TOKEN_LEVELS)
        return Corrected(old_log_prob=old, weight=weight, mask=effective, metrics=metrics, weight_kl=self.weight_kl)


def _micro_batches(
    masks: Tensor | Sequence[Tensor],
    old_log_probs: Tensor | Sequence[Tensor],
    rollout_log_probs: Tensor | Sequence[Tensor],
    *,
    names: tuple[str, str, str] = ("masks", "old_log_probs", "rollout_log_probs"),
) -> list[tuple[Tensor, Tensor, Tensor]]:
    """(bool mask, old, rollout) per micro-batch, checked as a loss call checks them: one tensor of
    each per micro-batch, floating `[B, T]` log-probs of the mask's shape and device, at most 0 at
    valid positions (a value check)."""
    mask_name, old_name, rollout_name = names
    masks = per_micro_batch(mask_name, masks)
    olds = per_micro_batch(old_name, old_log_probs, len(masks))
    rollouts = per_micro_batch(rollout_name, rollout_log_probs, len(masks))
    out = []
    for k, (mask, old, rollout) in enumerate(zip(masks, olds, rollouts, strict=True)):
        at = "" if len(masks) == 1 else f"[{k}]"
        mask = check_tensor(f"{mask_name}{at}", mask, ndim=(2,), floating=False)
        mask = check_mask(mask, mask.shape, mask.device)
        for name, value in ((f"{old_name}{at}", old), (f"{rollout_name}{at}", rollout)):
            check_tensor(name, value, ndim=(2,))
            if value.shape != mask.shape:
                raise ValueError(
                    f"{name} must have the shape of its mask {tuple(mask.shape)}, got {tuple(value.shape)}"
                )
            check_device(name, value, mask.device, reference=f"{mask_name}{at}")
            check_log_prob(name, value, mask)
        out.append((mask, old, rollout))
    return out
