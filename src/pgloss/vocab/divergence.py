"""The student-teacher divergence over the whole vocabulary, per position: forward KL, reverse KL and
the generalised Jensen-Shannon divergence JSD(β) of on-policy distillation, and beside them DistiLLM's skewed
forward and reverse KL and the adaptive KL (AKL), from logits or fused from both models' hidden states and LM heads.
`divergence=` names one (`divergence_choice.choose`, the one owner of the choice and its parameters); `beta=` alone
names the JSD(β) family as before.

With the student's and the teacher's tempered logits z_S = logits_S / τ, z_T = logits_T / τ at one
position, p_S = softmax(z_S), p_T = softmax(z_T) and the mixture m = β p_T + (1 − β) p_S:

    β = 0        D = KL(p_T‖p_S) = Σᵥ p_T,ᵥ (log p_T,ᵥ − log p_S,ᵥ)               forward KL (mode-covering)
    β = 1        D = KL(p_S‖p_T) = Σᵥ p_S,ᵥ (log p_S,ᵥ − log p_T,ᵥ)               reverse KL (mode-seeking)
    0 < β < 1    D = JSD(β) = β KL(p_T‖m) + (1 − β) KL(p_S‖m)

and the gradient with respect to the student's logits (the teacher is frozen):

    β = 0        ∂D/∂z_S,ᵥ = p_S,ᵥ − p_T,ᵥ
    β = 1        ∂D/∂z_S,ᵥ = p_S,ᵥ (log p_S,ᵥ − log p_T,ᵥ − D)
    0 < β < 1    ∂D/∂z_S,ᵥ = (1 − β) p_S,ᵥ (log p_S,ᵥ − log mᵥ − KL(p_S‖m))

(∂/∂logits_S = (1/τ) ∂/∂z_S). From hidden states x and an LM head (W, bias b, logit scale s, soft-cap c;
`head.HeadOptions`), each model's logits are

    logits = c · tanh(s · (x Wᵀ + b) / c)        (s · (x Wᵀ + b) without a soft-cap)

in TRL's order (bias, scale, soft-cap, then τ), so that ∂/∂(x Wᵀ + b) = s (1 − tanh²(s (x Wᵀ + b) / c)) ∂/∂logits.

Source: Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated Mistakes"
(GKD), arXiv 2306.13649, Eq. (1): D_JSD(β)(P‖Q) = β KL(P‖βP + (1−β)Q) + (1−β) KL(Q‖βP + (1−β)Q) with
P = p_T, Q = p_S. The paper's JSD(β) is 0 at both ends; β = 0 and β = 1 here are its limits
JSD(β)/β → KL(p_T‖p_S) (β → 0) and JSD(β)/(1−β) → KL(p_S‖p_T) (β → 1), the forward and reverse KL the
paper trains with beside JSD(β).
TRL 1.16 takes the same convention: `GKDTrainer.generalized_jsd_loss` (trl/experimental/gkd/
gkd_trainer.py) on logits and `ChunkedDivergenceFunction` (trl/kernels/chunked_divergence.py, used
by trl/trainer/distillation_trainer.py) from hidden states; so β weights the teacher's side, and
β = 0.5 is the symmetric JSD.

The β = 1 statistic is `full_kl.FullKL` itself (KL(p_S‖p_T) is the exact KL with the teacher as the
reference): `divergence_from_logits(..., beta=1)` equals `full_kl_from_logits(student, teacher)`.
β = 0 is the same sums with the roles swapped (`ForwardKL`). Both accumulate over vocabulary tiles in
one pass with online maxima. JSD(β) needs both log-normalisers before its first term (log m is not a
sum that rescales), so with vocabulary tiles (`vocab_block` < V) the loop runs twice: once for the
two log-normalisers (no gradient), then for JSD(β) given them; whole-vocabulary chunks need one pass.
Every path runs `chunks.ChunkLoop`: memory beyond the inputs and their gradients is one
[chunk, vocab_block] buffer per model (and, in backward, one for a soft-capped student's slope), never
the N x V logits; backward recomputes each tile.

The others (their formulas, sources and ROLL's conventions in their modules):

    divergence="skewed_forward", skew=λ    KL(p_T‖λ p_T + (1 − λ) p_S)            `skewed.SkewedKL` (arXiv 2402.03898)
    divergence="skewed_reverse", skew=λ    KL(p_S‖λ p_S + (1 − λ) p_T)            `skewed.SkewedKL`
    divergence="adaptive", mu=μ            w_head KL(p_T‖p_S) + w_tail KL(p_S‖p_T)  `adaptive_kl.AdaptiveKL` (2404.02657)

λ defaults to 0.1 and μ to 0.5 (ROLL's defaults). The skewed KLs take JSD(β)'s two passes over vocabulary tiles
(both log-normalisers first); AKL takes them and, for its teacher's head, 4 (float32) or 8 (float64) more passes over
the teacher alone, without gradient (`adaptive_kl.HeadSearch`). None of them has Triton kernels: the automatic choice
takes torch, and `use("kernel")` refuses them by name.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor

from ..core.aggregate import aggregate
from ..core.batch import check_mask, check_tensor, compute_dtype
from ..core.metrics import Stat
from ..core.normalizer import Normalizer
from ..core.output import LossOutput
from . import kernels
from .adaptive_kl import AdaptiveKL, HeadSearch, levels, logit_of_key
from .backends import TRITON_TILES, Plan, TileOps
from .banned import BANNED_LOGIT
from .chunks import ChunkLoop
from .divergence_choice import Choice, check_beta, choose
from .entropy import _blocks, check_temperature
from .full_kl import KERNEL_OPS, FullKL, kernel_tile_forward
from .head import HeadOptions, as_head, refuses_head_keywords
from .jsd import GeneralisedJSD, jsd_sums  # noqa: F401 (jsd_sums: still importable from here)
from .pair import check_logit_pair, head_pair
from .plan import plan
from .skewed import SkewedKL, TwoPass

__all__ = ["divergence_from_logits", "divergence_from_hidden", "check_beta"]


class ForwardKL(FullKL):
    """Statistic of `chunks.ChunkLoop`: KL(p_T‖p_S) per token, the student the first source.

    `FullKL`'s sums with the two sources swapped (its values: KL, lse_T, lse_S); the gradient to the
    student's logits is (g/τ)(p_S − p_T), 0 where the student bans the token (`banned.py`)."""

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        super().forward(zs[::-1], rows, values)

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        return super().tile_forward(zs[::-1], rows, cols, state)

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads, temperature: float) -> Tensor:
        z, z_teacher = zs
        _, lse_teacher, lse = values
        scale = (grads[0][rows] / temperature).unsqueeze(-1)
        for block, _ in _blocks(z, 0):
            banned = z[block] <= BANNED_LOGIT  # the teacher's π_T left out where the student bans the token
            p = z[block].sub_(lse[rows][block].unsqueeze(-1)).exp_()
            q = z_teacher[block].sub_(lse_teacher[rows][block].unsqueeze(-1)).exp_().masked_fill_(banned, 0.0)
            p.sub_(q).mul_(scale[block])
        return z

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        return self.grad(zs, rows, values, grads, temperature)  # elementwise given both lse


