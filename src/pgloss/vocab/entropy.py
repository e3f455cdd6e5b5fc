"""Log-probabilities and entropy from logits, tempered, chunked over tokens.

With tempered logits z = logits / τ over a vocabulary of size V, for each token:

    lse(z)  = log Σᵥ exp(zᵥ)
    log π(y) = z_y − lse(z)                       (log-probability of the target y)
    H(π)     = −Σᵥ πᵥ log πᵥ = lse(z) − Σᵥ πᵥ zᵥ      (entropy, π = softmax(z))

and the gradients with respect to z (the backward pass below uses them):

    ∂ log π(y) / ∂zᵥ = 1[v = y] − πᵥ
    ∂ H / ∂zᵥ        = −πᵥ (log πᵥ + H)

so ∂/∂logits = (1/τ) ∂/∂z. The math runs in float32 (float64 stays float64) one chunk of
tokens at a time: the forward pass keeps two floats per token (a shift c and log s, with
log π = (z − c) − log s: `LogProbEntropy`), and the backward pass recomputes the softmax of
each chunk from the saved logits, so no second [N, V] tensor (log-softmax, softmax or their
gradients) is ever held besides the logits gradient itself.
The per-chunk helpers are shared with the fused hidden-state path (`pgloss.vocab.fused`, `pgloss.from_hidden`).

Temperature-scaled sampling and its log-probabilities: Ackley, Hinton & Sejnowski (1985);
the entropy bonus in policy gradients: Williams & Peng (1991); Mnih et al., "Asynchronous
Methods for Deep Reinforcement Learning" (2016), https://arxiv.org/abs/1602.01783.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.batch import check_tensor
from ..core.checks import check_number, check_values, is_integer
from . import head_tile, kernels
from .backends import TRITON_HEAD, TRITON_TILES, TileOps
from .banned import BANNED_LOGIT, floored_grad, log_prob_floor
from .chunks import ChunkLoop
from .plan import plan
from .statistic import Statistic
from .support import SupportLogProbEntropy, check_support

__all__ = ["log_prob_and_entropy", "default_chunk_size"]

# Default chunk: about 2²⁷ logits (512 MiB in float32) per chunk buffer.
_CHUNK_ELEMENTS = 1 << 27


def default_chunk_size(vocab_size: int) -> int:
    """Tokens per chunk so that one float32 chunk of logits holds about 2²⁷ values."""
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def check_temperature(temperature: float) -> float:
    """τ as a float; TypeError for a non-number, ValueError unless 0 < τ < ∞."""
    value = check_number("temperature", temperature)
    if value is None or value <= 0:  # None only where check_number is told `optional`
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")
    return value


def check_chunk_size(chunk_size: int | None, vocab_size: int) -> int:
    """Tokens per chunk: the default for `vocab_size` when None, else an int >= 1."""
    if chunk_size is None:
        return default_chunk_size(vocab_size)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int):
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


def check_targets(targets: Tensor, shape: torch.Size, vocab_size: int, valid: Tensor | None = None) -> None:
    """An integer tensor of token ids with the given shape, each in [0, vocab_size) where `valid`
    (everywhere when None). The range check is a value check (`pgloss.checks.check_values`)."""
    if not isinstance(targets, Tensor):
        raise TypeError(f"targets must be a Tensor, got {type(targets).__name__}")
    if not is_integer(targets):
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    if targets.shape != shape:
        raise ValueError(f"targets must have shape {tuple(shape)}, got {tuple(targets.shape)}")

    def outside() -> Tensor:
        bad = (targets < 0) | (targets >= vocab_size)
        return bad if valid is None else bad & valid.to(bad.device)

    check_values(
        targets,
        outside,
        lambda at: (
            f"targets must be token ids in [0, {vocab_size}) at valid positions, "
            f"got {int(targets[tuple(at)])} at {tuple(at.tolist())}"
        ),
    )


# ---------------------------------------------------------------------------------------
# Per-chunk math, shared with pgloss.vocab.fused and pgloss.from_hidden. `z` is an [n, V] buffer holding the tempered
# logits in the compute dtype (finite: callers clamp −inf). The math walks `z` in blocks of a
# few rows so that its temporaries stay in cache: one pass over `z` in memory rather than one
# per elementwise operation, and O(block · V) extra memory.
# ---------------------------------------------------------------------------------------

_BLOCK_ELEMENTS = 1 << 22


def _blocks(z: Tensor, temporaries: int = 1):
    """Row slices of `z` of about 2²² elements, and scratch buffers of that size."""
    rows = max(1, _BLOCK_ELEMENTS // max(1, z.shape[-1]))
    work = [z.new_empty(min(rows, z.shape[0]), z.shape[-1]) for _ in range(temporaries)]
    for start in range(0, z.shape[0], rows):
        block = slice(start, start + rows)
        yield block, [w[: min(rows, z.shape[0] - start)] for w in work]


def chunk_log_prob_entropy(z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(log π(y), H, lse) per row of the tempered logits `z` [n, V]; `z` is left unchanged.

    log π = log_softmax(z) (max-shifted), lse = z_v − log π_v read at the target v = y, or at the largest logit
    where the target is banned (its log π is −2⁶⁴ − lse: no lse survives the subtraction), log π(y) floored
    (`banned.log_prob_floor`), and H = −Σᵥ πᵥ log πᵥ, a sum of non-negative terms (no cancellation between lse
    and Σ π z). Reading lse at the target keeps every unbanned row's value, and so the lab's runs, to the bit.
    """
    n = z.shape[0]
    log_prob, entropy, lse = z.new_empty(n), z.new_empty(n), z.new_empty(n)
    for rows, (log_pi, p) in _blocks(z, 2):
        zb, index = z[rows], targets[rows].unsqueeze(-1)
        torch.log_softmax(zb, dim=-1, out=log_pi)
        z_y = zb.gather(-1, index)
        at = torch.where(z_y > BANNED_LOGIT, index, zb.argmax(dim=-1, keepdim=True))
        lse[rows] = (zb.gather(-1, at) - log_pi.gather(-1, at)).squeeze(-1)
        log_prob[rows] = log_prob_floor(log_pi.gather(-1, index).squeeze(-1), z_y.squeeze(-1))
        entropy[rows] = torch.exp(log_pi, out=p).mul_(log_pi).sum(dim=-1).neg_()
    return log_prob, entropy, lse


