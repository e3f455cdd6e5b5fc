"""Top-k distillation: the student-teacher divergence over a truncated vocabulary support, from the teacher's top-k
ids and log-probs per position (what an inference server returns), or over the student's own top-k.

Per position, with the student's tempered log-probs s_j = log p_S(i_j) at the k ids i_j (normalised over the whole
vocabulary, `topk.SupportLogProbs`) and the teacher's t_j as given (padding slots, id −1, left out):

1. the tail (`tail`):
   "drop"         s, t as they are: the k terms of the full-vocabulary sum (verl; NeMo-RL `zero_outside_topk`);
   "renormalise"  s_j − lse_j s_j and t_j − lse_j t_j: the divergence of the top-k conditionals (ms-swift, NeMo-RL,
                  TRL without tail);
   "bucket"       one more slot on each side, log(1 − Σ_j e^{x_j}) with lse_j x_j clamped at ≤ −10⁻⁷ (TRL
                  `add_tail_bucket`);
2. `log_prob_min`: s and t clamped from below (verl −10; no gradient where the student's is clamped);
3. the divergence over the slots, β the weight of the teacher's side as in `divergence.py` (GKD, arXiv 2306.13649):
   blend "mixture": β = 0 Σ p_T (t − s); β = 1 Σ p_S (s − t); else JSD(β) = β KL(p_T‖m) + (1 − β) KL(p_S‖m),
   log m = logaddexp(s + log(1 − β), t + log β); blend "sum": (1 − β) Σ p_T (t − s) + β Σ p_S (s − t) (NeMo-RL
   `kl_type="mixed"`, `mixed_kl_weight` = 1 − β);
4. `outside_log_prob` c (tail "drop" only): the reverse side adds what the tokens outside the k give against a
   teacher of log-prob c there, weighted as the reverse KL is (β):
        Σ_{v ∉ top-k} p_S,v (log p_S,v − c) = (S − Σ_j p_S,j s_j) − c (1 − Σ_j p_S,j),    S = Σ_v p_S,v log p_S,v
   (NeMo-RL `zero_outside_topk`: c = −100, `H_rest − log_infinitesimal · P_rest`);
5. `value_range` (lo, hi): D clamped (verl: [0, 10], `clamp_min(0)` then `loss_max_clamp`).

A position with no id (all padding) gives D = 0 and no gradient. The student's gradient runs through s (and S), so
from hidden states nothing of size N x V is held (`topk.py`).

Sources: verl 0.9.1 `verl/trainer/distillation/fsdp/losses.py` `compute_forward_kl_topk` and
`verl/trainer/distillation/losses.py` (`compute_forward_kl_topk`, `distillation_loss`; defaults
`verl/workers/config/distillation.py`: topk 128, log_prob_min_clamp −10, loss_max_clamp 10); NeMo-RL
`nemo_rl/algorithms/loss/loss_functions.py` `DistillationLossFn` with `nemo_rl/distributed/model_utils.py`
`get_distillation_topk_logprobs_from_logits`; ms-swift 4.6.0 `swift/rlhf_trainers/gkd_loss.py` `gkd_loss` /
`jsd_loss` (`gkd_logits_topk`); TRL 1.16 `trl/experimental/async_distillation/async_distillation_trainer.py`
`_jsd_loss_chunk` (and `trl/experimental/server_distillation`), `trl/experimental/sdpo/loss_utils.py`
`compute_topk_self_distillation_loss` (SDPO, SDFT).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..core.checks import check_number
from .divergence_choice import check_beta

__all__ = ["topk_divergence", "check_topk_options", "TAILS", "BLENDS"]

TAILS = ("drop", "renormalise", "bucket")
BLENDS = ("mixture", "sum")
TAIL_CLAMP = -1e-7  # TRL's `add_tail_bucket`: lse of the k clamped at <= −10⁻⁷, so that the tail is > 0
_PAD = -1e4  # a padding slot's log-prob inside the arithmetic: e^{−10⁴} is 0 in float32 and float64


def check_topk_options(
    beta: object,
    blend: object,
    tail: object,
    log_prob_min: object,
    outside_log_prob: object,
    value_range: object,
) -> tuple[float, str, str, float | None, float | None, tuple[float, float] | None]:
    """The options of `topk_divergence` checked together, each refused by name: β in [0, 1]; blend in `BLENDS`;
    tail in `TAILS`; log_prob_min and outside_log_prob numbers or None; value_range None or (lo, hi), lo <= hi.
    `outside_log_prob` needs tail "drop" and, with 0 < β < 1, blend "sum" (the reverse side's weight)."""
    beta = check_beta(beta)
    if blend not in BLENDS:
        raise ValueError(f"blend must be one of {BLENDS}, got {blend!r}")
    if tail not in TAILS:
        raise ValueError(f"tail must be one of {TAILS}, got {tail!r}")
    floor = None if log_prob_min is None else check_number("log_prob_min", log_prob_min)
    outside = None if outside_log_prob is None else check_number("outside_log_prob", outside_log_prob)
    if outside is not None and tail != "drop":
        raise ValueError(f'outside_log_prob needs tail="drop" (the full-vocabulary log-probs), got tail={tail!r}')
    if outside is not None and blend == "mixture" and 0.0 < beta < 1.0:
        raise ValueError('outside_log_prob weights the reverse KL: with 0 < beta < 1 it needs blend="sum"')
    bounds = None
    if value_range is not None:
        if not isinstance(value_range, tuple) or len(value_range) != 2:
            raise TypeError(f"value_range must be None or a (low, high) tuple, got {value_range!r}")
        bounds = (check_number("value_range[0]", value_range[0]), check_number("value_range[1]", value_range[1]))
        if bounds[0] > bounds[1]:
            raise ValueError(f"value_range must have low <= high, got {value_range}")
    return beta, str(blend), str(tail), floor, outside, bounds


def _with_tail(x: Tensor) -> Tensor:
    """x [N, k] (padding at _PAD) with TRL's tail bucket appended: log(1 − e^{min(lse x, −10⁻⁷)})."""
    lse = torch.logsumexp(x, dim=-1, keepdim=True).clamp(max=TAIL_CLAMP)
    return torch.cat([x, torch.log(-torch.expm1(lse))], dim=-1)


def _kl_terms(first: Tensor, second: Tensor, slots: Tensor) -> Tensor:
    """Σ over `slots` of e^{first} (first − second) [N]."""
    return torch.where(slots, first.exp() * (first - second), 0.0).sum(dim=-1)


def topk_divergence(
    student: Tensor,
    teacher: Tensor,
    ids: Tensor,
    *,
    beta: float,
    blend: str = "mixture",
    tail: str = "drop",
    log_prob_min: float | None = None,
    outside_log_prob: float | None = None,
    value_range: tuple[float, float] | None = None,
    negentropy: Tensor | None = None,
) -> Tensor:
    """D per position [N] (module docstring, steps 1-5) from the student's full-vocabulary log-probs `student`
    [N, k] at `ids` [N, k] (int64, −1 padding), the teacher's `teacher` [N, k] (log-probs, or logits with tail
    "renormalise"), and, for `outside_log_prob`, the student's S = Σ_v p_v log p_v `negentropy` [N]. Options as
    `check_topk_options` returns them. The one place the top-k arithmetic is written: every entry point calls it."""
    slots = ids >= 0
    some = slots.any(dim=-1)
    s = torch.where(slots, student, _PAD)
    t = torch.where(slots, teacher.to(student.dtype), _PAD)
    if tail == "renormalise":
        s = s - torch.logsumexp(s, dim=-1, keepdim=True)
        t = t - torch.logsumexp(t, dim=-1, keepdim=True)
    elif tail == "bucket":
        s, t = _with_tail(s), _with_tail(t)
        slots = torch.cat([slots, some.unsqueeze(-1)], dim=-1)
    if log_prob_min is not None:
        s, t = s.clamp(min=log_prob_min), t.clamp(min=log_prob_min)
    forward_kl, reverse_kl = _kl_terms(t, s, slots), _kl_terms(s, t, slots)
    if blend == "sum" or beta in (0.0, 1.0):
        value = (1.0 - beta) * forward_kl + beta * reverse_kl
    else:
        log_m = torch.logaddexp(s + math.log1p(-beta), t + math.log(beta))
        value = beta * _kl_terms(t, log_m, slots) + (1.0 - beta) * _kl_terms(s, log_m, slots)
    if outside_log_prob is not None and beta > 0.0:
        if negentropy is None:
            raise ValueError("outside_log_prob needs the student's negentropy (SupportLogProbs(entropy=True))")
        p = torch.where(slots, s.exp(), 0.0)
        inside = (p * torch.where(slots, s, 0.0)).sum(dim=-1)
        value = value + beta * ((negentropy - inside) - outside_log_prob * (1.0 - p.sum(dim=-1)))
    if value_range is not None:
        value = value.clamp(min=value_range[0], max=value_range[1])
    return torch.where(some, value, 0.0)