# Its Triton kernels (`backends.TRITON_TILES`): `FullKL`'s sums with the sources swapped, the gradient (g/τ)(p_S − p_T).


def _forward_kl_tile_forward(statistic: ForwardKL, zs: list, rows: slice, cols: slice, state):
    return kernel_tile_forward(statistic, zs[::-1], rows, cols, state)


def _forward_kl_tile_grad(
    statistic: ForwardKL, zs: list, rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
) -> Tensor:
    kl, lse_teacher, lse = (v[rows] for v in values)
    tile, teacher = zs
    return kernels.pair_backward(tile, teacher, lse, lse_teacher, kl, grads[0][rows], mode=kernels.FORWARD_KL)


TRITON_TILES.add(ForwardKL, TileOps(_forward_kl_tile_forward, _forward_kl_tile_grad))


class Normalisers(FullKL):
    """Statistic of `chunks.ChunkLoop` giving (lse(z_S), lse(z_T)) per token: `FullKL`'s first pass,
    run without gradient before JSD(β) over vocabulary tiles."""

    def outputs(self, values: list[Tensor]) -> tuple[Tensor, Tensor]:
        return values[1], values[2]


TRITON_TILES.add(Normalisers, KERNEL_OPS)  # `FullKL`'s kernels: the same pass, its two log-normalisers as outputs


