"""The entry points of top-k distillation (the divergence over a truncated vocabulary support, `topk_terms.py`):
given the teacher's top-k ids and log-probs per position, from the student's logits or from its hidden states and
LM head; or over the student's own top-k, the teacher given as logits or as hidden states and a head.

Each call is one run of the chunk loop for the student's full-vocabulary log-probs at the k ids
(`topk.SupportLogProbs`: the k columns of the head and one log-sum-exp, never the N x V logits), then the [N, k]
arithmetic of `topk_terms.topk_divergence`, then the aggregation of `divergence_from_logits`. The student-top-k
form adds two runs without gradient first: the student's top-k ids (`topk.TopIds`) and the teacher's log-probs at
them. The torch backend runs them (the Triton routes refuse these statistics by name).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from ..core.batch import check_mask, check_tensor, compute_dtype
from ..core.normalizer import Normalizer
from ..core.output import LossOutput
from .chunks import ChunkLoop
from .divergence import divergence_output
from .entropy import check_temperature
from .fused import check_head_inputs, full_head
from .head import HeadOptions, as_head, refuses_head_keywords
from .pair import check_logit_pair, head_pair
from .plan import plan
from .topk import SupportLogProbs, TopIds, check_topk_ids, check_topk_log_probs
from .topk_terms import check_topk_options, topk_divergence

__all__ = [
    "topk_divergence_from_logits",
    "topk_divergence_from_hidden",
    "student_topk_divergence_from_logits",
    "student_topk_divergence_from_hidden",
]


def _student_side(statistic: SupportLogProbs, kinds: tuple, temperature: float, tiles, rows, tensors: tuple):
    """(log p_S at the ids [N, k], S or None) from one run of the loop."""
    out = ChunkLoop.apply(statistic, kinds, temperature, tiles, rows, *tensors)
    return (out[0], out[1]) if statistic.entropy else (out, None)


def _divergence(
    kinds: tuple,
    temperature: float,
    tiles,
    rows: Tensor | None,
    tensors: tuple,
    ids: Tensor,
    teacher: Tensor,
    options: tuple,
) -> Tensor:
    """D per position [N]: the student's log-probs at `ids` [N, k] from the loop, then `topk_divergence`."""
    beta, blend, tail, floor, outside, bounds = options
    statistic = SupportLogProbs(ids, entropy=outside is not None and beta > 0.0)
    student, negentropy = _student_side(statistic, kinds, temperature, tiles, rows, tensors)
    return topk_divergence(
        student,
        teacher,
        ids,
        beta=beta,
        blend=blend,
        tail=tail,
        log_prob_min=floor,
        outside_log_prob=outside,
        value_range=bounds,
        negentropy=negentropy,
    )


