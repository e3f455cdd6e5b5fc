"""The KL penalty: + β · Agg(KL_t(π_θ‖π_ref)), the sampled-token estimators of `pgloss.kl` or the exact KL.

    KL_t = k_X(log π_θ(y_t), log π_ref(y_t))   (k1, abs, k2, k3; "k3+": k3's value, k2's gradient, as verl)
    KL_t = full_kl_t                           (kl_estimator="full": Σ_v π_θ(v) log π_θ(v)/π_ref(v), given)

optionally re-weighted by r = π_θ/π_old (`kl_correction`, `pgloss.kl.corrections`), and by the rollout
correction's weight when it says so (`RolloutCorrection.weight_kl`). Aggregated like the policy term, over every
row. The metric `kl` reports its token mean whenever the reference is given, `kl_loss` its aggregate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..core.batch import TokenBatch
from ..core.metrics import token_mean
from ..core.output import check
from ..core.row_set import Part
from ..core.trainer_names import value_hint
from ..correction.rollout import Corrected
from ..kl.corrections import FULL, KL_CORRECTIONS, KL_OPTIONS, kl_term
from .term import TermValue


@dataclass(frozen=True, kw_only=True)
class Options:
    """The KL penalty's fields, shared by every algorithm."""

    coef_field: ClassVar[str] = "kl_coef"
    """The field of the term's coefficient (0: the term is off)."""

    kl_coef: float = 0.0
    """β of the KL loss term β·KL(π_θ‖π_ref); 0 disables it and the reference model."""
    kl_estimator: str = "k3"
    """The KL term: k1, abs, k2, k3 on the sampled token; "k1+" ... "k3+": that value with k2's gradient
    (verl); "full": the exact KL over the vocabulary, passed as `full_kl` (`pgloss.vocab.full_kl`)."""
    kl_correction: str | None = None
    """None, "ratio_weighted" (KL·r, r differentiable: TRL's use_bias_correction_kl), "ratio_clamped" (KL·min(r,
    kl_correction_cap): Trinity-RFT's corrected_k3 with cap 2) or "unbiased_gradient" (value kept, k2's gradient
    weighted by sg[min(r, kl_correction_cap)]: OpenRLHF); `kl/corrections.py`."""
    kl_correction_cap: float = 10.0
    """The ratio's cap of kl_correction="unbiased_gradient" (OpenRLHF's 10) and "ratio_clamped" (Trinity's 2)."""
    max_kl: float = 10.0
    """The k3 estimate is clamped to ±max_kl, as verl does (zero gradient beyond)."""

    @property
    def uses_reference(self) -> bool:
        """True when the loss needs a frozen reference model: its log-probs (`ref_log_prob`), or with
        kl_estimator="full" the exact KL to it (`full_kl`)."""
        return self.kl_coef != 0

    @property
    def uses_full_kl(self) -> bool:
        """True when the KL term is the exact full-vocabulary KL, passed as `full_kl`."""
        return self.kl_coef != 0 and self.kl_estimator == FULL

    def kl_penalty(self, max_log_ratio: float) -> KLPenalty:
        """The term these fields configure (its checks run here)."""
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
        check(self.max_kl > 0, f"max_kl must be > 0, got {self.max_kl}")
        return KLPenalty(
            self.kl_coef, self.kl_estimator, self.kl_correction, self.kl_correction_cap, self.max_kl, max_log_ratio
        )


@dataclass(frozen=True)
class KLPenalty:
    coef: float
    estimator: str
    correction: str | None
    correction_cap: float
    max_kl: float
    max_log_ratio: float
    loss_metric: str = "kl_loss"

    def needs(self) -> dict[str, str]:
        if self.coef == 0:
            return {}
        if self.estimator == FULL:
            return {
                "full_kl": f"kl_coef={self.coef} with kl_estimator='full': pgloss.full_kl_from_logits or "
                "full_kl_from_hidden, [B, T]"
            }
        return {"ref_log_prob": f"kl_coef={self.coef} with kl_estimator={self.estimator!r}"}

    def parts(self) -> tuple[Part, ...] | None:
        return None

    def evaluate(self, batch: TokenBatch, corrected: Corrected | None) -> TermValue:
        if self.estimator == FULL:
            kl = batch.full_kl
        elif batch.ref_log_prob is not None:
            kl = kl_term(
                batch.log_prob,
                batch.ref_log_prob,
                batch.old_log_prob,
                estimator=self.estimator,
                correction=self.correction,
                correction_cap=self.correction_cap,
                max_log_ratio=self.max_log_ratio,
                max_kl=self.max_kl,
            )
        else:
            kl = None
        if kl is None:
            return TermValue()
        kl = torch.where(batch.mask, kl, 0.0)
        metrics = {"kl": token_mean(kl, batch.mask)}
        if self.coef == 0:
            return TermValue(metrics)
        if corrected is not None and corrected.weight is not None and corrected.weight_kl:
            kl = kl * corrected.weight
        return TermValue(metrics, kl)
