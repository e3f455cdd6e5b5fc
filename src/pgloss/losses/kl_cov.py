"""KL-Cov: the unclipped surrogate with a |log r| penalty on the top-k covariance tokens (Cui et al. 2025,
arXiv 2505.22617; verl `compute_policy_loss_kl_cov`). cov_t and the selection over a call or a step:
`cov.py`.

The k = max(⌊ratio·N⌋, 1) tokens of largest cov get a penalty on the log-ratio δ = log r, the other tokens
the unclipped surrogate:

    L_t = -A·r + κ·|δ|·1[t in top-k]

Defaults (verl `PolicyLossConfig`): kl_cov_ratio 2e-4, κ = ppo_kl_coef 0.1 (the code's fallback 1.0 applies
only without a config).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch, check_mask, per_micro_batch
from ..core.metrics import ratio_metrics, token_mean
from ..core.output import PolicyTerms, check
from ..core.ratios import importance_ratio, log_ratio
from ..correction.token_masks import gather_values
from .cov import (
    SPLIT_SELECTION,
    StepTokens,
    check_selection,
    first_ranked,
    selection_size,
    step_covariance,
    token_covariance,
)


def kl_cov_loss(
    ratio: Tensor,
    log_prob: Tensor,
    token_log_ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    cov_ratio: float,
    kl_coef: float,
    selection: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(L_t `[B, T]`, the bool `[B, T]` map of the top-k tokens that carry the |δ| penalty).

    Args:
        ratio: r = π_θ/π_old, `[B, T]`.
        log_prob: log π_θ, `[B, T]` (only its detached value enters cov).
        token_log_ratio: δ = log π_θ - log π_old, `[B, T]`, with gradient.
        advantages: A, `[B, T]`, detached.
        mask: bool `[B, T]`.
        cov_ratio: the fraction of valid tokens to penalise (at least one).
        kl_coef: κ, verl's `ppo_kl_coef`.
        selection: the penalised tokens, bool `[B, T]` (the step's, `KLCov.step_selection`); None: the
            top-k of this call's tokens.
    """
    surrogate = -advantages * ratio
    if selection is None:  # the top k, ties in row-major order
        cov = torch.where(mask, token_covariance(log_prob, advantages, mask), -torch.inf)
        top = mask & first_ranked(cov, selection_size(cov_ratio, mask), descending=True)
    else:
        top = selection & mask
    return torch.where(top, surrogate + kl_coef * token_log_ratio.abs(), surrogate), top


@dataclass(frozen=True, kw_only=True)
class KLCov(Algorithm):
    """The unclipped surrogate, with κ·|δ| on the top-k covariance tokens (`kl_cov_loss`).

    The selection couples the tokens of one call (`couples_rows`), unless the step's is given
    (`selection`, from `step_selection`).
    """

    kl_cov_ratio: float = 2e-4
    """Fraction of the call's valid tokens that get the penalty; at least one does (verl `kl_cov_ratio`)."""
    ppo_kl_coef: float = 0.1
    """κ, the weight of |log r| on the selected tokens (verl `ppo_kl_coef`, config default 0.1)."""
    selection: Tensor | None = field(default=None, compare=False, repr=False)
    """The penalised tokens of this call, bool `[B, T]`: its part of the step's `step_selection`; None: the
    top-k of the call's own tokens (verl)."""

    couples_rows = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check(self.kl_cov_ratio > 0, f"kl_cov_ratio must be > 0, got {self.kl_cov_ratio}")
        check(self.ppo_kl_coef >= 0, f"ppo_kl_coef must be >= 0, got {self.ppo_kl_coef}")

    def sequence_split_refusal(self) -> str | None:
        return SPLIT_SELECTION if self.selection is None else None

    def step_selection(
        self,
        log_probs: Tensor | Sequence[Tensor],
        advantages: Tensor | Sequence[Tensor],
        masks: Tensor | Sequence[Tensor],
        *,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
    ) -> list[Tensor]:
        """The step's penalised tokens, one bool `[B, T]` map per micro-batch: the k = max(⌊ratio·N⌋, 1)
        tokens of largest cov over the step (its means, its N valid tokens; every rank under
        torch.distributed: a collective). Pass each part to its call: `dataclasses.replace(algorithm,
        selection=part)`. `log_probs`: as for `ClipCov.step_selection`.
        """
        ms = [check_mask(m, m.shape, m.device) for m in per_micro_batch("masks", masks)]
        covs = step_covariance(log_probs, advantages, ms, process_group=process_group, reduce=reduce)
        tokens = StepTokens(ms, process_group=process_group, reduce=reduce)
        values = gather_values(tokens.values(covs), process_group=process_group, reduce=reduce)
        if tokens.total == 0:
            return [torch.zeros_like(m) for m in ms]
        k = min(max(int(self.kl_cov_ratio * tokens.total), 1), tokens.total)
        return tokens.scatter(tokens.local(values.argsort(descending=True, stable=True)[:k]))  # ties: in order

    def policy_terms(self, batch: TokenBatch) -> PolicyTerms:
        delta = log_ratio(batch.log_prob, batch.old_log_prob)
        ratio = importance_ratio(
            batch.log_prob, batch.old_log_prob, batch.mask, level="token", max_log_ratio=self.max_log_ratio
        )
        loss, top = kl_cov_loss(
            ratio,
            batch.log_prob,
            delta,
            batch.advantages,
            batch.mask,
            cov_ratio=self.kl_cov_ratio,
            kl_coef=self.ppo_kl_coef,
            selection=check_selection(self.selection, batch.mask),
        )
        metrics = ratio_metrics(ratio, delta, batch.mask)
        metrics["kl_cov_fraction"] = token_mean(top.to(ratio.dtype), batch.mask)
        metrics["ppo_kl_abs"] = token_mean(delta.abs(), batch.mask)
        return PolicyTerms(loss, metrics)