STATISTICS = {
    "forward": ForwardKL,
    "reverse": FullKL,
    "jsd": GeneralisedJSD,
    "skewed_forward": SkewedKL,
    "skewed_reverse": SkewedKL,
    "adaptive": AdaptiveKL,
}


def _statistic(choice: Choice, normalisers: tuple[Tensor, Tensor] | None = None, threshold: Tensor | None = None):
    """The loop's statistic of `choice` (`divergence_choice.choose`), given the first pass's log-normalisers where it
    has one, and AKL's head threshold over vocabulary tiles."""
    if choice.name == "forward":
        return ForwardKL()
    if choice.name == "reverse":
        return FullKL()
    if choice.name == "jsd":
        return GeneralisedJSD(cast(float, choice.beta), normalisers)
    if choice.name == "adaptive":
        return AdaptiveKL(cast(float, choice.mu), normalisers, threshold)
    return SkewedKL(choice.name == "skewed_forward", cast(float, choice.skew), normalisers)


def _divergence(
    choice: Choice,
    kinds: tuple,
    temperature: float,
    tiles: Plan,
    vocab: int,
    student: tuple[Tensor | None, ...],
    teacher: tuple[Tensor | None, ...],
    valid: Tensor | None = None,
) -> Tensor:
    """The per-token divergence [N] through `ChunkLoop`, the teacher's inputs detached; hidden states read only
    at `valid` rows (None: all). A `TwoPass` statistic over vocabulary tiles takes both log-normalisers first, AKL
    then its head's threshold (`adaptive_kl.HeadSearch`: one run of the loop a level, over the teacher alone when
    both models' logits are formed in one dtype)."""
    teacher = _detached(teacher)
    normalisers, threshold = None, None
    if issubclass(STATISTICS[choice.name], TwoPass) and tiles[1] < vocab:
        with torch.no_grad():
            normalisers = ChunkLoop.apply(
                Normalisers(), kinds, temperature, tiles, valid, *_detached(student), *teacher
            )
            if choice.name == "adaptive":
                dtype = _dtype(kinds[0], student)
                alone = dtype == _dtype(kinds[1], teacher)
                run = (kinds[1:], teacher) if alone else (kinds, (*_detached(student), *teacher))
                prefix = None
                for shift in levels(dtype):
                    search = HeadSearch(normalisers[1], cast(float, choice.mu), shift, prefix)
                    prefix = ChunkLoop.apply(search, run[0], temperature, tiles, valid, *run[1])
                threshold = logit_of_key(cast(Tensor, prefix), dtype)
    statistic = _statistic(choice, normalisers, threshold)
    return ChunkLoop.apply(statistic, kinds, temperature, tiles, valid, *student, *teacher)


def _dtype(kind, tensors: tuple[Tensor | None, ...]) -> torch.dtype:
    """The dtype a loop forms a source's logits in (`chunks.ChunkLoop`: its weight's, or its logits', compute dtype)."""
    return compute_dtype(cast(Tensor, tensors[0] if kind == "logits" else tensors[1]).dtype)


