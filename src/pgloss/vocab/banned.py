"""Banned tokens: a −inf logit (a −inf in an LM head's bias, a logits processor's ban, padded vocabulary rows masked
with −inf) is a token the model can never sample. The rule, in one place for both routes of the vocabulary loop (the
torch code calls these functions, the Triton kernels read the same constant):

- every tempered logit z is clamped from below at `BANNED_LOGIT` = −2⁶⁴, so a banned token has π = e^{z − lse} = 0
  exactly, adds 0 · (finite) = 0 to the entropy, the exact KL and JSD(β), and no sum meets −∞ − (−∞). A logit
  that far down is taken as banned whatever it was (−inf, or a finite mask value such as float32's lowest);
  −2⁶⁴ leaves room for any realistic shift of the logits (softmax stays shift-invariant: verl #7439) and for
  products of it with a tile's sums (V · 2⁶⁴ < float32's largest value);
- a banned token gets no gradient (the clamp's: a −inf logit does not move whatever the weights do). The
  statistics' gradients carry a factor π = 0 there, but two terms do not: the target's indicator in ∂log π(y)
  (handled by the floor below) and the teacher's π_T in ∂KL(π_T‖π)/∂z (`divergence.ForwardKL`), which zero it;
- a target on a banned token has log π(y) = −∞, which would poison the loss (∞ in a KL estimator, 0 · −∞ in a
  gradient): `log_prob_floor` takes log π(y) = `LOG_PROB_FLOOR` (−10⁴, a probability of e^{−10⁴}, 0 in every
  float format) whenever it would be lower, and passes no gradient through it (`floored_grad`).

What stays: a KL that puts mass where the other model bans a token is +∞ in exact arithmetic; here it is finite,
of order 2⁶⁴ π_v (the banned logit taken as −2⁶⁴): a reference or a teacher should ban what the policy bans. A row
whose every logit is banned is no distribution: its values are those of the uniform one over the clamped logits.
Under a soft-cap c a −inf bias is the finite logit c · tanh(−∞) = −c, not a ban (the head's formula, followed).
"""

from __future__ import annotations

import torch
from torch import Tensor

BANNED_LOGIT = -(2.0**64)
LOG_PROB_FLOOR = -1e4


def clamp_banned_(z: Tensor) -> Tensor:
    """The tempered logits `z`, in place: each below `BANNED_LOGIT` (−inf included) raised to it."""
    return z.clamp_(min=BANNED_LOGIT)


def log_prob_floor(log_prob: Tensor, z_target: Tensor) -> Tensor:
    """log π(y) (`log_prob`, z_y − lse of tempered logits whose target's is `z_target`, clamped) floored at
    `LOG_PROB_FLOOR`: a banned target (z_y at `BANNED_LOGIT`, even in a row whose every logit is banned) gets it."""
    keep = (log_prob > LOG_PROB_FLOOR) & (z_target > BANNED_LOGIT)
    return torch.where(keep, log_prob, LOG_PROB_FLOOR)


def floored_grad(log_prob: Tensor, grad: Tensor | None) -> Tensor | None:
    """∂L/∂log π(y) passed on where log π(y) is above the floor, 0 where `log_prob_floor` floored it."""
    return None if grad is None else torch.where(log_prob > LOG_PROB_FLOOR, grad, 0.0)
