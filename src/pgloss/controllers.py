"""Coefficients steered across optimizer steps: state that lives between loss calls, never inside one.

`AdaptiveEntropy` is TRL 1.16's `use_adaptive_entropy` (trl/trainer/grpo_trainer.py, `_compute_loss`;
trl/trainer/grpo_config.py), the adaptive entropy control of Skywork-OR1 (He et al. 2025, arXiv
2505.22312, sec. 3.2.2). With c_k the coefficient and H_k the step's mean entropy over the loss's
tokens (every micro-batch, every rank: Σ H·m / max(Σ m, 1)):

    applied at step k+1:  c_k   if H_k ≤ H_target,   0 otherwise     (0 at the first step: H_0 = +∞)
    after step k:         c_k = min(c_{k-1} + δ, c_max)  if H_k ≤ H_target
                          c_k = max(c_{k-1} - δ, c_min)  otherwise

The coefficient moves at every optimizer step, but the bonus is applied only while the entropy is at
or below the target. Step it once per optimizer step, after the step's loss calls:

    controller = AdaptiveEntropy(coef=0.0, target=0.5)
    for step in steps:
        algorithm = controller.algorithm(base)          # entropy_coef = the coefficient applied this step
        for micro in step:
            out = algorithm(..., entropy=micro.entropy, normalizer=normalizer)
            out.loss.backward()
            controller.observe(micro.entropy, micro.mask)    # no host read
        optimizer.step()
        controller.step()                              # all-reduces the window's sums, one host read

The loss call stays free of host reads: the coefficient is a Python float fixed for the step.

`MuSchedule` is CHORD's μ(t) (arXiv 2508.11408; Trinity-RFT 0.6.0 `mu_schedule_function`,
trinity/algorithm/policy_loss_fn/chord_policy_loss.py): a function of the global step, no state:

    μ(t) = μ_peak · t / T_warm                                   t < T_warm
    μ(t) = μ_valley + (μ_peak − μ_valley) · ½(1 + cos(π (t − T_warm) / T_decay))   T_warm ≤ t < T_warm + T_decay
    μ(t) = μ_valley                                              t ≥ T_warm + T_decay

    algorithm = schedule.algorithm(pgloss.get("chord"), step)   # chord_mu = μ(step)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .base import Algorithm
from .core.checks import check_fields, check_number
from .core.distributed import is_distributed
from .losses.chord import CHORD

__all__ = ["AdaptiveEntropy", "MuSchedule"]


class AdaptiveEntropy:
    """TRL 1.16's adaptive entropy coefficient (see the module docstring), with TRL's defaults.

    Args:
        coef: the initial coefficient (TRL's `entropy_coef`).
        target: H_target in nats (`entropy_target`, 0.2).
        delta: the step δ (`entropy_coef_delta`, 0.005).
        coef_min: the lower bound of the coefficient (`entropy_coef_min`, 0).
        coef_max: its upper bound (`entropy_coef_max`, 1).
    """

    def __init__(
        self,
        coef: float = 0.0,
        *,
        target: float = 0.2,
        delta: float = 0.005,
        coef_min: float = 0.0,
        coef_max: float = 1.0,
    ) -> None:
        self.coef = check_number("coef", coef)
        self.target = check_number("target", target)
        self.delta = check_number("delta", delta)
        self.coef_min = check_number("coef_min", coef_min)
        self.coef_max = check_number("coef_max", coef_max)
        if self.delta < 0:
            raise ValueError(f"delta must be >= 0, got {delta}")
        if self.coef_min > self.coef_max:
            raise ValueError(f"coef_min must be <= coef_max, got {coef_min} > {coef_max}")
        self.last_entropy = math.inf
        """H of the last step (+∞ before the first): the gate of the applied coefficient."""
        self._window: Tensor | None = None

    @property
    def applied(self) -> float:
        """The coefficient of this step's loss: `coef` while the last step's entropy is ≤ `target`, else 0."""
        return self.coef if self.last_entropy <= self.target else 0.0

    def algorithm(self, base: Algorithm) -> Algorithm:
        """`base` with `entropy_coef` = `applied`. Its calls need `entropy` to measure the step even while
        the bonus is off (pass it always: `observe` reads it)."""
        if base.entropy_coef == self.applied:
            return base
        return dataclasses.replace(base, entropy_coef=self.applied)

    def observe(self, entropy: Tensor, mask: Tensor) -> None:
        """Add a micro-batch's Σ H·m and Σ m (`[B, T]`, the loss's mask) to the step's window; detached,
        float64, no host read."""
        if entropy.shape != mask.shape:
            raise ValueError(
                f"entropy and mask must have one shape, got {tuple(entropy.shape)} and {tuple(mask.shape)}"
            )
        valid = mask.detach() != 0
        stats = torch.stack(
            [torch.where(valid, entropy.detach().to(torch.float64), 0.0).sum(), valid.sum().to(torch.float64)]
        )
        self._window = stats if self._window is None else self._window + stats.to(self._window.device)

    def step(
        self,
        *,
        process_group: dist.ProcessGroup | None = None,
        reduce: bool = True,
        device: torch.device | str | None = None,
    ) -> float:
        """End of an optimizer step: the window's entropy, summed over the ranks of `process_group` (a
        collective under torch.distributed: every rank calls it, even one that observed nothing, whose
        zero sums sit on `device`), updates the coefficient (`update`); the window is emptied. Returns the
        new coefficient. One host read."""
        window = self._window if self._window is not None else torch.zeros(2, dtype=torch.float64, device=device)
        if is_distributed(reduce):
            window = window.clone()
            dist.all_reduce(window, group=process_group)
        self._window = None
        return self.update(float(window[0] / window[1].clamp(min=1.0)))

    def update(self, entropy: float) -> float:
        """The rule, from the step's global mean entropy `entropy`: c ± δ within [coef_min, coef_max]."""
        entropy = check_number("entropy", entropy)
        if entropy <= self.target:
            self.coef = min(self.coef + self.delta, self.coef_max)
        else:
            self.coef = max(self.coef - self.delta, self.coef_min)
        self.last_entropy = entropy
        return self.coef

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps (TRL's entropy_ctrl_state.json holds the same two values)."""
        return {"coef": self.coef, "last_entropy": self.last_entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = check_number("coef", state["coef"])
        last = state["last_entropy"]
        self.last_entropy = math.inf if last == math.inf else check_number("last_entropy", last)
        self._window = None

    def __repr__(self) -> str:
        return (
            f"AdaptiveEntropy(coef={self.coef}, target={self.target}, delta={self.delta}, "
            f"coef_min={self.coef_min}, coef_max={self.coef_max}, last_entropy={self.last_entropy})"
        )


@dataclass(frozen=True)
class MuSchedule:
    """CHORD's μ(t): linear warm-up to `peak`, cosine decay to `valley` over `decay_steps`, then `valley`
    (see the module docstring). Trinity's defaults: peak = valley = 0.1, no warm-up, no decay (constant)."""

    peak: float = 0.1
    valley: float = 0.1
    warmup_steps: int = 0
    decay_steps: int = 0

    def __post_init__(self) -> None:
        check_fields(self)
        for name in ("peak", "valley"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"{name} must lie in [0, 1] (μ weighs the SFT part against the RL part), got {getattr(self, name)}"
                )
        for name in ("warmup_steps", "decay_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def __call__(self, step: int) -> float:
        """μ at global step `step`."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral):
            raise TypeError(f"step must be an integer, got {step!r} ({type(step).__name__})")
        if step < self.warmup_steps:
            return step / self.warmup_steps * self.peak
        if step >= self.warmup_steps + self.decay_steps:
            return self.valley
        cosine = 0.5 * (1.0 + math.cos(math.pi * (step - self.warmup_steps) / self.decay_steps))
        return (self.peak - self.valley) * cosine + self.valley

    def algorithm(self, base: Algorithm, step: int) -> Algorithm:
        """`base` (CHORD, or a family built on it: the field `chord_mu`) with chord_mu = μ(step)."""
        if not isinstance(base, CHORD):
            raise TypeError(f"{type(base).__name__} has no chord_mu: MuSchedule steers CHORD (pgloss.get('chord'))")
        return dataclasses.replace(base, chord_mu=self(step))
