"""Sampling-support replay: log π(y) and H over the support the rollout sampled from at each position.

A sampler with top-k or top-p draws token y_t from π restricted to a support S_t (the top-k ids, or the top-p
nucleus) and renormalised there. Replaying that support in training scores the same distribution:

    log π_S(y) = z_y − lse_{v ∈ S}(z_v),        H_S = −Σ_{v ∈ S} π_S,v log π_S,v,    π_S,v = e^{z_v − lse_S}

with z the tempered logits (z = logits / τ; hidden states: the head's logits / τ). The support is given as the ids
the rollout recorded, `[..., k]` per position, padded with −1 (`PADDING`): SkyRL's
`enable_sample_support_replay` (`skyrl/backends/skyrl_train/utils/sample_support_replay.py`,
`sample_support_scores`; its rows of top-k ids padded with `SAMPLE_SUPPORT_PADDING = -1`) and slime's top-p replay
(`slime/backends/megatron_utils/loss.py`, `_build_topp_keep_mask`: logits outside the recorded nucleus set to −inf
before the log-softmax) both record ids, not a threshold to recompute.

Following SkyRL's function: z_y is read at the target even when y is not in S_t (no mask on it); an id listed twice
counts twice; a position whose row holds no id (all −1) has log π = 0 and H = 0 and passes no gradient (SkyRL
refuses it where the loss mask is on; mask such positions). slime differs in three places: its rows without a
recorded nucleus keep the whole vocabulary, its entropy is that of the whole vocabulary (the plain
`log_prob_and_entropy` gives it), and its mask keeps the target's own logit (`slime/utils/ppo_utils.py`,
`_VocabParallelLogProbEntropy`: lse over S_t ∪ {y}; the same wherever y is in S_t, as in every rollout). SkyRL
clamps H_S at 0 from below; here H_S is a sum of non-negative terms.

`SupportLogProbEntropy` is a statistic of the one chunk loop (`chunks.ChunkLoop`), run by the torch backend only
(the Triton backends' tables do not hold it: the automatic choice takes torch, and `use("kernel")` /
`use("head-kernel")` refuse it by name). Per tile of vocabulary columns it gathers the k support columns that fall
in the tile (k gathers, one reduction) and keeps SkyRL's running state under an online max; backward writes the
tile's gradient with one scatter, so nothing beyond the plain call's buffers is held: one [chunk, tile] buffer of
logits and a few [chunk, k] temporaries.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.checks import check_values, is_integer
from .banned import floored_grad, log_prob_floor
from .statistic import Statistic

__all__ = ["SupportLogProbEntropy", "check_support", "PADDING"]

PADDING = -1
"""The id that pads a support row (SkyRL's `SAMPLE_SUPPORT_PADDING`)."""

_ABSENT = -(2.0**66)  # the running max of a row before any of its support columns: below every clamped logit


def check_support(support: Tensor, lead: torch.Size, vocab_size: int, valid: Tensor | None = None) -> Tensor:
    """The support ids `[*lead, k]` (an integer tensor, k >= 1) as int64, each in [0, vocab_size) or the padding
    −1 where `valid` (everywhere when None); −1 elsewhere. TypeError / ValueError naming `support` otherwise (the
    range check is a value check: `pgloss.checks.check_values`)."""
    if not isinstance(support, Tensor):
        raise TypeError(f"support must be a Tensor of token ids, got {type(support).__name__}")
    if not is_integer(support):
        raise TypeError(f"support must hold integer token ids, got dtype {support.dtype}")
    if support.dim() != len(lead) + 1 or support.shape[:-1] != lead or support.shape[-1] < 1:
        raise ValueError(
            f"support must have shape [{', '.join(str(n) for n in lead)}, k] with k >= 1 (the rollout's ids per "
            f"position, padded with {PADDING}), got {tuple(support.shape)}"
        )

    def outside() -> Tensor:
        bad = (support < PADDING) | (support >= vocab_size)
        return bad if valid is None else bad & valid.to(bad.device).unsqueeze(-1)

    check_values(
        support,
        outside,
        lambda at: (
            f"support must hold token ids in [0, {vocab_size}) or the padding {PADDING} at valid positions, "
            f"got {int(support[tuple(at)])} at {tuple(at.tolist())}"
        ),
    )
    ids = support.long()
    if valid is None:
        return ids
    return torch.where(valid.to(ids.device).unsqueeze(-1), ids, PADDING)


def _target(targets: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """The targets' column indices in the tile `cols` (clamped into it) and which rows' target is inside it (as
    `entropy.tile_target`, which imports this module)."""
    local = targets - cols.start
    width = cols.stop - cols.start
    return local.clamp(0, width - 1), (local >= 0) & (local < width)


def _members(support: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """The support's column indices in the tile `cols` (clamped into it) and which of them are ids inside it."""
    local = support - cols.start
    width = cols.stop - cols.start
    return local.clamp(0, width - 1), (support >= 0) & (local >= 0) & (local < width)


class SupportLogProbEntropy(Statistic):
    """Statistic of `chunks.ChunkLoop`: (log π_S(y), H_S) per token over its support row (module docstring), with
    `targets` [N] and `support` [N, k] int64 ids (−1: padding). Its values: log π_S(y), H_S, the shift m (the max
    over the support) and log s (s = Σ_{v ∈ S} e^{z_v − m}), so that log π_S,v = (z_v − m) − log s.

    Per tile, for each row: the support columns inside the tile are gathered, and the running (m, s, a, z_y)
    rescaled to the new max as in `entropy.LogProbEntropy` (a = Σ_{v ∈ S} e^{z_v − m} (z_v − m)). At the end
    log π_S(y) = (z_y − m) − log s (floored for a banned target, `banned.log_prob_floor`), H_S = log s − a / s;
    rows without an id: 0, 0. Gradient over the tile (τ applied by the caller's 1/τ):

        ∂L/∂z_v = g_lp (1[v = y] − π_S,v 1[v ∈ S]) − g_H π_S,v (log π_S,v + H_S) 1[v ∈ S]
    """

    def __init__(self, targets: Tensor, support: Tensor) -> None:
        self.targets, self.support = targets, support

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(4)]  # log π_S(y), H_S, shift m, log s

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        z = zs[0]
        index, inside = _members(self.support[rows], cols)
        zk = torch.where(inside, z.gather(-1, index), _ABSENT)
        local, hit = _target(self.targets[rows], cols)
        z_y = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        if state is None:
            m, s, a, y = (
                zk.new_full(zk.shape[:1], _ABSENT),
                zk.new_zeros(zk.shape[:1]),
                zk.new_zeros(zk.shape[:1]),
                None,
            )
        else:
            m, s, a, y = state
        new = torch.maximum(m, zk.amax(dim=-1))
        scale = torch.exp(m - new)
        d = zk - new.unsqueeze(-1)
        e = torch.where(inside, torch.exp(d), 0.0)
        a = scale * (a + (m - new) * s) + torch.where(inside, e * d, 0.0).sum(dim=-1)
        s = scale * s + e.sum(dim=-1)
        y = torch.where(hit, z_y, 0.0) if y is None else torch.where(hit, z_y, y)
        return new, s, a, y

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        log_prob, entropy, shift, log_s = values
        m, s, a, z_y = state
        some = s > 0  # a row with at least one support id (its max term is e⁰ = 1)
        safe = torch.where(some, s, 1.0)
        log_s[rows] = torch.log(safe)
        shift[rows] = torch.where(some, m, 0.0)
        log_prob[rows] = torch.where(some, log_prob_floor((z_y - shift[rows]) - log_s[rows], z_y), 0.0)
        entropy[rows] = torch.where(some, log_s[rows] - a / safe, 0.0)

    def outputs(self, values: list[Tensor]) -> tuple[Tensor, Tensor]:
        return values[0], values[1]

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        z = zs[0]
        log_prob, entropy, shift, log_s = (value[rows] for value in values)
        grad_log_prob, grad_entropy = grads
        support = self.support[rows]
        some = (support >= 0).any(dim=-1)
        index, inside = _members(support, cols)
        log_pi = z.gather(-1, index) - shift.unsqueeze(-1) - log_s.unsqueeze(-1)
        p = torch.where(inside, torch.exp(log_pi), 0.0)
        g = torch.zeros_like(p)
        g_lp = floored_grad(log_prob, None if grad_log_prob is None else grad_log_prob[rows])
        if g_lp is not None:
            g_lp = torch.where(some, g_lp, 0.0) / temperature
            g = g - p * g_lp.unsqueeze(-1)
        if grad_entropy is not None:
            g_h = torch.where(some, grad_entropy[rows], 0.0) / temperature
            g = g - torch.where(inside, p * (log_pi + entropy.unsqueeze(-1)), 0.0) * g_h.unsqueeze(-1)
        out = z.zero_()
        out.scatter_add_(-1, index, torch.where(inside, g, 0.0).to(out.dtype))
        if g_lp is not None:
            local, hit = _target(self.targets[rows], cols)
            out.scatter_add_(-1, local.unsqueeze(-1), torch.where(hit, g_lp, 0.0).unsqueeze(-1).to(out.dtype))
        return out
