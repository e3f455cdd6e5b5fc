"""Every input of the plain call, made once and called with the gradient of every input that keeps one: shared
by the properties of what the call reads (values under the mask, layouts). The optional inputs come from
`core/inputs.py`'s table, so a new input reaches these tests when it is added.

Imported as `from properties.call_inputs import ...` (tests/ is on the path, see conftest.py)."""

from __future__ import annotations

import torch

from pgloss.core.inputs import OPTIONAL_INPUTS

ROWS, WIDTH = 6, 5
ARGUMENTS = ("log_prob", "old_log_prob", "advantages", "mask") + tuple(OPTIONAL_INPUTS)
TOKEN_INPUTS = ("log_prob", "old_log_prob") + tuple(
    name for name, spec in OPTIONAL_INPUTS.items() if spec.per == "token" and spec.kind == "real"
)
"""The real `[B, T]` inputs."""
ROW_INPUTS = tuple(name for name, spec in OPTIONAL_INPUTS.items() if spec.per == "row" and spec.kind == "real")
"""The real `[B]` inputs besides `advantages`."""
LEAVES = ("log_prob",) + tuple(name for name, spec in OPTIONAL_INPUTS.items() if spec.grad)
"""The inputs whose gradient the call keeps (the others are detached)."""


def finite_inputs(seed, mask, per_token_advantages, dtype):
    """Every argument of the call, finite everywhere: log-probs in [-3, -0.01], ratios near one; `advantages`
    `[B, T]` or `[B]`; real tensors in `dtype`."""
    g = torch.Generator().manual_seed(seed)

    def uniform(low, high):
        return low + (high - low) * torch.rand(ROWS, WIDTH, generator=g, dtype=torch.float64)

    def near(scale):
        return (old + scale * torch.randn(ROWS, WIDTH, generator=g, dtype=torch.float64)).clamp(max=-0.01)

    old = uniform(-3.0, -0.05)
    values = dict(
        log_prob=near(0.3),
        old_log_prob=old,
        ref_log_prob=near(0.2),
        rollout_log_prob=near(0.2),
        teacher_log_prob=near(0.3),
        entropy=uniform(0.0, 2.0),
        full_kl=uniform(0.0, 1.0),
        rollout_is_weight=uniform(0.5, 1.5),
        advantages=torch.randn((ROWS, WIDTH) if per_token_advantages else (ROWS,), generator=g, dtype=torch.float64),
        scores=torch.randn(ROWS, generator=g, dtype=torch.float64),
    )
    assert set(values) >= set(TOKEN_INPUTS + ROW_INPUTS), "a new real input needs finite values here"
    values = {k: v.to(dtype) for k, v in values.items()}
    values |= dict(
        mask=mask, group_ids=torch.randint(0, 3, (ROWS,), generator=g), expert=torch.rand(ROWS, generator=g) < 0.3
    )
    assert set(values) == set(ARGUMENTS), "a new input needs a value here"
    return values


def call_with_gradients(algorithm, values, *, step, view=None):
    """`algorithm` on `values` (each first passed through `view(name, tensor)` when given), with the step's
    Normalizer counted on those tensors when `step`: (its LossOutput, {leaf: ∂loss/∂leaf}, zeros where unused)."""
    leaves = {name: values[name].clone().requires_grad_(True) for name in LEAVES}
    given = values | leaves
    if view is not None:
        given = {name: view(name, value) for name, value in given.items()}
    normalizer = None
    if step:
        normalizer = algorithm.step_normalizer(
            given["mask"],
            old_log_probs=given["old_log_prob"],
            rollout_log_probs=given["rollout_log_prob"],
            group_ids=given["group_ids"],
            scores=given["scores"],
            expert=given["expert"],
        )
    torch.manual_seed(0)  # Clip-Cov and KL-Cov draw from the global generator
    out = algorithm(normalizer=normalizer, **given)
    grads = torch.autograd.grad(out.loss, list(leaves.values()), allow_unused=True)
    return out, {
        name: torch.zeros_like(leaf) if grad is None else grad
        for (name, leaf), grad in zip(leaves.items(), grads, strict=True)
    }
