"""RAE, role-conditioned advantage estimation: a reward minus a running (EMA) baseline kept per
(environment, role). Stateful across steps, unlike every other estimator here.

SPIRAL (Liu et al. 2025, arXiv 2506.24119) trains one policy by self-play on zero-sum games: the
group mean is ~0 whatever the policy does, and a structural edge of one role (the first mover) would
read as permanent credit. Each (game G, role p) keeps its own baseline instead,

    Â = R_p(τ) - b_{G,p},        b_{G,p} ← α b_{G,p} + (1 - α) R_p(τ)     (α = 0.95, b starts at 0)

each trajectory scored against the baseline before its own reward moves it (SPIRAL's
`train_spiral.py`, `role_baseline_ema_gamma`; prime-rl `orchestrator/algo/rae.py`, `decay`). There the
update runs trajectory by trajectory, in the order the rollouts arrive: the result depends on that
order and, over data-parallel ranks, on which rank holds which row.

`RoleBaseline` updates once per step from the step's global statistics, so that every rank holds the
same baseline and the advantages do not depend on the order or the split of the rows:

    trace       b_k ← α^{n_k} b_k + (1 - α^{n_k}) · mean_k(R)      (default)
    step        b_k ← α b_k + (1 - α) · mean_k(R)
    sequential  the trainers' per-trajectory recursion in row order (rank 0's rows first)

with n_k the step's number of rows of key k over all ranks and mean_k their mean reward; a key absent
from the step keeps its baseline. `trace` forgets at the trainers' rate per trajectory (the old
baseline keeps the weight α^{n_k}, as after n_k sequential updates) and weighs the step's rewards
equally where the recursion weighs the later ones more: the two agree exactly when a key has one row
per step or equal rewards within the step. `sequential` reproduces prime-rl and SPIRAL row for row.

Given the step's `mask` (`[B, T]`, or `[B]` row flags), a row without a valid token gets Â = 0 and
neither moves the baseline nor counts in n_k, under every update rule: prime-rl scores only the
traces that hold sampled tokens. Decay 0.9, one key, rewards [1, 2], the first trace empty: Â = [0, 2]
and b = 0.2 (without the mask, sequential: [1, 1.9] and b = 0.29).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ..core.batch import check_device, check_tensor
from ..core.checks import check_number, check_values, is_integer
from ..core.distributed import all_reduce, rank, world_size
from .group import rows_of

UPDATES = ("trace", "step", "sequential")


class RoleBaseline:
    """The per-key EMA baseline of RAE (SPIRAL, arXiv 2506.24119; prime-rl `algo/rae.py`).

        rae = RoleBaseline(num_keys=2, decay=0.95)       # key = env index * num_roles + role
        advantages = rae(rewards, keys)                  # [B] rewards, [B] integer keys in [0, num_keys)

    `rae(rewards, keys)` returns Â_i = R_i - b_{key_i} with the baseline before this step (for
    `update="sequential"`, before row i) and then folds the step into the baseline (module docstring).
    `rae(rewards, keys, mask=mask)` leaves the rows without a valid token out (Â = 0, no update).
    Call it once per step with the whole step's rows on each rank: the update all-reduces per-key
    counts and sums over `process_group` (when torch.distributed is initialised and `reduce=True`), so
    every rank keeps the same state. `advantages` and `update` are the two halves, for rows computed
    in several pieces. `state_dict` / `load_state_dict` carry the baseline through a checkpoint
    (prime-rl keeps it in memory only and re-warms it after a restart).
    """

    def __init__(self, num_keys: int, *, decay: float = 0.95, update: str = "trace"):
        if isinstance(num_keys, bool) or not isinstance(num_keys, int) or num_keys < 1:
            raise ValueError(f"num_keys must be an int >= 1, got {num_keys!r}")
        decay = check_number("decay", decay)
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must lie in [0, 1), got {decay}")
        if update not in UPDATES:
            raise ValueError(f"update must be one of {UPDATES}, got {update!r}")
        self.num_keys, self.decay, self.update_rule = num_keys, decay, update
        self.baseline = torch.zeros(num_keys, dtype=torch.float64)

    # -- checkpoint ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"baseline": self.baseline.detach().cpu().clone(), "decay": self.decay, "update": self.update_rule}

    def load_state_dict(self, state: dict) -> None:
        baseline = check_tensor("state['baseline']", state.get("baseline"), ndim=(1,))
        if baseline.shape[0] != self.num_keys:
            raise ValueError(f"state['baseline'] must have shape [{self.num_keys}], got {tuple(baseline.shape)}")
        for name, mine in (("decay", self.decay), ("update", self.update_rule)):
            if name in state and state[name] != mine:
                raise ValueError(f"state[{name!r}] is {state[name]!r}, this RoleBaseline has {mine!r}")
        self.baseline = baseline.detach().to(torch.float64).clone()

    # -- the step ------------------------------------------------------------------------------------

    def _inputs(self, rewards, keys, mask=None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        rewards = check_tensor("rewards", rewards, ndim=(1,))
        keys = check_tensor("keys", keys, ndim=(1,), floating=False)
        if keys.shape != rewards.shape or not is_integer(keys):
            raise ValueError(
                f"keys must be integers of shape {tuple(rewards.shape)}, got {keys.dtype} {tuple(keys.shape)}"
            )
        check_device("keys", keys, rewards.device, "rewards")
        check_values(
            keys,
            lambda: (keys < 0) | (keys >= self.num_keys),
            lambda at: f"keys must lie in [0, {self.num_keys}), got {int(keys[at[0]])} at row {int(at[0])}",
        )
        self.baseline = self.baseline.to(rewards.device)
        rows = rows_of(mask, rewards.shape[0], rewards.device, "rewards")
        rows = torch.ones_like(keys, dtype=torch.bool) if rows is None else rows
        return rewards.detach().to(torch.float64), keys.long(), rewards, rows

    def advantages(self, rewards: Tensor, keys: Tensor, *, mask: Tensor | None = None) -> Tensor:
        """Â_i = R_i - b_{key_i} against the current baseline, `[B]` (0 on the rows without a valid
        token of `mask`); the state is not changed."""
        work, keys, rewards, rows = self._inputs(rewards, keys, mask)
        return torch.where(rows, work - self.baseline[keys], 0.0).to(rewards.dtype)

    def update(
        self,
        rewards: Tensor,
        keys: Tensor,
        *,
        mask: Tensor | None = None,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
    ) -> None:
        """Fold the step's rows (those with a valid token of `mask`) into the baseline (`trace` or
        `step`; `sequential` updates in `__call__`)."""
        if self.update_rule == "sequential":
            raise ValueError("update='sequential' folds the rows in order inside the call: use rae(rewards, keys)")
        work, keys, _, rows = self._inputs(rewards, keys, mask)
        stats = torch.zeros(2, self.num_keys, dtype=torch.float64, device=work.device)
        stats[0].index_add_(0, keys, rows.to(torch.float64))
        stats[1].index_add_(0, keys, torch.where(rows, work, 0.0))
        count, total = all_reduce(stats, process_group, reduce)
        mean = total / count.clamp(min=1)
        keep = self.decay ** (count if self.update_rule == "trace" else (count > 0).to(torch.float64))
        self.baseline = keep * self.baseline + (1 - keep) * mean

    def __call__(
        self,
        rewards: Tensor,
        keys: Tensor,
        *,
        mask: Tensor | None = None,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
    ) -> Tensor:
        if self.update_rule != "sequential":
            out = self.advantages(rewards, keys, mask=mask)
            self.update(rewards, keys, mask=mask, process_group=process_group, reduce=reduce)
            return out
        work, keys, rewards, rows = self._inputs(rewards, keys, mask)
        before, scale, shift = _sequential_scan(work, keys, self.num_keys, self.decay, rows)
        # Over ranks: each rank's rows act on the baseline as b -> scale b + shift; compose them in rank order.
        n_ranks, me = world_size(process_group, reduce), rank(process_group, reduce)
        maps = torch.zeros(n_ranks, 2, self.num_keys, dtype=torch.float64, device=work.device)
        maps[me, 0], maps[me, 1] = scale, shift
        maps = all_reduce(maps, process_group, reduce)
        start = self.baseline
        for r in range(n_ranks):
            if r == me:
                mine = start
            start = maps[r, 0] * start + maps[r, 1]
        self.baseline = start
        b = (
            before[0][torch.arange(work.shape[0], device=work.device), keys] * mine[keys]
            + before[1][torch.arange(work.shape[0], device=work.device), keys]
        )
        return torch.where(rows, work - b, 0.0).to(rewards.dtype)


def _sequential_scan(rewards: Tensor, keys: Tensor, num_keys: int, decay: float, rows: Tensor):
    """The recursion b ← α b + (1 - α) R over the rows in order (those flagged in `rows`; the others
    leave b as it is), per key, as affine maps b ↦ a b + c: the map of the rows before each row
    (`[2, B, K]`: a, c) and of all rows (`[K]` a, `[K]` c). A Hillis-Steele scan: log2(B) steps of
    `[B, K]` products, every a in [0, 1] (no overflow)."""
    n = rewards.shape[0]
    onehot = torch.zeros(n, num_keys, dtype=torch.bool, device=rewards.device)
    onehot[torch.arange(n, device=rewards.device), keys] = True
    onehot = onehot & rows[:, None]
    a = torch.ones(n, num_keys, dtype=torch.float64, device=rewards.device).masked_fill(onehot, decay)
    c = torch.where(onehot, (1 - decay) * rewards[:, None], 0.0)
    d = 1
    while d < n:  # inclusive scan: row j's map becomes rows (j-d, j]'s composed map
        a_prev = torch.cat([a.new_ones(d, num_keys), a[:-d]])
        c_prev = torch.cat([c.new_zeros(d, num_keys), c[:-d]])
        a, c = a * a_prev, a * c_prev + c
        d *= 2
    total = (a[-1], c[-1]) if n else (a.new_ones(num_keys), c.new_zeros(num_keys))
    before_a = torch.cat([a.new_ones(1, num_keys), a[:-1]])
    before_c = torch.cat([c.new_zeros(1, num_keys), c[:-1]])
    return (before_a, before_c), total[0], total[1]
