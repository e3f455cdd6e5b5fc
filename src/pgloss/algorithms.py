"""The named algorithms: frozen configurations composed from ratios, per-token losses, KL,
entropy and aggregation.

An `Algorithm` is a frozen dataclass. Calling it runs

    1. `TokenBatch.prepare`: checks, float32 upcast, the one effective mask;
    2. the policy term ℓ_{i,t} of its family (`policy_terms`);
    3. optional truncated importance sampling against the rollout engine's log-probs;
    4. + kl_coef · KL_t(π_θ‖π_ref) and - entropy_coef · H_t;
    5. `aggregate` with `loss_agg_mode` and the step's `Normalizer`.

`get(name, **hyperparameters)` returns the algorithm with its paper's defaults (the `NAMED` table);
see docs/reference.md for the formulas and the mapping onto verl's and TRL's options.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .aggregate import AGG_MODES, Normalizer, row_weights, weighted_sum
from .batch import TokenBatch
from .kl import KL_ESTIMATORS, kl_estimate
from .losses.cispo import cispo_loss, cispo_weight
from .losses.fipo import fipo_influence
from .losses.ppo import clipped_surrogate
from .losses.sapo import sapo_gate
from .metrics import clip_metrics, masked_mean, ratio_metrics
from .ratios import RATIO_LEVELS, importance_ratio, log_ratio


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


@functools.cache
def _field_types(cls: type) -> dict[str, tuple[type, bool]]:
    """Each field's base type (float, int, bool, str) and whether None is allowed."""
    out = {}
    for name, hint in typing.get_type_hints(cls).items():
        args = typing.get_args(hint)
        optional = type(None) in args
        base = next((a for a in args if a is not type(None)), hint) if args else hint
        out[name] = (base, optional)
    return out


def _checked_value(name: str, value: Any, kind: type, optional: bool) -> Any:
    """`value` as a `kind`; TypeError for the wrong type, ValueError for a non-finite number."""
    if value is None and optional:
        return None
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number{' or None' if optional else ''}, "
                            f"got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        return float(value)
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
        return int(value)
    if kind in (bool, str) and not isinstance(value, kind):
        raise TypeError(f"{name} must be a {kind.__name__}, got {value!r} ({type(value).__name__})")
    return value


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
    """Which per-token KL estimator the KL term uses: k1, abs, k2, k3."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus; the entropy gets a gradient only when this is non-zero."""
    max_log_ratio: float = 20.0
    """Log-ratios are clamped to ±max_log_ratio before exp (zero gradient beyond)."""
    max_kl: float = 10.0
    """The k3 estimate is clamped to ±max_kl, as verl does (zero gradient beyond)."""
    rollout_is_cap: float = 2.0
    """Cap of the truncated importance weight min(π_old/π_rollout, cap), used when rollout_log_prob is given."""
    scale_rewards: bool = True
    """Whether the paper's group advantages divide by the group std (`advantages.group_advantages(scale=)`)."""
    dynamic_sampling: bool = False
    """Whether the paper drops groups whose rewards are all equal (`advantages.dynamic_sampling_keep`)."""

    @property
    def fixed_agg_mode(self) -> str | None:
        """The loss_agg_mode the family's definition requires, or None when any mode is allowed."""
        return None

    def __post_init__(self) -> None:
        for name, (kind, optional) in _field_types(type(self)).items():
            object.__setattr__(self, name, _checked_value(name, getattr(self, name), kind, optional))
        _check(self.loss_agg_mode in AGG_MODES, f"loss_agg_mode must be one of {AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.fixed_agg_mode is not None:
            _check(
                self.loss_agg_mode == self.fixed_agg_mode,
                f"{self.name} defines its loss over sequences and fixes loss_agg_mode={self.fixed_agg_mode!r}; "
                f"got {self.loss_agg_mode!r}",
            )
        if self.loss_agg_mode == "seq-mean-token-sum-norm":
            _check(
                self.norm_constant is not None and self.norm_constant > 0,
                f"loss_agg_mode 'seq-mean-token-sum-norm' requires norm_constant > 0 (the generation budget, "
                f"e.g. max_new_tokens), got {self.norm_constant!r}",
            )
        _check(self.kl_estimator in KL_ESTIMATORS, f"kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}")
        _check(self.kl_coef >= 0, f"kl_coef must be >= 0, got {self.kl_coef}")
        _check(self.max_log_ratio > 0, f"max_log_ratio must be > 0, got {self.max_log_ratio}")
        _check(self.max_kl > 0, f"max_kl must be > 0, got {self.max_kl}")
        _check(self.rollout_is_cap > 0, f"rollout_is_cap must be > 0, got {self.rollout_is_cap}")

    @property
    def uses_reference(self) -> bool:
        """True when the loss needs ref_log_prob from a frozen reference model."""
        return self.kl_coef != 0

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
    ) -> LossOutput:
        """The loss of one (micro-)batch. Token tensors `[B, T]`, `advantages` `[B]` or `[B, T]`.

        Pass the step's `Normalizer` when the step has several micro-batches or ranks; without it
        this batch is the whole step (counted locally, even under torch.distributed).
        `group_ids` `[B]` is needed by `group-mean-token-mean`. The metrics are means over this
        call's valid tokens; average them over micro-batches and ranks for a step's figure.
        """
        if normalizer is not None and not isinstance(normalizer, Normalizer):
            raise TypeError(f"normalizer must be a pgloss.Normalizer (from Normalizer.count), got {type(normalizer).__name__}")
        if self.uses_reference and ref_log_prob is None:
            raise ValueError(f"{self.name} has kl_coef={self.kl_coef} and needs ref_log_prob")
        if self.entropy_coef != 0 and entropy is None:
            raise ValueError(f"{self.name} has entropy_coef={self.entropy_coef} and needs entropy")
        batch = TokenBatch.prepare(
            log_prob, old_log_prob, advantages, mask,
            ref_log_prob=ref_log_prob, entropy=entropy, rollout_log_prob=rollout_log_prob, group_ids=group_ids,
        )
        mask = batch.mask
        terms = self.policy_terms(batch)
        per_token = terms.per_token
        metrics = dict(terms.metrics)
        if batch.rollout_log_prob is not None:
            # Truncated importance sampling (Yao et al. 2025): the rollout engine sampled from
            # π_rollout, not π_old; reweight by min(π_old/π_rollout, cap), detached.
            tis = torch.exp((batch.old_log_prob - batch.rollout_log_prob).clamp(max=self.max_log_ratio))
            tis = tis.clamp(max=self.rollout_is_cap)
            per_token = per_token * tis
            metrics["rollout_is_weight"] = masked_mean(tis, mask)
        per_token = torch.where(mask, per_token, 0.0)
        if normalizer is None:  # this batch is the whole step: count it once for every term
            normalizer = Normalizer.count(mask, group_ids=batch.group_ids, reduce=False)

        rows = row_weights(mask, self.loss_agg_mode, normalizer, norm_constant=self.norm_constant,
                           group_ids=batch.group_ids)

        def reduce(masked_values: Tensor) -> Tensor:
            return weighted_sum(masked_values, rows, normalizer.world_size)

        loss = reduce(per_token)
        metrics["pg_loss"] = loss.detach()
        if batch.ref_log_prob is not None:
            kl = kl_estimate(batch.log_prob, batch.ref_log_prob, self.kl_estimator,
                             max_log_ratio=self.max_log_ratio, max_kl=self.max_kl)
            kl = torch.where(mask, kl, 0.0)
            metrics["kl"] = masked_mean(kl, mask)
            if self.kl_coef != 0:
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


