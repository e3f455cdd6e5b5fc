"""MaxRL, maximum-likelihood RL: the group-centred reward divided by the group's mean, `[B]`, with
the trainers' conventions (pgloss, prime-rl, SkyRL)."""

from __future__ import annotations

import torch
from torch import Tensor

from ..core.checks import check_number
from .group import _group_center, _scores, group_index, rows_of

MAXRL_CONVENTIONS = {"pgloss": (0.0, "zero", False), "prime-rl": (0.0, "zero", False), "skyrl": (1e-6, "raw", True)}
"""convention: (ε, a group of one, whether a row without a valid token counts in its group given a mask)."""


def maxrl_advantages(
    scores: Tensor,
    group_ids: Tensor,
    *,
    convention: str = "pgloss",
    eps: float | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    """MaxRL, maximum-likelihood RL (Tajwar, Zeng et al. 2026, arXiv 2602.02710), `[B]`:

        Â_i = (s_i - μ_g) / μ_g        (0 when μ_g ≤ 0: a group without a success carries no signal)

    For binary rewards, Σ_i Â_i ∇log π(y_i) / n = (1/K) Σ_{i: s_i=1} ∇log π(y_i) - the mean score
    function: an unbiased gradient of the order-n truncation of log p (n the group size, K the
    successes), where GRPO's σ-scaling estimates the gradient of p. Low pass rates get ~1/p weight.

    `convention`:
        pgloss, prime-rl   the paper's division, ε = 0; μ_g ≤ 0 gives 0; a group of one gives 0
                           (prime-rl `orchestrator/algo/max_rl.py`)
        skyrl              Â_i = (s_i - μ_g)/(μ_g + ε), ε = 1e-6, whatever the sign of μ_g; a group
                           of one keeps Â = s (μ = 0) (SkyRL `ppo_utils.py compute_maxrl_advantage`)
    `eps` overrides the convention's ε. The rewards are meant to be non-negative (canonically 0/1);
    that is not checked (a check would read the host).

    `mask` (`[B, T]`, or `[B]` row flags): a row without a valid token gets Â = 0 and, under pgloss's and
    prime-rl's conventions, leaves its group's μ_g and size (prime-rl scores only the traces with
    sampled tokens); SkyRL counts its reward. One group, rewards [1, 0, 0], the third row empty:
    pgloss, prime-rl [1, -1, 0]; skyrl [2, -1, 0] (within ε); without a mask [2, -1, -1]."""
    if convention not in MAXRL_CONVENTIONS:
        raise ValueError(f"convention must be one of {tuple(MAXRL_CONVENTIONS)}, got {convention!r}")
    default_eps, singleton, counts_empty_rows = MAXRL_CONVENTIONS[convention]
    eps = default_eps if eps is None else check_number("eps", eps)
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    scores = _scores(scores)
    work = scores.to(torch.float64)
    index, n_groups = group_index(group_ids, work.shape[0], work.device)
    rows = rows_of(mask, work.shape[0], work.device)
    centered, size = _group_center(work, index, n_groups, None if counts_empty_rows else rows)
    mean = work - centered
    if convention == "skyrl":
        out = centered / (mean + eps)
    else:
        out = torch.where(mean > 0, centered / torch.where(mean > 0, mean + eps, 1.0), 0.0)
    out = torch.where(size > 1, out, work if singleton == "raw" else 0.0)
    return (out if rows is None else torch.where(rows, out, 0.0)).to(scores.dtype)