def _detached(tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    return tuple(None if t is None else t.detach() for t in tensors)


def divergence_output(
    per_token: Tensor, mask: Tensor, loss_agg_mode: str, normalizer: Normalizer | None, norm_constant: float | None
) -> LossOutput:
    """A per-token divergence as a `LossOutput`: 0 under the mask, aggregated with the step's counts, its mean
    over the valid tokens as the metric `divergence` (every divergence entry point's, the top-k ones too)."""
    per_token = torch.where(mask, per_token, 0.0)
    loss = aggregate(per_token, mask, loss_agg_mode, normalizer=normalizer, norm_constant=norm_constant)
    count = mask.sum()
    mean = per_token.detach().sum() / count.clamp(min=1).to(per_token.dtype)  # 0 over no token
    return LossOutput.of(loss, {"divergence": Stat.mean(mean, count)}, per_token)


def divergence_from_logits(
    student_logits: Tensor,
    teacher_logits: Tensor,
    mask: Tensor,
    *,
    beta: float | None = None,
    divergence: str | None = None,
    skew: float | None = None,
    mu: float | None = None,
    temperature: float = 1.0,
    loss_agg_mode: str = "token-mean",
    normalizer: Normalizer | None = None,
    norm_constant: float | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
) -> LossOutput:
    """The student-teacher divergence D (module docstring) per position from both models' logits.

    β = 0: KL(p_T‖p_S); β = 1: KL(p_S‖p_T) (= `full_kl_from_logits(student, teacher)`);
    0 < β < 1: JSD(β) = β KL(p_T‖m) + (1 − β) KL(p_S‖m), m = β p_T + (1 − β) p_S (GKD, arXiv
    2306.13649, Eq. 1; TRL 1.16 `GKDTrainer.generalized_jsd_loss`). `divergence=` names the others: the
    skewed forward / reverse KL (DistiLLM, `skewed.py`) and AKL (`adaptive_kl.py`; whole-vocabulary rows).

    Args:
        student_logits: [B, T, V] student logits (any float dtype; the math runs in float32, float64 stays).
        teacher_logits: [B, T, V] teacher logits, never differentiated.
        mask: [B, T] bool or 0/1, the positions that count. Logits at masked positions need only be finite.
        beta: β in [0, 1], the weight of the teacher's side (above); alone, it names the divergence.
        divergence: "forward", "reverse", "jsd" (with `beta`), "skewed_forward", "skewed_reverse" (with `skew`)
            or "adaptive" (with `mu`); None: by `beta` (`divergence_choice.choose`, which refuses a parameter
            given to a divergence that does not take it).
        skew: λ in (0, 1) of the skewed KLs, the weight of the first distribution in the mixture (None: 0.1).
        mu: μ in (0, 1) of AKL, the teacher's cumulative mass its head reaches (None: 0.5).
        temperature: τ > 0, dividing both models' logits.
        loss_agg_mode: how `per_token` becomes `loss` (`pgloss.aggregate`); "token-mean", the default, is
            TRL's reduction: Σ D / (valid tokens), over the step's tokens with a `normalizer`
            (TRL's `num_items_in_batch`).
        normalizer: the step's counts (`Normalizer.count` over every micro-batch's mask); None: this call
            is the whole step.
        norm_constant: C of the budget modes (`seq-mean-token-sum-norm`, `delta-l-norm`).
        chunk_size: positions per chunk (`chunks.plan_tiles`); None picks about 2²⁷ / V.
        vocab_block: vocabulary columns per tile (None: the whole vocabulary); "adaptive" refuses one below V.
        memory_budget: bytes for the loop's buffers, exclusive with chunk_size and vocab_block.

    Returns:
        `LossOutput`: `per_token` [B, T] (0 at masked positions; float32, float64 for float64 logits) with
        its gradient to `student_logits` only, `loss` its aggregate, `metrics["divergence"]` its detached
        mean over valid tokens.
    """
    check_logit_pair(student_logits, teacher_logits, names=("student_logits", "teacher_logits"))
    if student_logits.dim() != 3:
        raise ValueError(f"student_logits must have shape [B, T, V], got {tuple(student_logits.shape)}")
    mask = check_mask(mask, student_logits.shape[:2], student_logits.device, "student_logits")
    choice, temperature = choose(divergence, beta, skew, mu), check_temperature(temperature)
    batch, length, vocab = student_logits.shape
    student, teacher = student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab)
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    kinds = ("logits", "logits")
    tiles = plan(STATISTICS[choice.name], kinds, student, batch * length, **sizes)  # torch, or refused
    per_token = _divergence(choice, kinds, temperature, tiles, vocab, (student,), (teacher,))
    return divergence_output(per_token.view(batch, length), mask, loss_agg_mode, normalizer, norm_constant)