def chunk_grad_logits(
    z: Tensor,
    targets: Tensor,
    shift: Tensor,
    log_s: Tensor,
    entropy: Tensor,
    grad_log_prob: Tensor | None,
    grad_entropy: Tensor | None,
    temperature: float,
    hit: Tensor | None = None,
) -> Tensor:
    """∂L/∂logits [n, V] for one chunk, from ∂L/∂log π(y) and ∂L/∂H (either may be None).

        ∂L/∂logitsᵥ = (1/τ) [ g_logp (1[v = y] − πᵥ) − g_H πᵥ (log πᵥ + H) ]

    with log πᵥ = (zᵥ − shift) − log_s (`LogProbEntropy`'s saved pair: the two are never added, so log π
    keeps float32's precision at any magnitude of z). The result is written into `z` (the recomputed tempered
    logits) and returned. On a tile of the vocabulary `targets` are the tile's column indices and `hit` says
    which rows' target is in it.
    """
    if grad_log_prob is None and grad_entropy is None:
        raise ValueError("chunk_grad_logits needs grad_log_prob or grad_entropy, got None for both")
    neg_g_lp = g_hit = None  # −g_logp / τ, and g_logp / τ where the target is in the tile
    if grad_log_prob is not None:
        g_lp = (grad_log_prob / temperature).unsqueeze(-1)
        neg_g_lp = -g_lp
        g_hit = g_lp if hit is None else torch.where(hit.unsqueeze(-1), g_lp, 0.0)
    g_h = None if grad_entropy is None else (grad_entropy / -temperature).unsqueeze(-1)
    for rows, (p,) in _blocks(z):
        log_pi = z[rows].sub_(shift[rows].unsqueeze(-1)).sub_(log_s[rows].unsqueeze(-1))
        torch.exp(log_pi, out=p)
        if g_h is not None:
            grad = log_pi.add_(entropy[rows].unsqueeze(-1)).mul_(p).mul_(g_h[rows])  # −g_H π (log π + H)
            if neg_g_lp is not None:
                grad.addcmul_(p, neg_g_lp[rows])
        elif neg_g_lp is not None:
            grad = torch.mul(p, neg_g_lp[rows], out=log_pi)
        if g_hit is not None:
            grad.scatter_add_(-1, targets[rows].unsqueeze(-1), g_hit[rows])
    return z


