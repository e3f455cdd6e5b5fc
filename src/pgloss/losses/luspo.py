"""LUSPO: GSPO's clipped sequence objective, weighted by the sequence length
(Length-Unbiased Sequence Policy Optimization; TRL `loss_type="luspo"`).

With the sequence ratio s_i = exp(mean_t δ_t) (`ratios.py`, level `sequence`) and PPO's clipped
surrogate ℓ_{i,t} = max(-Â·s_i, -Â·clip(s_i, 1-ε_low, 1+ε_high)) (`losses/ppo.py`, δ cap included):

    L = (1/N_seq) Σ_i Σ_t m_{i,t} ℓ_{i,t}        (= mean_i |y_i|·ℓ_i for per-sequence Â)

that is the clipped surrogate with `loss_agg_mode` fixed to seq-mean-token-sum. GSPO's
seq-mean-token-mean gives every sequence one vote; LUSPO gives each its length, so a long
response's sequence-level update is not diluted relative to its token count.

Reference: TRL `_compute_loss`, `loss_type == "luspo"` (trl/trainer/grpo_trainer.py):
(per_token_loss · mask).sum(-1).mean(), ε = `epsilon` = 0.2 on both sides (TRL's defaults), with a
warning unless `importance_sampling_level="sequence"`; ours defaults to the sequence level and
accepts `ratio_level="token"` as TRL does. TRL averages over the micro-batch's rows; we over the
step's non-empty sequences (split-invariant).

Liger's LUSPO (liger_kernel/chunked_loss/grpo_loss.py) differs: it sums ℓ·|y_i| over *all*
positions, padding included, and divides by B·T (the padded width); we follow TRL.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ppo import ClippedPolicy


@dataclass(frozen=True, kw_only=True)
class LUSPO(ClippedPolicy):
    """PPO's clipped surrogate on the sequence ratio, reduced with seq-mean-token-sum (fixed)."""

    loss_agg_mode: str = "seq-mean-token-sum"
    ratio_level: str = "sequence"

    @property
    def fixed_agg_mode(self) -> str | None:
        return "seq-mean-token-sum"
