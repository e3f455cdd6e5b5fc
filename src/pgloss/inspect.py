"""How much gradient each token gets from a loss, and why: g_{i,t} = ∂L/∂log π_θ(y_{i,t}).

The gradient of any of these losses with respect to the model's parameters is
Σ_{i,t} g_{i,t} ∇_θ log π_θ(y_{i,t}|·): g is the weight the loss puts on each token's log-prob
(a negative g makes the optimizer raise the token's probability). `token_gradients` computes g
with autograd from the algorithm's own loss (same mask, same normaliser), so it holds for every
algorithm. Where the loss has one, `closed_form` decomposes it into three factors,

    g_{i,t} = -Â_{i,t} · f_{i,t} · w_{i,t}

with Â the advantage, f the ratio or clip factor (∂ of the policy term with respect to log π,
divided by -Â) and w the aggregation weight (`aggregate.token_weights`: 1/N_tok for token-mean,
1/(N_seq·|y_i|) for seq-mean-token-mean, 1/(N_seq·C) for Dr.GRPO's constant divisor, ...).
For PPO's clip at token level f = r inside the clip range and 0 where the clip is active; for
the whole-sequence ratio of the sample-level loss f = ρ_i = π_θ(y_i)/π_old(y_i) on every token
with the weight of the sequence, |y_i| times the per-token weight of seq-mean-token-mean; for
GSPO f = s_i / |y_i| likewise. The KL and entropy terms are left out of the closed form: pass
no ref_log_prob and no entropy (or algorithms without them) to compare it with autograd.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .algorithms import Algorithm


@dataclass(frozen=True)
class TokenGradients:
    """The per-token gradient of a loss with respect to log π_θ, `[B, T]`, and its factors."""

    grad: Tensor
    """g_{i,t} = ∂L/∂log π_θ(y_{i,t}) by autograd (0 at masked positions)."""
    advantage: Tensor
    """Â_{i,t}, the advantage broadcast to `[B, T]`."""
    factor: Tensor | None
    """f_{i,t}: the ratio or clip factor, None where no closed form exists."""
    weight: Tensor | None
    """w_{i,t}: the aggregation weight of the token in the loss, None where no closed form exists."""

    @property
    def closed_form(self) -> Tensor | None:
        """-Â·f·w, the closed-form gradient (None where the algorithm has none)."""
        if self.factor is None or self.weight is None:
            return None
        return -self.advantage * self.factor * self.weight


def token_gradients(algorithm: Algorithm, log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor,
                    mask: Tensor, **kwargs) -> Tensor:
    """g = ∂L/∂log π_θ by autograd, `[B, T]`: `algorithm`'s loss on this batch, called with the
    same arguments as `algorithm(...)` (`kwargs`: ref_log_prob, entropy, normalizer, group_ids, ...)."""
    if not isinstance(algorithm, Algorithm):
        raise TypeError(f"algorithm must be a pgloss Algorithm (pgloss.get(name)), got {type(algorithm).__name__}")
    if not isinstance(log_prob, Tensor):
        raise TypeError(f"log_prob must be a tensor, got {type(log_prob).__name__}")
    leaf = log_prob.detach().clone().requires_grad_(True)
    out = algorithm(leaf, old_log_prob, advantages, mask, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, leaf, allow_unused=True)
    return torch.zeros_like(leaf) if grad is None else grad.detach()