def _check_k(k: object, vocab: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= vocab:
        raise ValueError(f"k must be in [1, {vocab}] (the vocabulary), got {k}")
    return k


def topk_divergence_from_logits(
    logits: Tensor,
    teacher_ids: Tensor,
    teacher_log_probs: Tensor,
    mask: Tensor,
    *,
    beta: float,
    blend: str = "mixture",
    tail: str = "drop",
    log_prob_min: float | None = None,
    outside_log_prob: float | None = None,
    value_range: tuple[float, float] | None = None,
    temperature: float = 1.0,
    loss_agg_mode: str = "token-mean",
    normalizer: Normalizer | None = None,
    norm_constant: float | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> LossOutput:
    """The top-k divergence D per position over the teacher's top-k ids (`pgloss.vocab.topk_terms`):

        s_j = log softmax(logits / τ)_{i_j},  t_j = teacher_log_probs_j,  then tail, clamps and D_β over the k.

    Args:
        logits: [B, T, V] student logits (any float dtype; the math runs in float32, float64 stays).
        teacher_ids: [B, T, k] integer token ids, the teacher's top-k per position, −1 for a missing slot; checked
            at valid positions only.
        teacher_log_probs: [B, T, k] the teacher's log-probs at `teacher_ids` (with tail "renormalise", logits
            also do), finite at every id that is not −1; never differentiated, used as given (τ divides only the
            student's logits).
        mask: [B, T] bool or 0/1, the positions that count.
        beta: β in [0, 1], the weight of the teacher's side (0: forward KL(p_T‖p_S) over the k, 1: reverse KL).
        blend: "mixture" (β strictly between: JSD(β)) or "sum" ((1 − β) forward + β reverse: NeMo-RL's mixed).
        tail: "drop" (the full-vocabulary log-probs as they are), "renormalise" (over the k) or "bucket" (TRL's
            tail bucket log(1 − Σ p)).
        log_prob_min: clamp both sides' log-probs from below (verl: −10), or None.
        outside_log_prob: c, the teacher's log-prob assumed outside the k (NeMo-RL `zero_outside_topk`: −100),
            adding the reverse side's tail Σ_{v ∉ top-k} p_S (log p_S − c); tail "drop" only. None: nothing.
        value_range: (lo, hi) clamping D (verl: (0, 10)), or None.
        temperature: τ > 0, dividing the student's logits.
        loss_agg_mode: how `per_token` becomes `loss` (`pgloss.aggregate`; default the token-mean).
        normalizer: the step's counts (`Normalizer.count` over every micro-batch's mask); None: this call is the step.
        norm_constant: C of the budget modes.
        chunk_size: positions per chunk (None: about 2²⁷ / V).
        vocab_block: vocabulary columns per tile (None: the whole vocabulary).
        memory_budget: bytes for the loop's buffers, exclusive with chunk_size and vocab_block.

    Returns:
        `LossOutput`: `per_token` [B, T] (0 at masked positions and at positions without an id), `loss` its
        aggregate, `metrics["divergence"]` its mean over valid tokens; gradients to `logits` only.
    """
    check_tensor("logits", logits, ndim=(3,))
    valid = check_mask(mask, logits.shape[:2], logits.device, "logits")
    batch, length, vocab = logits.shape
    ids = check_topk_ids("teacher_ids", teacher_ids, logits.shape[:2], vocab, valid, logits.device)
    teacher = check_topk_log_probs("teacher_log_probs", teacher_log_probs, ids, compute_dtype(logits.dtype))
    options = check_topk_options(beta, blend, tail, log_prob_min, outside_log_prob, value_range)
    temperature = check_temperature(temperature)
    flat = logits.reshape(batch * length, vocab)
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    tiles = plan(SupportLogProbs, ("logits",), flat, batch * length, **sizes)
    k = ids.shape[-1]
    per_token = _divergence(
        ("logits",), temperature, tiles, None, (flat,), ids.view(-1, k), teacher.view(-1, k), options
    )
    return divergence_output(per_token.view(batch, length), valid, loss_agg_mode, normalizer, norm_constant)


@refuses_head_keywords("")
def topk_divergence_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    teacher_ids: Tensor,
    teacher_log_probs: Tensor,
    mask: Tensor,
    *,
    beta: float,
    blend: str = "mixture",
    tail: str = "drop",
    log_prob_min: float | None = None,
    outside_log_prob: float | None = None,
    value_range: tuple[float, float] | None = None,
    temperature: float = 1.0,
    head: HeadOptions | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: Normalizer | None = None,
    norm_constant: float | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> LossOutput:
    """`topk_divergence_from_logits` of the student's logits c · tanh(s · (x Wᵀ + b) / c) (the head's options as
    `pgloss.divergence_from_hidden`), without them: log p_S at the k ids are k columns of the head and one
    log-sum-exp over the vocabulary (`pgloss.vocab.topk`), so memory is the plain log π(y) call's.

    Args:
        hidden: [B, T, H] student hidden states; read only at `mask` positions (NaN and inf allowed elsewhere).
        weight: [V, H] student output projection, the dtype and device of `hidden`.
        teacher_ids: as `topk_divergence_from_logits`.
        teacher_log_probs: as `topk_divergence_from_logits`.
        mask: as `topk_divergence_from_logits`.
        beta: as `topk_divergence_from_logits`.
        blend: as `topk_divergence_from_logits`.
        tail: as `topk_divergence_from_logits`.
        log_prob_min: as `topk_divergence_from_logits`.
        outside_log_prob: as `topk_divergence_from_logits`.
        value_range: as `topk_divergence_from_logits`.
        temperature: as `topk_divergence_from_logits`.
        head: the student head's bias, logit scale and soft-cap, a `pgloss.HeadOptions` (None: the plain head).
        loss_agg_mode: as `topk_divergence_from_logits`.
        normalizer: as `topk_divergence_from_logits`.
        norm_constant: as `topk_divergence_from_logits`.
        chunk_size: as `topk_divergence_from_logits`.
        vocab_block: as `topk_divergence_from_logits`.
        memory_budget: as `topk_divergence_from_logits`.

    Returns:
        `LossOutput` as `topk_divergence_from_logits`; gradients to `hidden`, `weight` and `bias`.
    """
    weight = full_head(weight)
    policy = as_head(head)
    policy = policy.with_bias(full_head(policy.bias))
    check_tensor("hidden", hidden, ndim=(3,))
    check_head_inputs(hidden, weight)
    valid = check_mask(mask, hidden.shape[:-1], hidden.device)
    kind = policy.check(weight)
    batch, length, size = hidden.shape
    ids = check_topk_ids("teacher_ids", teacher_ids, hidden.shape[:2], weight.shape[0], valid, hidden.device)
    teacher = check_topk_log_probs("teacher_log_probs", teacher_log_probs, ids, compute_dtype(weight.dtype))
    options = check_topk_options(beta, blend, tail, log_prob_min, outside_log_prob, value_range)
    temperature = check_temperature(temperature)
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    tiles = plan(SupportLogProbs, (kind,), weight, batch * length, **sizes)
    k = ids.shape[-1]
    tensors = (hidden.reshape(batch * length, size), weight, policy.bias)
    per_token = _divergence(
        (kind,), temperature, tiles, valid.reshape(-1), tensors, ids.view(-1, k), teacher.view(-1, k), options
    )
    return divergence_output(per_token.view(batch, length), valid, loss_agg_mode, normalizer, norm_constant)


def _student_topk(kinds: tuple, temperature: float, tiles, rows, student: tuple, teacher: tuple, k: int, valid):
    """The student's top-k ids [N, k] (−1 where not `valid`) and the teacher's full-vocabulary log-probs at them,
    two runs of the loop without gradient."""
    with torch.no_grad():
        detached = tuple(None if t is None else t.detach() for t in student)
        ids = ChunkLoop.apply(TopIds(k), kinds[:1], temperature, tiles, rows, *detached)
        ids = torch.where(valid.reshape(-1, 1), ids, -1)
        teacher_lp = ChunkLoop.apply(SupportLogProbs(ids), kinds[1:], temperature, tiles, rows, *teacher)
    return ids, teacher_lp


def student_topk_divergence_from_logits(
    logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    *,
    k: int,
    beta: float,
    blend: str = "mixture",
    tail: str = "renormalise",
    log_prob_min: float | None = None,
    value_range: tuple[float, float] | None = None,
    temperature: float = 1.0,
    loss_agg_mode: str = "token-mean",
    normalizer: Normalizer | None = None,
    norm_constant: float | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> LossOutput:
    """The top-k divergence over the student's own top-k ids i_j = topk(logits, k) (TRL 1.16
    `trl/experimental/sdpo/loss_utils.py` `compute_topk_self_distillation_loss`, used by SDPO and SDFT):

        s_j = log softmax(logits / τ)_{i_j},  t_j = log softmax(teacher_logits / τ)_{i_j},

    then tail, clamps and D_β over the k as `topk_divergence_from_logits` (TRL: tail "renormalise", or "bucket"
    with `distillation_add_tail`; β = `distillation_alpha`). The ids carry no gradient.

    Args:
        logits: [B, T, V] student logits.
        teacher_logits: [B, T, V] teacher logits, never differentiated.
        mask: [B, T] bool or 0/1, the positions that count.
        k: the support's size, 1 <= k <= V (SDFT: 100).
        beta: as `topk_divergence_from_logits`.
        blend: as `topk_divergence_from_logits`.
        tail: as `topk_divergence_from_logits`.
        log_prob_min: as `topk_divergence_from_logits`.
        value_range: as `topk_divergence_from_logits`.
        temperature: τ > 0, dividing both models' logits.
        loss_agg_mode: as `topk_divergence_from_logits`.
        normalizer: as `topk_divergence_from_logits`.
        norm_constant: as `topk_divergence_from_logits`.
        chunk_size: as `topk_divergence_from_logits`.
        vocab_block: as `topk_divergence_from_logits`.
        memory_budget: as `topk_divergence_from_logits`.

    Returns:
        `LossOutput` as `topk_divergence_from_logits`; gradients to `logits` only.
    """
    check_logit_pair(logits, teacher_logits, names=("logits", "teacher_logits"))
    check_tensor("logits", logits, ndim=(3,))
    valid = check_mask(mask, logits.shape[:2], logits.device, "logits")
    batch, length, vocab = logits.shape
    k = _check_k(k, vocab)
    options = check_topk_options(beta, blend, tail, log_prob_min, None, value_range)
    temperature = check_temperature(temperature)
    flat, teacher_flat = logits.reshape(-1, vocab), teacher_logits.detach().reshape(-1, vocab)
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    tiles = plan(SupportLogProbs, ("logits", "logits"), flat, batch * length, **sizes)
    kinds = ("logits", "logits")
    ids, teacher = _student_topk(kinds, temperature, tiles, None, (flat,), (teacher_flat,), k, valid)
    per_token = _divergence(kinds[:1], temperature, tiles, None, (flat,), ids, teacher, options)
    return divergence_output(per_token.view(batch, length), valid, loss_agg_mode, normalizer, norm_constant)


@refuses_head_keywords("", "teacher_")
def student_topk_divergence_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    *,
    k: int,
    beta: float,
    blend: str = "mixture",
    tail: str = "renormalise",
    log_prob_min: float | None = None,
    value_range: tuple[float, float] | None = None,
    temperature: float = 1.0,
    head: HeadOptions | None = None,
    teacher_head: HeadOptions | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: Normalizer | None = None,
    norm_constant: float | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> LossOutput:
    """`student_topk_divergence_from_logits` from both models' hidden states and LM heads (each head's options as
    `pgloss.divergence_from_hidden`), without the N x V logits of either: three runs of the loop, the student's
    top-k ids and the teacher's log-probs at them without gradient, then the student's log-probs at them.

    Args:
        hidden: [B, T, H] student hidden states.
        weight: [V, H] student output projection, the dtype and device of `hidden`.
        teacher_hidden: [B, T, H'] teacher hidden states; never differentiated.
        teacher_weight: [V, H'] teacher output projection; never differentiated.
        mask: as `student_topk_divergence_from_logits`.
        k: as `student_topk_divergence_from_logits`.
        beta: as `student_topk_divergence_from_logits`.
        blend: as `student_topk_divergence_from_logits`.
        tail: as `student_topk_divergence_from_logits`.
        log_prob_min: as `student_topk_divergence_from_logits`.
        value_range: as `student_topk_divergence_from_logits`.
        temperature: as `student_topk_divergence_from_logits`.
        head: the student head's options, a `pgloss.HeadOptions` (None: the plain head).
        teacher_head: the teacher head's options, as `head`.
        loss_agg_mode: as `topk_divergence_from_logits`.
        normalizer: as `topk_divergence_from_logits`.
        norm_constant: as `topk_divergence_from_logits`.
        chunk_size: as `topk_divergence_from_logits`.
        vocab_block: as `topk_divergence_from_logits`.
        memory_budget: as `topk_divergence_from_logits`.

    Returns:
        `LossOutput` as `topk_divergence_from_logits`; gradients to `hidden`, `weight` and `bias`.
    """
    check_tensor("mask", mask, ndim=(2,), floating=False)
    kinds, tiles, student, teacher, valid = head_pair(
        SupportLogProbs,
        hidden,
        weight,
        teacher_hidden,
        teacher_weight,
        "teacher",
        head=as_head(head),
        other_head=as_head(teacher_head, prefix="teacher_"),
        mask=mask,
        chunk_size=chunk_size,
        vocab_block=vocab_block,
        memory_budget=memory_budget,
    )
    valid = cast(Tensor, valid)  # the mask as head_pair checked it: a mask given, never None
    k = _check_k(k, weight.shape[0])
    options = check_topk_options(beta, blend, tail, log_prob_min, None, value_range)
    temperature = check_temperature(temperature)
    rows = valid.reshape(-1)
    ids, teacher_lp = _student_topk(kinds, temperature, tiles, rows, student, teacher, k, valid)
    per_token = _divergence(kinds[:1], temperature, tiles, rows, student, ids, teacher_lp, options)
    return divergence_output(per_token.view(hidden.shape[:2]), valid, loss_agg_mode, normalizer, norm_constant)