@dataclass(frozen=True, kw_only=True)
class ClippedPolicy(Algorithm):
    """PPO's clipped surrogate on a token or sequence importance ratio (losses/ppo.py, ratios.py).

        ℓ_{i,t} = max( -Â·r, -Â·clip(r, 1-ε_low, 1+ε_high) ),  optionally dual-clipped or δ-capped,

    with r the ratio at `ratio_level`. The sequence levels (`sequence`: GSPO, `sequence_product`:
    the sample-level GRPO of "OpenR1 in practice (6)", 2025-06-04) define one loss per sequence, ℓ_i, copied onto its tokens,
    and fix loss_agg_mode to seq-mean-token-mean so that the loss is (1/N_seq) Σ_i ℓ_i.
    """

    clip_low: float = 0.2
    """ε_low: the lower bound of the ratio is 1 - clip_low (verl `clip_ratio_low`, TRL `epsilon`)."""
    clip_high: float = 0.2
    """ε_high: the upper bound is 1 + clip_high (verl `clip_ratio_high`, TRL `epsilon_high`)."""
    dual_clip: float | None = None
    """c > 1: for Â < 0 the loss is at most -c·Â (verl `clip_ratio_c`); None disables it."""
    delta: float | None = None
    """δ > 1 + clip_high: the unclipped ratio is capped at δ (TRL `delta`); None disables it."""
    ratio_level: str = "token"
    """token | sequence | sequence_token | sequence_product (ratios.py)."""

    @property
    def fixed_agg_mode(self) -> str | None:
        return "seq-mean-token-mean" if self.ratio_level in ("sequence", "sequence_product") else None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.ratio_level in RATIO_LEVELS, f"ratio_level must be one of {RATIO_LEVELS}, got {self.ratio_level!r}")
        _check(self.clip_low >= 0, f"clip_low must be >= 0, got {self.clip_low}")
        _check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")
        if self.dual_clip is not None:
            _check(self.dual_clip > 1, f"dual_clip must be > 1, got {self.dual_clip}")
        if self.delta is not None:
            _check(self.delta > 1 + self.clip_high, f"delta must be > 1 + clip_high = {1 + self.clip_high}, got {self.delta}")

    def ratio(self, batch: TokenBatch) -> Tensor:
        return importance_ratio(batch.log_prob, batch.old_log_prob, batch.mask,
                                level=self.ratio_level, max_log_ratio=self.max_log_ratio)

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = self.ratio(batch)
        surrogate = clipped_surrogate(ratio, batch.advantages, clip_low=self.clip_low, clip_high=self.clip_high,
                                      dual_clip=self.dual_clip, delta=self.delta)
        metrics = clip_metrics(surrogate.clipped_high, surrogate.clipped_low, batch.mask,
                               None if self.dual_clip is None and self.delta is None else surrogate.clipped_dual)
        metrics |= ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        return PolicyTerms(surrogate.loss, metrics)