def tile_target(targets: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """The targets' column indices in the vocabulary tile `cols` (clamped into it), and which rows'
    target falls inside the tile."""
    local = targets - cols.start
    width = cols.stop - cols.start
    return local.clamp(0, width - 1), (local >= 0) & (local < width)


def online_max(state_max: Tensor, z: Tensor) -> tuple[Tensor, Tensor]:
    """The running max after the tile `z` and exp(old max − new max), the factor rescaling sums."""
    new = torch.maximum(state_max, z.amax(dim=-1))
    return new, torch.exp(state_max - new)


def tile_exp_sums(z: Tensor, shift: Tensor, *others: Tensor) -> list[Tensor]:
    """Per row of the tile `z`: Σᵥ e^{zᵥ−m} and Σᵥ e^{zᵥ−m} (zᵥ − m), and for each tile in `others`
    (z'ᵥ, shifted by the caller) Σᵥ e^{zᵥ−m} z'ᵥ, walking cache-sized row blocks."""
    n = z.shape[0]
    sums = [z.new_empty(n) for _ in range(2 + len(others))]
    for rows, (d, e) in _blocks(z, 2):
        torch.sub(z[rows], shift[rows].unsqueeze(-1), out=d)
        torch.exp(d, out=e)
        sums[0][rows] = e.sum(dim=-1)
        sums[1][rows] = (e * d).sum(dim=-1) if others else d.mul_(e).sum(dim=-1)
        for k, other in enumerate(others):
            sums[2 + k][rows] = d.copy_(other[rows]).mul_(e).sum(dim=-1)
    return sums


class LogProbEntropy(Statistic):
    """Statistic of `chunks.ChunkLoop`: (log π(y), H) per token of one source, saving for backward a pair
    (shift c, log s) per token such that log πᵥ = (zᵥ − c) − log s.

    Per tile of the vocabulary (online max m, as in Milakov & Gimelshein 2018,
    https://arxiv.org/abs/1805.02867), each row keeps s = Σᵥ e^{zᵥ−m}, a = Σᵥ e^{zᵥ−m}(zᵥ − m) and
    z_y; a new max m' rescales them: s ← e^{m−m'} s, a ← e^{m−m'} (a + (m − m') s). At the end

        log π(y) = (z_y − m) − log s,   H = log s − a / s,   saved: c = m and log s

    (−a/s and log s are both ≥ 0: no cancellation, as in −Σ π log π). m and log s are kept apart, never summed
    into lse = m + log s: at |z| = 10⁴ lse rounded to float32 is off by up to 4.9e-4 (half its ulp), an error
    every log π and π = e^{log π} formed from it would carry, where z_y − m is exact for logits within a factor
    of two of the max (Sterbenz) and log s ∈ [0, log V] is exact to float32's relative precision.

    The whole-vocabulary torch route (`forward`, `chunk_log_prob_entropy`) saves c = lse read at the target and
    log s = 0 instead: π = e^{z − lse} there is the formula the lab's runs, and so the README's tables, were
    measured with (its float32 gradient at |z| = 10⁴ is off by up to 4.9e-4 relative; the log-probability is not,
    `torch.log_softmax` keeps m and log s apart). A target on a banned token (a −inf logit) gets log π(y) =
    `banned.LOG_PROB_FLOOR` and no gradient through it (`banned.py`)."""

    def __init__(self, targets: Tensor) -> None:
        self.targets = targets

    def allocate(self, n: int, dtype: torch.dtype, device: torch.device) -> list[Tensor]:
        return [torch.empty(n, dtype=dtype, device=device) for _ in range(4)]  # log π(y), H, shift c, log s

    def forward(self, zs: list[Tensor], rows: slice, values: list[Tensor]) -> None:
        log_prob, entropy, shift, log_s = values
        log_prob[rows], entropy[rows], shift[rows] = chunk_log_prob_entropy(zs[0], self.targets[rows])
        log_s[rows].zero_()

    def tile_forward(self, zs: list[Tensor], rows: slice, cols: slice, state):
        z = zs[0]
        local, hit = tile_target(self.targets[rows], cols)
        z_y = z.gather(-1, local.unsqueeze(-1)).squeeze(-1)
        if state is None:
            m = z.amax(dim=-1)
            s, a = tile_exp_sums(z, m)
            return m, s, a, torch.where(hit, z_y, 0.0)
        m, s, a, y = state
        new, scale = online_max(m, z)
        s_tile, a_tile = tile_exp_sums(z, new)
        a = scale * (a + (m - new) * s) + a_tile
        s = scale * s + s_tile
        return new, s, a, torch.where(hit, z_y, y)

    def tile_finish(self, state, rows: slice, values: list[Tensor]) -> None:
        log_prob, entropy, shift, log_s = values
        m, s, a, z_y = state
        log_s[rows] = torch.log(s)
        shift[rows] = m
        log_prob[rows] = log_prob_floor((z_y - m) - log_s[rows], z_y)
        entropy[rows] = log_s[rows] - a / s

    def outputs(self, values: list[Tensor]) -> tuple[Tensor, Tensor]:
        return values[0], values[1]

    @staticmethod
    def upstream(
        rows: slice, values: list[Tensor], grads
    ) -> tuple[Tensor, Tensor, Tensor, Tensor | None, Tensor | None]:
        """The shift c, log s, H, ∂L/∂log π(y) (0 where log π(y) was floored: `banned.floored_grad`) and ∂L/∂H of
        `rows`."""
        log_prob, entropy, shift, log_s = values
        grad_log_prob, grad_entropy = grads
        return (
            shift[rows],
            log_s[rows],
            entropy[rows],
            floored_grad(log_prob[rows], None if grad_log_prob is None else grad_log_prob[rows]),
            None if grad_entropy is None else grad_entropy[rows],
        )

    def grad(self, zs: list[Tensor], rows: slice, values: list[Tensor], grads, temperature: float) -> Tensor:
        return chunk_grad_logits(zs[0], self.targets[rows], *self.upstream(rows, values, grads), temperature)

    def tile_grad(
        self, zs: list[Tensor], rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
    ) -> Tensor:
        local, hit = tile_target(self.targets[rows], cols)
        return chunk_grad_logits(zs[0], local, *self.upstream(rows, values, grads), temperature, hit)


# Its Triton kernels (`backends.TRITON_TILES`): the same running state (m, s, a, z_y) and values, each tile of raw
# head outputs (`kernels.RawTile`) one launch forward and one backward.


def _kernel_tile_forward(statistic: LogProbEntropy, zs: list, rows: slice, cols: slice, state):
    state = kernels.start_state(zs[0], maxima=1, sums=3) if state is None else state
    kernels.log_prob_entropy_forward(zs[0], statistic.targets[rows], cols.start, state)
    return state


def _kernel_tile_grad(
    statistic: LogProbEntropy, zs: list, rows: slice, cols: slice, values: list[Tensor], grads, temperature: float
) -> Tensor:
    upstream = statistic.upstream(rows, values, grads)
    return kernels.log_prob_entropy_backward(zs[0], statistic.targets[rows], cols.start, *upstream)


TRITON_TILES.add(LogProbEntropy, TileOps(_kernel_tile_forward, _kernel_tile_grad))
# The head kernels (`backends.TRITON_HEAD`, `head_tile.py`): (log π(y), H) [N] of hidden states [N, H] and an LM
# head, the logits formed inside the kernels, the same state and values.
TRITON_HEAD.add(LogProbEntropy, head_tile.HeadTileLoop.apply)


def log_prob_and_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    vocab_block: int | None = None,
    memory_budget: int | None = None,
    support: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Target log-probabilities and entropies of tempered logits, chunked over tokens.

    With z = logits / τ and π = softmax(z):

        log π(y) = z_y − lse(z),        H(π) = lse(z) − Σᵥ πᵥ zᵥ

    Both outputs carry gradients to `logits`. Only the logits and a few floats per token are
    saved for backward; the softmax is recomputed per chunk, so memory beyond the logits and
    their gradient is O(chunk_size · V).

    Args:
        logits: [..., V] floating logits (any float dtype; the math runs in float32, or
            float64 for float64 input).
        targets: [...] integer token ids in [0, V), the same leading shape as `logits`.
            An id outside [0, V) is a ValueError (replace padding ids before calling).
        temperature: τ > 0, the sampling temperature the logits are divided by.
        chunk_size: tokens per chunk; None picks about 2²⁷ / V.
        vocab_block: vocabulary columns per tile (None: the whole vocabulary); below V, lse,
            log π(y) and H accumulate over tiles with an online max.
        memory_budget: bytes for the loop's buffers, exclusive with chunk_size and vocab_block.
        support: [..., k] integer token ids, the support the rollout sampled each position from (its top-k ids or
            top-p nucleus, padded with -1), or None (the whole vocabulary). Given, log π(y) and H are those of
            softmax(z) restricted to the support (`pgloss.vocab.support`: SkyRL's sample-support replay); a
            position with no id gives 0 and no gradient. Torch route only.

    Returns:
        (log_prob, entropy), each [...] in float32 (float64 for float64 logits).
    """
    if not isinstance(logits, Tensor):
        raise TypeError(f"logits must be a Tensor, got {type(logits).__name__}")
    if not logits.dtype.is_floating_point:
        raise TypeError(f"logits must be a floating tensor, got dtype {logits.dtype}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if isinstance(targets, Tensor) and targets.device != logits.device:
        raise ValueError(f"targets must be on {logits.device}, got {targets.device}")
    check_targets(targets, logits.shape[:-1], logits.shape[-1])
    temperature = check_temperature(temperature)
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    flat = logits.reshape(-1, vocab)
    statistic: Statistic
    if support is None:
        statistic = LogProbEntropy(targets.reshape(-1).long())
    else:
        if isinstance(support, Tensor) and support.device != logits.device:
            raise ValueError(f"support must be on {logits.device}, got {support.device}")
        ids = check_support(support, lead, vocab)
        statistic = SupportLogProbEntropy(targets.reshape(-1).long(), ids.reshape(flat.shape[0], ids.shape[-1]))
    sizes = dict(chunk_size=chunk_size, vocab_block=vocab_block, memory_budget=memory_budget)
    tiles = plan(statistic, ("logits",), flat, flat.shape[0], **sizes)
    log_prob, entropy = ChunkLoop.apply(statistic, ("logits",), temperature, tiles, None, flat)
    return log_prob.view(lead), entropy.view(lead)


def sum_pi_squared(logits: Tensor, *, temperature: float = 1.0, chunk_size: int | None = 1024) -> Tensor:
    """Σ_v π_v² per position of `[..., V]` logits at temperature τ, exactly:
    exp(lse(2z) - 2·lse(z)) with z = logits/τ, by chunks of positions; detached, float32 (float64
    stays float64), shape `logits.shape[:-1]`. `chunk_size` >= 1 positions (None: about 2²⁷ / V)."""
    logits = check_tensor("logits", logits, ndim=tuple(range(1, 8)))
    temperature = check_temperature(temperature)
    chunk_size = check_chunk_size(chunk_size, logits.shape[-1])
    flat = logits.detach().reshape(-1, logits.shape[-1])
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    out = torch.empty(flat.shape[0], dtype=dtype, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        z = flat[start : start + chunk_size].to(dtype) / temperature
        out[start : start + chunk_size] = torch.exp(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
    return out.reshape(logits.shape[:-1])
