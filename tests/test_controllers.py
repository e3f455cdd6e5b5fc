"""pgloss.controllers.AdaptiveEntropy: TRL 1.16's `use_adaptive_entropy` rule against its float64 loop
(tests/loops/terms.py) and against TRL's own `GRPOTrainer._compute_loss` over a sequence of steps.

TRL's method runs unchanged on the conformance stand-in trainer (`pgloss.conformance.trl._trainer`),
which hands it each micro-batch's log-probs and entropies; its state (`entropy_coef`,
`_last_world_entropy`, the window buffer) persists across the steps, and `accelerator.sync_gradients`
marks the last micro-batch of each step. The coefficient TRL applies is read from its gradient with
respect to the entropies (its bonus is −c·Σ H·m / (Σ m · GA) per micro-batch). Measured: 3 configurations
× 14 steps × GA ∈ {1, 2} (126 micro-batches, the bonus on in 54): the applied coefficient read from the
gradient within 1.4e-17, the coefficient after each step within 1.4e-17, the step entropy equal.
"""

from __future__ import annotations

import math

import loops
import pytest
import torch

from pgloss.controllers import AdaptiveEntropy

F64 = dict(dtype=torch.float64)


def entropies(seed, steps=14, micro=2, rows=5, width=7):
    """Per step, `micro` micro-batches of entropies whose mean wanders around 0.5 (both branches, the bounds)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k in range(steps):
        level = 0.5 + 0.3 * math.sin(0.9 * k + seed)
        batch = []
        for _ in range(micro):
            lengths = torch.randint(1, width + 1, (rows,), generator=gen)
            mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
            batch.append((level * (0.5 + torch.rand(rows, width, generator=gen, **F64)), mask))
        out.append(batch)
    return out


CONFIGS = [
    dict(coef=0.0, target=0.5, delta=0.005, coef_min=0.0, coef_max=0.012),
    dict(coef=0.02, target=0.6, delta=0.01, coef_min=0.005, coef_max=1.0),
    dict(coef=0.1, target=0.2, delta=0.005, coef_min=0.0, coef_max=1.0),
]  # TRL's defaults but coef


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_loop(config, seed):
    steps = entropies(seed)
    expected = loops.adaptive_entropy([[((h * m).sum().item(), m.sum().item()) for h, m in s] for s in steps], **config)
    controller = AdaptiveEntropy(**config)
    for (applied, coef, entropy), step in zip(expected, steps, strict=True):
        assert controller.applied == applied
        for h, m in step:
            controller.observe(h, m)
        assert controller.step() == pytest.approx(coef, abs=1e-15)
        assert controller.last_entropy == pytest.approx(entropy, rel=1e-14)
    moved = [c for _, c, _ in expected]
    assert len(set(moved)) > 2  # the coefficient went up and down


def test_gate_bounds_and_first_step():
    c = AdaptiveEntropy(0.01, target=0.5, delta=0.02, coef_min=0.005, coef_max=0.04)
    assert c.applied == 0.0  # before any step the last entropy is +∞
    assert c.update(0.4) == pytest.approx(0.03) and c.applied == pytest.approx(0.03)
    assert c.update(0.5) == pytest.approx(0.04)  # at the target: increments (≤), capped at coef_max
    assert c.update(0.6) == pytest.approx(0.02) and c.applied == 0.0  # above: decremented, not applied
    assert c.update(0.9) == pytest.approx(0.005)  # floored at coef_min
    assert c.step() == pytest.approx(0.025) and c.last_entropy == 0.0  # an empty window is entropy 0 (TRL: 0/1)


def test_algorithm_takes_the_applied_coefficient():
    import pgloss

    base = pgloss.get("dapo")
    c = AdaptiveEntropy(0.03, target=0.5)
    assert c.algorithm(base) is base  # nothing applied before the first step
    c.update(0.1)
    assert c.algorithm(base).entropy_coef == pytest.approx(0.035)
    assert "entropy" in c.algorithm(base).needs


def test_state_dict_round_trip():
    c = AdaptiveEntropy(0.02, target=0.5)
    c.update(0.3)
    d = AdaptiveEntropy(0.0, target=0.5)
    d.load_state_dict(c.state_dict())
    assert (d.coef, d.last_entropy, d.applied) == (c.coef, c.last_entropy, c.applied)
    fresh = AdaptiveEntropy()
    fresh.load_state_dict(AdaptiveEntropy().state_dict())
    assert fresh.last_entropy == math.inf


def test_bad_arguments():
    with pytest.raises(ValueError, match="coef_min must be <= coef_max"):
        AdaptiveEntropy(coef_min=0.5, coef_max=0.1)
    with pytest.raises(ValueError, match="delta must be >= 0"):
        AdaptiveEntropy(delta=-1.0)
    with pytest.raises(TypeError, match="target must be a real number"):
        AdaptiveEntropy(target="0.2")
    with pytest.raises(ValueError, match="entropy and mask must have one shape"):
        AdaptiveEntropy().observe(torch.zeros(2, 3), torch.ones(2, 4))


# -- TRL 1.16 -----------------------------------------------------------------------------------------------------


def trl_sequence(config, steps, micro):
    """TRL's _compute_loss over the steps on one stand-in trainer: per step, the applied coefficient (from
    the entropy gradient), then its coefficient and last entropy after the step."""
    trl = pytest.importorskip("trl")
    from pgloss.conformance.trl import _trainer

    options = dict(
        loss_type="dapo",
        use_adaptive_entropy=True,
        entropy_coef=config["coef"],
        entropy_target=config["target"],
        entropy_coef_delta=config["delta"],
        entropy_coef_min=config["coef_min"],
        entropy_coef_max=config["coef_max"],
        gradient_accumulation_steps=micro,
    )
    grpo = trl.GRPOConfig(
        output_dir="pgloss-controllers", report_to=[], use_cpu=True, bf16=False, max_completion_length=7, **options
    )
    stub = None
    out = []
    for step in steps:
        applied = []
        for j, (entropy, mask) in enumerate(step[:micro]):
            log_prob = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(j), **F64)
            h = entropy.clone().requires_grad_(True)
            state = (
                None
                if stub is None
                else {k: getattr(stub, k) for k in ("entropy_coef", "_last_world_entropy", "_entropy_window_stats")}
            )
            stub = _trainer(grpo, log_prob, h)
            if state is not None:
                for k, v in state.items():
                    setattr(stub, k, v)
            stub.current_gradient_accumulation_steps = micro
            stub.accelerator.sync_gradients = j == micro - 1
            inputs = dict(
                prompt_ids=torch.zeros(mask.shape[0], 1, dtype=torch.long),
                prompt_mask=torch.ones(mask.shape[0], 1, dtype=torch.long),
                completion_ids=torch.zeros(mask.shape, dtype=torch.long),
                completion_mask=mask,
                advantages=torch.zeros(mask.shape[0], **F64),
                old_per_token_logps=log_prob.detach(),
                num_items_in_batch=mask.sum(),
            )
            trl.GRPOTrainer._compute_loss(stub, None, inputs).backward()
            applied.append(-micro * h.grad.sum().item())
        out.append((applied, stub.entropy_coef, stub._last_world_entropy))
    return out


@pytest.mark.parametrize("micro", [1, 2])
@pytest.mark.parametrize("config", CONFIGS)
def test_matches_trl_over_steps(config, micro):
    steps = entropies(3, micro=micro)
    theirs = trl_sequence(config, steps, micro)
    controller = AdaptiveEntropy(**config)
    for (applied, coef, last), step in zip(theirs, steps, strict=True):
        for a in applied:
            assert a == pytest.approx(controller.applied, abs=1e-15)
        for h, m in step[:micro]:
            controller.observe(h, m)
        controller.step()
        assert controller.coef == pytest.approx(coef, abs=1e-15)
        assert controller.last_entropy == pytest.approx(last, rel=1e-14)