@refuses_head_keywords("", "teacher_")
def divergence_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    mask: Tensor,
    *,
    beta: float | None = None,
    divergence: str | None = None,
    skew: float | None = None,
    mu: float | None = None,
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
    """The student-teacher divergence D_β (module docstring) per position from both models' final hidden
    states and LM heads, without the N x V logits of either. Each model's logits before the temperature are

        logits = c · tanh(s · (x Wᵀ + b) / c)        (s · (x Wᵀ + b) without a soft-cap c)

    with its bias b, logit scale s and soft-cap c, and p_S = softmax(logits_S / τ), p_T = softmax(logits_T / τ):
    TRL 1.16's `ChunkedDivergenceFunction` (trl/kernels/chunked_divergence.py) computes the same, options
    included, in the same order (bias, scale, soft-cap, temperature); this one runs pgloss's one chunk loop
    (the tiles of `chunks.plan_tiles`). The student's gradient passes through the soft-cap's slope
    s (1 − tanh²(s (x Wᵀ + b) / c)).

    Args:
        hidden: [B, T, H] student hidden states.
        weight: [V, H] student output projection, the dtype and device of `hidden`.
        teacher_hidden: [B, T, H'] teacher hidden states (H' may differ from H); never differentiated.
        teacher_weight: [V, H'] teacher output projection, the dtype of `teacher_hidden`; never differentiated.
        mask: [B, T] bool or 0/1, the positions that count; neither model's hidden states are read elsewhere
            (NaN and inf allowed: `chunks.HeadRows`).
        beta: β of JSD(β), as `divergence_from_logits`.
        divergence: the divergence's name, as `divergence_from_logits`.
        skew: λ of the skewed KLs, as `divergence_from_logits`.
        mu: μ of AKL, as `divergence_from_logits`.
        temperature: τ > 0, dividing both models' logits.
        head: the student head's bias b ([V], the dtype and device of `weight`; a half-precision bias is added to
            the float32 logits), logit scale s > 0 (Cohere's `logit_scale`; Granite's `logits_scaling` is 1/s)
            and soft-cap c > 0 of c · tanh(logits / c) (Gemma's `final_logit_softcapping`), a
            `pgloss.HeadOptions` (None: the plain head). `pgloss.integrations.lm_head.head_options(model)`
            reads them from a model.
        teacher_head: the teacher head's options, as `head`; its bias has the dtype and device of
            `teacher_weight`.
        loss_agg_mode: how `per_token` becomes `loss`, as `divergence_from_logits`.
        normalizer: the step's counts, as `divergence_from_logits`.
        norm_constant: C of the budget modes, as `divergence_from_logits`.
        chunk_size: positions per chunk; None picks about 2²⁷ / V.
        vocab_block: vocabulary columns per tile (None: the whole vocabulary).
        memory_budget: bytes for the loop's buffers, exclusive with chunk_size and vocab_block (a
            soft-capped student adds one buffer, its slope).

    Returns:
        `LossOutput` as `divergence_from_logits`; gradients flow to `hidden`, `weight` and `bias` (whichever
        requires grad), none to the teacher's inputs.
    """
    check_tensor("mask", mask, ndim=(2,), floating=False)  # required here (None would mean every position)
    choice = choose(divergence, beta, skew, mu)
    kinds, tiles, student, teacher, valid = head_pair(
        STATISTICS[choice.name],  # the route is chosen for its statistic (torch for those no kernel holds)
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
    temperature = check_temperature(temperature)
    per_token = _divergence(choice, kinds, temperature, tiles, weight.shape[0], student, teacher, valid.reshape(-1))
    return divergence_output(per_token.view(hidden.shape[:2]), valid, loss_agg_mode, normalizer, norm_constant)