@dataclass(frozen=True, kw_only=True)
class FIPO(ClippedPolicy):
    """DAPO's clipped token loss reweighted by the detached Future-KL influence (losses/fipo.py):
    ℓ_{i,t} = sg[f_{i,t}] · max(-Â·r, -Â·clip(r, 1-ε_low, 1+ε_high)), with the δ cap.

    The defaults are the paper's 32B headline run (Table 2 and the authors' 32B launcher): weight
    clipped to [1, 1.2] (high only), safety threshold 10, dual clip c = 10 (here δ = 10, which for
    Â < 0 is the dual clip and also keeps tokens with r > δ out of the Future-KL, as ms-swift does).
    The 7B run (Table 3): `fipo_clip_high_only=False, fipo_safety_threshold=3.0`. ms-swift's
    defaults: `fipo_clip_high_only=True, fipo_safety_threshold=4.0, delta=None`.
    """

    fipo_decay_rate: float = 32.0
    """Half-life of the Future-KL discount in tokens: γ = 2^(-1/fipo_decay_rate)."""
    fipo_clip_range: float | None = 0.2
    """ε_f in (0, 1): the weight is clipped to [1 - ε_f, 1 + ε_f] (or [1, 1 + ε_f]); None: not clipped."""
    fipo_clip_high_only: bool = True
    """Clip the weight to [1, 1 + ε_f] instead of [1 - ε_f, 1 + ε_f]."""
    fipo_safety_threshold: float | None = 10.0
    """For Â < 0 and r above this, the weight is held in [1 - ε_f, 1] ([0.8, 1] when ε_f is None); None disables it."""

    def __post_init__(self) -> None:
        # FIPO's own constraint first, so that a sequence ratio_level is named as the culprit
        # rather than the loss_agg_mode it would otherwise conflict with.
        _check(self.ratio_level == "token", f"fipo uses token ratios, got ratio_level={self.ratio_level!r}")
        super().__post_init__()
        _check(self.fipo_decay_rate > 0, f"fipo_decay_rate must be > 0, got {self.fipo_decay_rate}")
        if self.fipo_clip_range is not None:
            _check(0 < self.fipo_clip_range < 1, f"fipo_clip_range must lie in (0, 1), or be None for no clipping "
                                                  f"(ms-swift's 0), got {self.fipo_clip_range}")
        if self.fipo_safety_threshold is not None:
            _check(self.fipo_safety_threshold > 0, f"fipo_safety_threshold must be > 0, got {self.fipo_safety_threshold}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        terms = super().policy_terms(batch)
        token_log_ratio = log_ratio(batch.log_prob, batch.old_log_prob)
        weight, future = fipo_influence(
            token_log_ratio, self.ratio(batch), batch.advantages, batch.mask,
            decay_rate=self.fipo_decay_rate, clip_range=self.fipo_clip_range,
            clip_high_only=self.fipo_clip_high_only, safety_threshold=self.fipo_safety_threshold, delta=self.delta,
        )
        metrics = terms.metrics | {
            "fipo_weight_mean": masked_mean(weight, batch.mask),
            "fipo_future_kl_mean": masked_mean(future, batch.mask),
        }
        return PolicyTerms(weight * terms.per_token, metrics)


@dataclass(frozen=True, kw_only=True)
class CISPO(Algorithm):
    """ℓ_{i,t} = -sg[clip(r, 1 - ε_low, 1 + ε_high)] · Â · log π_θ (losses/cispo.py)."""

    clip_low: float | None = None
    """ε_low^IS; None: no lower bound (the paper). verl clips at 1 - clip_ratio_low."""
    clip_high: float = 4.0
    """ε_high^IS: the weight is capped at 1 + clip_high. TRL's `epsilon_high=E` is clip_high = E - 1."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.clip_low is not None:
            _check(self.clip_low >= 0, f"clip_low must be >= 0 or None, got {self.clip_low}")
        _check(self.clip_high >= 0, f"clip_high must be >= 0, got {self.clip_high}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, batch.mask,
                                 level="token", max_log_ratio=self.max_log_ratio)
        weight = cispo_weight(ratio, clip_low=self.clip_low, clip_high=self.clip_high)
        high = ratio.detach() > 1.0 + self.clip_high
        low = torch.zeros_like(high) if self.clip_low is None else ratio.detach() < 1.0 - self.clip_low
        metrics = clip_metrics(high, low, batch.mask)
        metrics |= ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        return PolicyTerms(cispo_loss(batch.log_prob, weight, batch.advantages), metrics)


@dataclass(frozen=True, kw_only=True)
class SAPO(Algorithm):
    """ℓ_{i,t} = -(4/τ)·σ(τ(r - 1))·Â, τ = τ_pos for Â > 0 else τ_neg (losses/sapo.py)."""

    tau_pos: float = 1.0
    """Gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """Gate temperature for negative advantages."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self.tau_pos > 0 and self.tau_neg > 0, f"tau_pos and tau_neg must be > 0, got {self.tau_pos}, {self.tau_neg}")

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        ratio = importance_ratio(batch.log_prob, batch.old_log_prob, batch.mask,
                                 level="token", max_log_ratio=self.max_log_ratio)
        gate = sapo_gate(ratio, batch.advantages, tau_pos=self.tau_pos, tau_neg=self.tau_neg)
        metrics = ratio_metrics(ratio, log_ratio(batch.log_prob, batch.old_log_prob), batch.mask)
        metrics["sapo_gate_mean"] = masked_mean(gate, batch.mask)
        return PolicyTerms(-gate * batch.advantages, metrics)


# name -> (family, the paper's defaults). Sources are in docs/reference.md.
NAMED: dict[str, tuple[type[Algorithm], dict[str, Any]]] = {
    "ppo": (ClippedPolicy, dict(loss_agg_mode="seq-mean-token-mean")),
    "dual_clip_ppo": (ClippedPolicy, dict(loss_agg_mode="seq-mean-token-mean", dual_clip=3.0)),
    "grpo": (ClippedPolicy, dict(loss_agg_mode="seq-mean-token-mean", kl_coef=0.04, kl_estimator="k3")),
    "sample_grpo": (ClippedPolicy, dict(loss_agg_mode="seq-mean-token-mean", ratio_level="sequence_product")),
    "gspo": (ClippedPolicy, dict(loss_agg_mode="seq-mean-token-mean", ratio_level="sequence",
                                 clip_low=3e-4, clip_high=4e-4)),
    "gspo_token": (ClippedPolicy, dict(loss_agg_mode="seq-mean-token-mean", ratio_level="sequence_token",
                                       clip_low=3e-4, clip_high=4e-4)),
    "dapo": (ClippedPolicy, dict(loss_agg_mode="token-mean", clip_low=0.2, clip_high=0.28, dynamic_sampling=True)),
    "bnpo": (ClippedPolicy, dict(loss_agg_mode="token-mean")),
    "dr_grpo": (ClippedPolicy, dict(loss_agg_mode="seq-mean-token-sum-norm", scale_rewards=False)),
    "cispo": (CISPO, dict(loss_agg_mode="token-mean")),
    "sapo": (SAPO, dict(loss_agg_mode="seq-mean-token-mean")),
    "fipo": (FIPO, dict(loss_agg_mode="token-mean", clip_low=0.2, clip_high=0.28, delta=10.0, dynamic_sampling=True,
                        fipo_clip_high_only=True, fipo_safety_threshold=10.0)),
}


def names() -> list[str]:
    """Every named algorithm, in table order."""
    return list(NAMED)


def get(name: str, **hyperparameters: Any) -> Algorithm:
    """The algorithm `name` with its paper's defaults, overridden by `hyperparameters`.

    Raises ValueError for an unknown name (listing the valid ones), TypeError for an unknown
    hyperparameter (naming it and listing the valid ones), ValueError for an impossible value.
    """
    if name not in NAMED:
        raise ValueError(f"unknown algorithm {name!r}; valid names: {', '.join(NAMED)}")
    family, defaults = NAMED[name]
    valid = {f.name for f in dataclasses.fields(family)} - {"name"}
    unknown = sorted(set(hyperparameters) - valid)
    if unknown:
        raise TypeError(f"{name} has no hyperparameter {', '.join(map(repr, unknown))}; valid: {', '.join(sorted(valid))}")
    return family(name=name, **{**defaults, **hyperparameters})
