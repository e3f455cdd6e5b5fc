"""How much gradient each token gets from a loss, and why: g_{i,t} = ∂L/∂log π_θ(y_{i,t}).

The gradient of a loss with respect to the model's parameters is Σ_{i,t} g_{i,t} ∇_θ log π_θ(y_{i,t}|·):
g is the weight the loss puts on each token's log-prob (a negative g raises the token's probability).
`inspect` computes g with autograd from the algorithm's own loss (same mask, same normaliser), so it
holds for every algorithm, and, where the family has one, its closed form

    g_{i,t} = -Â_{i,t} · f_{i,t} · w_{i,t}

with Â the advantage, w the aggregation weight of the token (`aggregate.token_weights`: 1/N_tok for
token-mean, 1/(N_seq·|y_i|) for seq-mean-token-mean, 1/N_seq for seq-mean-token-sum, 1/(N_seq·C) for
Dr.GRPO's constant divisor, 1/(N_grp·n_g) per group) and f the family's factor, which each family
defines beside its per-token function (`gradient_factor`, `losses/closed_form.py`):

    token ratio (PPO, GRPO, DAPO, BNPO, Dr.GRPO)   f = r · b(r)                  losses/ppo.py
    sequence ratio s_i (GSPO, GSPO-token, LUSPO)   f = s_i · b(s_i)
    whole-sequence ratio ρ_i (sample_grpo)         f = |y_i| · ρ_i · b(ρ_i)
    CISPO                                          f = clip(r, 1 - ε_low, 1 + ε_high)   (detached weight)
    GPG                                            f = 1                          losses/reinforce.py
    TIS-PG, TOPR                                   f = sg[clip(r, lo, hi)] (TOPR: 1 where the score > 0)
    SAPO                                           f = 4·σ(τ(r-1))·(1 - σ(τ(r-1))) · r
    FIPO                                           f = sg[influence] · r · b(r)
    Clip-Cov                                       f = r · b(r) · (1 - picked)    losses/clip_cov.py
    DPPO                                           f = sg[min(r, c)] · sg[valid]  losses/dppo.py
    VESPO                                          f = sg[φ(w_i)]                 losses/vespo.py

where b(r) = ∂(clipped surrogate)/∂r ÷ (-Â) is 1 inside the clip range and 0 where a clip, the dual
clip or the δ cap is active (½ on a tie, as autograd splits max and min), and every ratio counts only
while its log is within ±max_log_ratio. With a rollout correction (the algorithm's
`rollout_correction`, or truncated importance sampling when only rollout_log_prob is given), f is
multiplied by its weight (for a ratio shared by the sequence, GSPO's and the sample-level one, by its
mean over the sequence), its rejections leave the mask, and in bypass mode the ratio is against the
rollout log-probs. The closed form is of the policy term: `policy_grad` is autograd's gradient without
the KL and entropy terms, `grad` with them. The entropy and the exact KL (`full_kl`) are functions of
the whole distribution, passed as inputs: their gradient reaches the logits, not log π_θ(y_t), so they
add nothing to g (`grad` holds the sampled-token KL estimators' gradient). Families without a closed
form (GMPO, KL-Cov, DRO, CE-GPPO, REAL, and a user's own), and sequence ratios with per-token
advantages, have `closed_form` None and `reason` says why; `grad` is autograd's either way.

A family that draws at random (Clip-Cov) draws the same selection for `grad`, `policy_grad` and the
closed form, the one the next training call would draw: `inspect` runs each from the generator state
it found (the algorithm's own `torch.Generator` fields and torch's global CPU generator) and puts that
state back, so a diagnostic never changes the next training draw.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..base import Algorithm
from ..core.batch import TokenBatch
from ..core.inputs import check_names
from ..core.normalizer import Normalizer
from ..core.sequence_parallel import row_mean
from ..losses.closed_form import GradientFactor

__all__ = ["TokenGradients", "inspect", "token_gradients"]


@dataclass(frozen=True)
class TokenGradients:
    """The per-token gradient of a loss with respect to log π_θ, `[B, T]`, and its factors."""

    grad: Tensor
    """g = ∂L/∂log π_θ of the whole loss (the sampled-token KL term included; the entropy and the exact KL
    are functions of the logits and add nothing here), by autograd; 0 where masked."""
    policy_grad: Tensor
    """The same without the KL and entropy terms: what `closed_form` equals."""
    advantage: Tensor
    """Â_{i,t}, broadcast to `[B, T]`, 0 where masked."""
    weight: Tensor
    """w_{i,t}, the aggregation weight of each token in the loss (0 where masked)."""
    factor: Tensor | None
    """f_{i,t}, the ratio or clip factor; None where the family has no closed form here."""
    reason: str
    """Which closed form applies, or why there is none."""

    @property
    def closed_form(self) -> Tensor | None:
        """-Â·f·w, equal to `policy_grad` (None where there is no closed form)."""
        return None if self.factor is None else -self.advantage * self.factor * self.weight


def token_gradients(
    algorithm: Algorithm, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor, **kwargs
) -> Tensor:
    """g = ∂L/∂log π_θ by autograd, `[B, T]`: `algorithm`'s loss on this batch, called with the same
    arguments as `algorithm(...)` (`kwargs`: ref_log_prob, entropy, normalizer, group_ids, full_kl, ...).
    Inputs other than `log_prob` are taken detached: g is the gradient with respect to log π_θ(y_t) alone."""
    _check_algorithm(algorithm)
    if not isinstance(log_prob, Tensor):
        raise TypeError(f"log_prob must be a tensor, got {type(log_prob).__name__}")
    leaf = log_prob.detach().clone().requires_grad_(True)
    kwargs = {key: value.detach() if isinstance(value, Tensor) else value for key, value in kwargs.items()}
    out = algorithm(leaf, old_log_prob, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf, allow_unused=True)
    return torch.zeros_like(leaf) if grad is None else grad.detach()


_TERM_INPUTS = ("ref_log_prob", "entropy", "full_kl")
"""The inputs of the KL and entropy terms, which `policy_grad` leaves out."""


def inspect(
    algorithm: Algorithm,
    log_prob: Tensor,
    old_log_prob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    normalizer: Normalizer | None = None,
    **inputs: Tensor | None,
) -> TokenGradients:
    """The per-token gradient of `algorithm`'s loss on this batch and its decomposition -Â·f·w.

    Arguments as for `algorithm(...)`; without `normalizer` the batch is the whole step. A random
    selection (Clip-Cov) is the one the next training call would draw, the same in `grad`,
    `policy_grad` and the closed form, and the generators are left as they were found.
    """
    _check_algorithm(algorithm)
    check_names(inputs)
    own = type(algorithm).required_inputs  # a family's own input stays (A*-PO's ref_log_prob)
    policy_inputs = {name: value for name, value in inputs.items() if name not in _TERM_INPUTS or name in own}
    policy_only = algorithm.policy_only()
    with _replayed_draws(algorithm) as rewind:
        grad = token_gradients(algorithm, log_prob, old_log_prob, advantages, mask, normalizer=normalizer, **inputs)
        rewind()
        policy_grad = token_gradients(
            policy_only, log_prob, old_log_prob, advantages, mask, normalizer=normalizer, **policy_inputs
        )
        rewind()
        split = None if normalizer is None else normalizer.sequence_parallel  # as the call prepares its batch
        batch = TokenBatch.prepare(
            log_prob.detach(), old_log_prob, advantages, mask, sequence_parallel=split, **policy_inputs
        )
        batch, normalizer, corrected = algorithm.corrected(batch, normalizer)  # the call's own prelude
        tis = None if corrected is None else corrected.weight
        rows = algorithm.row_weights(batch, normalizer, algorithm.policy_parts())
        weight = (batch.mask.to(torch.float64) * rows[:, None]).to(batch.log_prob.dtype) * normalizer.world_size
        closed = _closed_form(algorithm, batch)
    factor, reason = closed.factor, closed.reason
    if factor is not None:
        if tis is not None:
            if closed.per_sequence:  # ℓ_i is weighted token by token, then summed over the whole sequence
                tis = row_mean(torch.where(batch.mask, tis, 0.0), batch.mask, batch.sequence_parallel, keepdim=True)
            factor, reason = factor * tis, reason + ", times the rollout correction's weight"
        factor = torch.where(batch.mask, factor, 0.0)
    return TokenGradients(
        grad=grad, policy_grad=policy_grad, advantage=batch.advantages, weight=weight, factor=factor, reason=reason
    )


def _check_algorithm(algorithm: object) -> None:
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be a pgloss Algorithm (pgloss.get(name)), got {type(algorithm).__name__}")


def _closed_form(algorithm: Algorithm, batch: TokenBatch) -> GradientFactor:
    """The family's own closed form (`gradient_factor`, beside its per-token function), if it has one."""
    gradient_factor = getattr(algorithm, "gradient_factor", None)
    if gradient_factor is None:
        return GradientFactor(None, f"no closed form for the {type(algorithm).__name__} family; grad is autograd's")
    return gradient_factor(batch)


@contextlib.contextmanager
def _replayed_draws(algorithm: Algorithm) -> Iterator[Callable[[], None]]:
    """Yield `rewind()`, which puts every generator a loss call may draw from (the algorithm's own
    `torch.Generator` fields, torch's global CPU generator and, once CUDA is in use, each GPU's) back
    to its state on entry; on exit they are left in that state, so the diagnostic's draws are the next
    training call's."""
    generators = [
        value
        for value in (getattr(algorithm, f.name) for f in dataclasses.fields(algorithm))
        if isinstance(value, torch.Generator)
    ]
    states = [g.get_state() for g in generators]
    global_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def rewind() -> None:
        for generator, state in zip(generators, states, strict=True):
            generator.set_state(state)
        torch.set_rng_state(global_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)

    try:
        yield rewind
    finally:
        rewind()
