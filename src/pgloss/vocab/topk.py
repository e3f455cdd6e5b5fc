"""Log-probabilities at given token ids, normalised over the whole vocabulary, and the top-k ids of a model: the
two vocabulary statistics of top-k distillation (`topk_divergence.py`), on the one chunk loop (`chunks.ChunkLoop`).

With z the tempered logits of one position (z = logits / τ; from hidden states, the head's logits / τ) and ids
i₁ … i_k (−1: padding, `support.PADDING`):

    log p_{i_j} = z_{i_j} − lse_v(z_v)            (j = 1 … k; 0 at a padding slot)
    S = Σ_v p_v log p_v                            (the negative entropy; only when asked for)

Per tile of vocabulary columns, `SupportLogProbs` gathers the k columns that fall inside the tile and carries the
running (max m, s = Σ e^{z − m}, a = Σ e^{z − m}(z − m)) under an online max, as `support.SupportLogProbEntropy`
does over its support; here the sums run over every column, so lse = m + log s and S = a / s − log s. Its
gradient over a tile, from g_j = ∂L/∂log p_{i_j} and g_S = ∂L/∂S:

    ∂L/∂z_v = Σ_j g_j 1[v = i_j] − p_v Σ_j g_j + g_S p_v (log p_v − S)

written with one scatter of the k columns, so memory beyond the plain call's is a few [chunk, k] temporaries: no
N x V buffer. From hidden states these are the k columns of the head (x W_{i_j}ᵀ) and one log-sum-exp over the
vocabulary, so the student's log-probs at a teacher's top-k cost one pass of the plain log π(y) call.

`TopIds` keeps each row's k largest logits and their ids, tile by tile (no gradient: the ids are discrete);
TRL's self-distillation support is the student's own top-k (`torch.topk(student_logits, k)`).

Both are run by the torch backend only: the Triton backends' tables do not hold them, so the automatic choice
takes torch and `use("kernel")` / `use("head-kernel")` refuse them by name.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.checks import check_values, is_integer
from .entropy import online_max, tile_exp_sums
from .statistic import Statistic
from .support import PADDING, _members

__all__ = ["SupportLogProbs", "TopIds", "check_topk_ids", "check_topk_log_probs", "PADDING"]

_ABSENT = -(2.0**66)  # a running max before any column: below every clamped logit


def check_topk_ids(
    name: str, ids: object, lead: torch.Size, vocab_size: int, valid: Tensor | None, device: torch.device
) -> Tensor:
    """Token ids `[*lead, k]` (an integer tensor on `device`, k >= 1) as int64: each in [0, vocab_size) or the
    padding −1 at `valid` positions (everywhere when None), −1 returned elsewhere. TypeError / ValueError naming
    `name` otherwise (the range check is a value check: `pgloss.checks.check_values`)."""
    if not isinstance(ids, Tensor):
        raise TypeError(f"{name} must be a Tensor of token ids, got {type(ids).__name__}")
    if not is_integer(ids):
        raise TypeError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() != len(lead) + 1 or ids.shape[:-1] != lead or ids.shape[-1] < 1:
        raise ValueError(
            f"{name} must have shape [{', '.join(str(n) for n in lead)}, k] with k >= 1 (k token ids per position, "
            f"padded with {PADDING}), got {tuple(ids.shape)}"
        )
    if ids.device != device:
        raise ValueError(f"{name} is on {ids.device}, not on {device} with the model's inputs")
    given: Tensor = ids

    def outside() -> Tensor:
        bad = (given < PADDING) | (given >= vocab_size)
        return bad if valid is None else bad & valid.unsqueeze(-1)

    check_values(
        given,
        outside,
        lambda at: (
            f"{name} must hold token ids in [0, {vocab_size}) or the padding {PADDING} at valid positions, "
            f"got {int(given[tuple(at)])} at {tuple(at.tolist())}"
        ),
    )
    long = given.long()
    return long if valid is None else torch.where(valid.unsqueeze(-1), long, PADDING)


def check_topk_log_probs(name: str, log_probs: object, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """The teacher's log-probs (or logits) at `ids` (`check_topk_ids`'s output): a floating tensor of the same
    shape and device, finite at every id that is not padding (a padding slot may hold anything, −inf included);
    returned in `dtype`, 0 at padding. TypeError / ValueError naming `name` otherwise."""
    if not isinstance(log_probs, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(log_probs).__name__}")
    if not log_probs.is_floating_point():
        raise TypeError(f"{name} must be a floating tensor, got dtype {log_probs.dtype}")
    if log_probs.shape != ids.shape:
        raise ValueError(f"{name} must have the shape of the ids, {tuple(ids.shape)}, got {tuple(log_probs.shape)}")
    if log_probs.device != ids.device:
        raise ValueError(f"{name} is on {log_probs.device}, not on {ids.device} with its ids")
    check_values(
        log_probs,
        lambda: ~torch.isfinite(log_probs) & (ids >= 0),
        lambda at: (
            f"{name} must be finite at every id that is not padding (mark a missing slot with id {PADDING}), got "
            f"{float(log_probs[tuple(at)])} at {tuple(at.tolist())}"
        ),
    )
    return torch.where(ids >= 0, log_probs.detach().to(dtype), 0.0)


class SupportLogProbs(Statistic):
    """Statistic of `chunks.ChunkLoop`: the log-probs at `ids` [N, k] (int64, −1 padding) normalised over the whole
    vocabulary, and, with `entropy`, S = Σ_v p_v log p_v (module docstring). Its values: log p [N, k], lse [N],
    S [N] (0 without `entropy`); its outputs: log p, or (log p, S)."""

    def __init__(self, ids: Tensor, entropy: bool = False) -> None:
        self.ids, self.entropy = ids, entropy

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        k = self.ids.shape[-1]
        return [torch.empty(n, k, dtype=dtype, device=device), torch.empty(n, dtype=dtype, device=device)] + [
            torch.zeros(n, dtype=dtype, device=device)
        ]

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        z = zs[0]
        index, inside = _members(self.ids[rows], cols)
        picked = z.gather(-1, index)
        if state is None:
            m = z.amax(dim=-1)
            s, a = tile_exp_sums(z, m)  # cache-sized blocks: no [chunk, V] temporary
            return m, s, a, torch.where(inside, picked, 0.0)
        m, s, a, gathered = state
        new, scale = online_max(m, z)
        s_tile, a_tile = tile_exp_sums(z, new)
        a = scale * (a + (m - new) * s) + a_tile
        s = scale * s + s_tile
        return new, s, a, torch.where(inside, picked, gathered)

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        log_p, lse, negentropy = values
        m, s, a, gathered = state
        log_s = torch.log(s)
        lse[rows] = m + log_s
        log_p[rows] = torch.where(self.ids[rows] >= 0, gathered - lse[rows].unsqueeze(-1), 0.0)
        if self.entropy:
            negentropy[rows] = a / s - log_s

    def outputs(self, values: list[Tensor]) -> Tensor | tuple[Tensor, Tensor]:
        return (values[0], values[2]) if self.entropy else values[0]

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        z = zs[0]
        _, lse, negentropy = (value[rows] for value in values)
        grad_log_p = grads[0]
        grad_s = grads[1] if self.entropy and len(grads) > 1 else None
        ids = self.ids[rows]
        index, inside = _members(ids, cols)
        p = z.sub_(lse.unsqueeze(-1))  # log p over the tile, in place of the tile's logits
        g = None if grad_log_p is None else torch.where(ids >= 0, grad_log_p[rows], 0.0) / temperature
        if grad_s is not None:
            g_s = (grad_s[rows] / temperature).unsqueeze(-1)
            weight = (p - negentropy.unsqueeze(-1)).mul_(g_s)  # g_S (log p − S)
            if g is not None:
                weight.sub_(g.sum(dim=-1, keepdim=True))
            out = p.exp_().mul_(weight)
        elif g is not None:
            out = p.exp_().mul_(-g.sum(dim=-1, keepdim=True))
        else:
            out = p.zero_()
        if g is not None:
            out.scatter_add_(-1, index, torch.where(inside, g, 0.0).to(out.dtype))
        return out


class TopIds(Statistic):
    """Statistic of `chunks.ChunkLoop` run without gradient: each row's `k` largest logits' ids [N, k] (int64), in
    descending order of the logit, as `torch.topk(z, k)`; ties between tiles keep the earlier column."""

    def __init__(self, k: int) -> None:
        self.k = k

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, self.k, dtype=torch.long, device=device)]

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        z = zs[0]
        top, at = z.topk(min(self.k, z.shape[-1]), dim=-1)
        at = at + cols.start
        if state is not None:
            top, at = torch.cat([state[0], top], dim=-1), torch.cat([state[1], at], dim=-1)
            top, order = top.topk(min(self.k, top.shape[-1]), dim=-1)
            at = at.gather(-1, order)
        return top.clone(), at

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        values[0][rows] = state[1]

    def outputs(self, values: list[Tensor]) -> Tensor:
        return values[0]

    def tile_grad(self, zs, rows, cols, values, grads, temperature):  # pragma: no cover - ids carry no gradient
        raise RuntimeError("TopIds runs without gradient")
