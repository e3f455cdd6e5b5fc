"""An algorithm's loss straight from hidden states, without materialising the N × V logits: the driver of the
vocabulary loop (`pgloss.vocab`), beside the `Algorithm` it drives (`Algorithm.from_hidden` calls it).

For hidden states x [B, T, H] and the LM head W [V, H] (its bias b [V] or none, its logit scale s
and soft-cap c: `head.HeadOptions`), the tempered logits of token n are

    z_n = c · tanh(s · (W x_n + b) / c) / τ        (s · (W x_n + b) / τ without a soft-cap)

and chunk by chunk over the N = B·T tokens

    log π(y_n) = z_{n,y} − lse(z_n),        H_n = lse(z_n) − Σᵥ π_{n,v} z_{n,v}

(`pgloss.vocab.entropy` holds the per-chunk math). With G = ∂L/∂(W x + b) of a chunk
(`pgloss.vocab.entropy.chunk_grad_logits` times the head's slope s (1 − tanh²(s (W x + b) / c))),

    ∂L/∂x = G W,        ∂L/∂W = Σ_chunks Gᵀ x,        ∂L/∂b = Σ_chunks Σ_rows G.

A call resolves its plan once (`LossPlan`, `plan_call`): the vocabulary loop's backend and tiles
(`pgloss.vocab.plan.plan`, the one choice of the route) and one of two paths, handed down to the loop. Both give
the loss of `algorithm(log_prob=log π, entropy=H, ...)` on the full logits, for every algorithm and `Normalizer`:

- one pass (whole sequences fit in a chunk, T ≤ chunk_size): chunks of whole rows, each row chunk's
  loss under the step's `Normalizer` its exact share of the batch loss, so G W and Gᵀ x are formed in
  the forward pass: three N·H·V matmuls, the 6NHV floor (`one_pass.py`).
- recompute (longer sequences, chunks of tokens): `pgloss.vocab.chunks.ChunkLoop` with a head source; forward
  keeps only the per-token lse; backward recomputes each chunk's logits: four matmuls, 8NHV.

Memory beyond the inputs and their gradients: one [chunk, V] buffer and cache-sized blocks; with
`vocab_block` < V (or a `memory_budget`), one [chunk, vocab_block] tile, the statistics accumulated
over tiles with an online max and each tile recomputed for the gradient (8NHV on either route).

The same idea: Liger-Kernel's fused linear losses (Hsu et al. 2024, https://arxiv.org/abs/2410.10989)
and "Cut Your Losses in Large-Vocabulary Language Models" (Wijmans et al. 2024,
https://arxiv.org/abs/2411.09009).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core.batch import compute_dtype
from ..core.inputs import OPTIONAL_INPUTS, check_names
from ..core.normalizer import Normalizer
from ..core.output import LossOutput
from ..kl.corrections import FULL
from ..vocab.backends import TRITON_HEAD, Plan
from ..vocab.entropy import LogProbEntropy, check_temperature
from ..vocab.full_kl import FullKL
from ..vocab.fused import check_inputs, full_head, log_prob_and_entropy_on_plan, valid_targets
from ..vocab.head import HeadOptions, as_head, refuses_head_keywords
from ..vocab.pair import pair_from_hidden
from ..vocab.plan import plan
from ..vocab.support import SupportLogProbEntropy, check_support
from .one_pass import AttachGradients, FusedAlgorithm, loss_one_pass

__all__ = ["loss_from_hidden", "LossPlan", "plan_call", "PASSED_INPUTS"]


@dataclass(frozen=True)
class LossPlan:
    """How one call from hidden states runs, resolved once (`plan_call`) and handed down: the vocabulary loop's plan
    (`tiles`: its backend, tokens per chunk and vocabulary columns per tile) and, when the loss's gradients cannot
    be formed in one pass, the reason they are recomputed (`recompute`; None: the one pass)."""

    tiles: Plan
    recompute: str | None

    @property
    def one_pass(self) -> bool:
        return self.recompute is None


def plan_call(
    algorithm: FusedAlgorithm,
    tiles: Plan,
    *,
    length: int,
    needs_grad: bool,
    exact_kl: bool,
    counted_on_log_prob: bool,
    support: bool = False,
) -> LossPlan:
    """The call's `LossPlan` on the loop's `tiles`: the one pass, unless one of these holds (the first named)."""
    reasons = {
        # The head kernels hold no logits for a one pass to reuse: their recompute costs the same 8NHV.
        "the head kernels hold no logits": tiles.backend is TRITON_HEAD,
        "no gradient is wanted": not needs_grad,
        "no token in a row": length == 0,
        "a sequence is longer than a chunk": length > tiles.chunk_size,
        # One call must see the whole batch: a row-coupled loss (Clip-Cov, KL-Cov, REAL) and the exact KL's.
        "the loss couples rows": algorithm.couples_rows,
        "the exact KL is computed": exact_kl,
        # On-policy with rollout log-probs and no step counts given, the counts may read log π_old = log π (a
        # rollout correction's rejections), known only once log π is: the one pass needs them before its first chunk.
        "the step's counts read log π": counted_on_log_prob,
        # The one pass forms the gradients of log π over the whole vocabulary (`vocab.support`: torch tiles only).
        "the rollout's support is replayed": support,
    }
    return LossPlan(tiles, next((why for why, holds in reasons.items() if holds), None))


PASSED_INPUTS = {name: spec for name, spec in OPTIONAL_INPUTS.items() if name not in ("entropy", "full_kl")}
"""The optional inputs `from_hidden` passes to the loss as given; it computes the entropy and the exact KL."""


@refuses_head_keywords("", "ref_")
def loss_from_hidden(
    algorithm: FusedAlgorithm,  # a pgloss.Algorithm, handed in by its from_hidden (base.py imports this module)
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    old_log_prob: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    temperature: float = 1.0,
    normalizer: Normalizer | None = None,
    head: HeadOptions | None = None,
    ref_hidden: Tensor | None = None,
    ref_weight: Tensor | None = None,
    ref_head: HeadOptions | None = None,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
    support: Tensor | None = None,
    **inputs: Tensor | None,
) -> LossOutput:
    """`algorithm`'s loss on the LM head's tempered logits, computed without materialising them:

        logits = c · tanh(s · (hidden @ weightᵀ + bias) / c) / τ        (no tanh without a soft-cap c)

    Equal to `algorithm(log_prob=log π(y), entropy=H, ...)` with log π and H from the full
    logits (see the module docstring), with gradients for `hidden`, `weight` and `bias`. The entropy
    gets a gradient only when `algorithm.entropy_coef` ≠ 0; otherwise it feeds the metric only.

    When whole sequences fit in a chunk (T ≤ chunk_size) and a gradient is wanted, the gradients
    are computed during this call (6NHV flops, `one_pass.loss_one_pass`) and handed out by `loss.backward()`,
    scaled by the caller's ∂/∂loss; backward then runs once, and `per_token` carries no gradient. Otherwise
    the logits are recomputed in backward (8NHV flops). Row-coupled algorithms
    (`algorithm.couples_rows`: Clip-Cov, KL-Cov, REAL) and the exact KL always take that route, so
    that one call sees the whole batch.

    On-policy (`old_log_prob=None`), log π_old is the detached log π of this same pass, as the plain call
    takes it (`pgloss.Algorithm.__call__`): the ratio is exactly 1 and the gradient that of the on-policy loss,
    without a second pass over the head to compute log π_old first.

    Args:
        algorithm: a `pgloss.Algorithm`, e.g. `pgloss.get("grpo")`.
        hidden: [B, T, H] final hidden states of the policy (the positions that predict `targets`); never read
            at masked positions (NaN and inf allowed there: `chunks.HeadRows`), nor `ref_hidden`.
        weight: [V, H] output projection (the LM head), same dtype and device as `hidden`; an
            FSDP2-sharded head (DTensor) is gathered once for the call (`full_head`).
        targets: [B, T] integer token ids; values at masked positions are ignored (e.g. -100).
        old_log_prob: [B, T] log π_old(y) of the policy that sampled the batch, as for `algorithm(...)`; None:
            on-policy, the detached log π computed here (the same values and gradient as passing it).
        advantages: [B] or [B, T], as for `algorithm(...)`.
        mask: [B, T] bool or 0/1, the tokens that count, as for `algorithm(...)`.
        temperature: τ > 0, the sampling temperature.
        normalizer: the step's counts, as for `algorithm(...)` (None: this call is the whole step).
        head: the LM head's bias b, logit scale s and soft-cap c, a `pgloss.HeadOptions` (None: the plain
            head); its bias has the weight's dtype and device and is gathered like it.
            `pgloss.integrations.lm_head.head_options(model)` reads them from a transformers model.
        ref_hidden: [B, T, H'], the reference model's final hidden states, for kl_estimator="full": the exact
            KL(π‖π_ref) per token is computed from them chunk by chunk
            (`pgloss.vocab.full_kl.full_kl_from_hidden`) and passed as `full_kl`.
        ref_weight: [V, H'], the reference model's LM head, with `ref_hidden`.
        ref_head: the reference head's options, as `head` (never differentiated); only with `ref_hidden`.
        chunk_size: tokens per chunk (rounded down to whole sequences on the one-pass path);
            None picks about 2²⁷ / V (≈ 512 MiB of float32 logits per chunk).
        vocab_block: vocabulary columns per tile (None: the whole vocabulary). Below V, each chunk's
            log-sum-exp, log π(y), H and exact KL accumulate over tiles with an online max, and
            each tile's logits are recomputed for the gradient (8NHV flops on either route).
        memory_budget: bytes for the loop's logits buffers, exclusive with chunk_size and
            vocab_block; the chunk and tile are chosen from it (`pgloss.vocab.chunks.plan_tiles`).
        support: [B, T, k] integer token ids, the support the rollout sampled each position from (its top-k
            ids or top-p nucleus, padded with -1; SkyRL's `enable_sample_support_replay`): log π and H are
            those of the logits restricted to it (`pgloss.vocab.support`), on the torch tiles and the
            recompute route (8NHV); ids are checked at valid positions only. None: the whole vocabulary.
        **inputs: the optional inputs of `algorithm(...)` but `entropy` and `full_kl` (computed here);
            floating tensors are cast to the compute dtype (float32, or float64 for float64 parameters).
    """
    check_names(inputs, PASSED_INPUTS)
    policy, ref = as_head(head), as_head(ref_head, prefix="ref_")
    weight = full_head(weight)
    policy = policy.with_bias(full_head(policy.bias))
    valid = check_inputs(hidden, weight, targets, mask)
    kind, bias = policy.check(weight), policy.bias
    temperature = check_temperature(temperature)
    tokens = hidden.shape[0] * hidden.shape[1]
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    ids = None
    if support is not None:
        if isinstance(support, Tensor) and support.device != hidden.device:
            raise ValueError(f"support is on {support.device} but hidden is on {hidden.device}")
        ids = check_support(support, hidden.shape[:-1], weight.shape[0], valid)
    statistic = LogProbEntropy if ids is None else SupportLogProbEntropy
    tiles = plan(statistic, (kind,), weight, tokens, **sizes)  # the one choice of the route for the call
    safe_targets = valid_targets(targets, valid)
    dtype = compute_dtype(weight.dtype)

    def cast(value: Tensor | None) -> Tensor | None:
        floating = isinstance(value, Tensor) and value.dtype.is_floating_point
        return value.to(dtype) if floating and value is not None else value

    # The mask as bool, checked once here rather than again by every chunk's call. Any: the call's inputs by name.
    batch: dict[str, Any] = dict(
        old_log_prob=cast(old_log_prob),
        advantages=advantages,
        mask=valid,
        **{name: cast(value) for name, value in inputs.items() if value is not None},
    )
    exact_kl = algorithm.kl_estimator == FULL and (algorithm.kl_coef != 0 or ref_hidden is not None)
    if exact_kl:
        if ref_hidden is None or ref_weight is None:
            raise ValueError(f"{algorithm.name} has kl_estimator='full' and needs ref_hidden and ref_weight")
        batch["full_kl"] = pair_from_hidden(
            FullKL(),
            hidden,
            weight,
            ref_hidden,
            full_head(ref_weight),
            "ref",
            head=policy,
            other_head=ref.with_bias(full_head(ref.bias)),
            temperature=temperature,
            mask=valid,
            **sizes,
        )
    elif ref_hidden is not None or ref_weight is not None or ref_head is not None:
        raise ValueError(
            f"ref_hidden, ref_weight and ref_head are for kl_estimator='full'; {algorithm.name} has "
            f"kl_estimator={algorithm.kl_estimator!r} (pass ref_log_prob)"
        )
    length = hidden.shape[1]
    params = (hidden, weight) if bias is None else (hidden, weight, bias)
    needs_grad = torch.is_grad_enabled() and any(p.requires_grad for p in params)
    counted_on_log_prob = normalizer is None and old_log_prob is None and inputs.get("rollout_log_prob") is not None
    call = plan_call(
        algorithm,
        tiles,
        length=length,
        needs_grad=needs_grad,
        exact_kl=exact_kl,
        counted_on_log_prob=counted_on_log_prob,
        support=ids is not None,
    )
    if not call.one_pass:  # log π and H by token chunks, one call for the batch, logits recomputed in backward
        log_prob, entropy = log_prob_and_entropy_on_plan(
            hidden, weight, safe_targets, bias, kind, temperature, valid, call.tiles, ids
        )
        return algorithm(log_prob=log_prob, entropy=entropy, normalizer=normalizer, **batch)

    step = normalizer
    if step is None:  # this batch is the whole step: counted once for every chunk, as the call counts it
        given: dict[str, Any] = inputs  # the call's optional inputs: none is an option of count_step
        step = algorithm.count_step(valid, old_log_prob=batch["old_log_prob"], reduce=False, **given)
    with torch.no_grad():
        result = loss_one_pass(
            algorithm, hidden, weight, bias, kind, safe_targets, temperature, call.tiles, step, batch
        )
        out = result.output
        if out is None:  # several row chunks: the batch's value and metrics from one call on its log π and H
            out = algorithm(log_prob=result.log_prob, entropy=result.entropy, normalizer=step, **batch)
    loss = AttachGradients.apply(out.loss, hidden, weight, bias, *result.grads)
    return dataclasses.replace(out, loss=loss)
