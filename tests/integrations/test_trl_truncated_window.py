"""The TRL adapter on a window with masked completions, through the real GRPOTrainer (TRL 1.16) on a CPU: a tiny
Qwen2, one generation of 8 completions with `mask_truncated_completions=True`, two accumulation micro-batches
made off-policy. The adapter's step (both micro-batches' losses back-propagated, as Trainer does) is held to
the float64 loop of the loss over the step's kept tokens (tests/loops), chained through the model, for two bug
classes other libraries shipped in 2026:

- TRL #6369/#6439: dapo/cispo/vespo's denominator ignored `mask_truncated_completions`;
- ms-swift #10117: DAPO/CISPO/FIPO losses divided by the gradient-accumulation steps twice;

and non-finite values where the mask is 0 (TRL's inputs at padding and in the truncated completions) change
neither the gradient nor a logged metric.
"""

import os

import pytest
import torch

import pgloss

pytest.importorskip("trl")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from properties.references import central_differences, step_loss_loop
from trl_window import off_policy_window, relative_error, trl_tiny


@pytest.fixture(scope="module")
def window(tmp_path_factory):
    """A GA = 2 window of 8 completions (two prompts) from TRL's own generation with mask_truncated_completions:
    TRL zeroes the completion mask of a completion that ran out of budget. Old log-probs = log π + 0.3·N(0, 1),
    advantages ~ N(0, 1), so that clipping, weights and signs all occur."""
    root = tmp_path_factory.mktemp("truncated")
    model_dir = trl_tiny.make_tiny_model(str(root / "model"))
    return off_policy_window(
        model_dir,
        str(root / "out"),
        lambda trainer, batch: model_log_prob(trainer.model, batch),
        config=dict(per_device_train_batch_size=4, mask_truncated_completions=True),
    )


def model_log_prob(model, batch):
    """log π(y_t) of a micro-batch's completions from the model's logits (temperature 1, TRL's default)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    length = batch["completion_ids"].shape[1]
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1]
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)


def adapter_step(trainer, algorithm):
    """The adapter's optimizer step: each micro-batch's loss back-propagated in turn. (summed loss, gradients)."""
    trainer.algorithm = algorithm
    trainer.model.zero_grad()
    trainer.state.global_step += 1  # a new optimizer step: the adapter counts a new window
    total = 0.0
    for j, batch in enumerate(trainer._buffered_inputs):
        trainer._step = j
        loss = trainer._compute_loss(trainer.model, batch)
        loss.backward()
        total += float(loss.detach())
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    return total, grads


def loop_step(trainer, name, algorithm):
    """The loop's loss over the window's kept tokens (float64) and its gradient chained through the model."""
    batches = trainer._buffered_inputs
    trainer.model.zero_grad()
    log_prob = torch.cat([model_log_prob(trainer.model, b) for b in batches])
    mask = torch.cat([b["completion_mask"] for b in batches]).bool()
    old = torch.cat([b["old_per_token_logps"] for b in batches])
    adv = torch.cat([b["advantages"] for b in batches])[:, None].expand_as(mask)
    lp0 = log_prob.detach().double()
    loss_of = step_loss_loop(name, algorithm, lp0.tolist(), old.double().tolist(), adv.double().tolist(), mask.tolist())
    log_prob.backward(central_differences(loss_of, lp0).float())
    grads = {k: p.grad.clone() for k, p in trainer.model.named_parameters() if p.grad is not None}
    return loss_of(lp0.tolist()), grads


def completions(trainer):
    """(kept tokens, truncated completions, their tokens before TRL masked them) of the window."""
    kept = truncated = truncated_tokens = 0
    for batch in trainer._buffered_inputs:
        mask, ids = batch["completion_mask"].bool(), batch["completion_ids"]
        kept += int(mask.sum())
        for row, row_ids in zip(mask, ids, strict=True):
            if not row.any() and int(row_ids[-1]) not in (0, 1):  # no end (eos 1) nor padding (0) at the budget
                truncated += 1
                truncated_tokens += row_ids.shape[0]
    return kept, truncated, truncated_tokens


@pytest.mark.parametrize("name", ["dapo", "cispo", "vespo"])
def test_truncated_completions_leave_the_token_mean_denominator(window, name):
    """TRL #6369/#6439: with mask_truncated_completions, the token mean of dapo, cispo and vespo divides by the
    tokens kept after the truncated completions are masked, as the loop over those tokens does."""
    kept, truncated, truncated_tokens = completions(window)
    assert kept > 0 and truncated > 0, (kept, truncated)  # both kinds of completion in the window
    algorithm = pgloss.get(name, generation_budget=8)
    loss, grads = adapter_step(window, algorithm)
    expected_loss, expected_grads = loop_step(window, name, algorithm)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    # The bug's value: the truncated completions' tokens in the denominator.
    assert abs(loss - expected_loss * kept / (kept + truncated_tokens)) > 1e-3 * abs(expected_loss)
    error = relative_error(grads, expected_grads)
    print(f"{name}: {kept} kept tokens, {truncated} truncated completions; relative gradient error {error:.2e}")
    assert error < 2e-5


@pytest.mark.parametrize("name", ["dapo", "cispo", "fipo"])
def test_gradient_accumulation_divides_once(window, name):
    """ms-swift #10117: gradient_accumulation_steps = 2 through the adapter, micro-batches of uneven token counts:
    the summed gradient is the loop's over the whole window, not a half of it."""
    counts = [int(b["completion_mask"].sum()) for b in window._buffered_inputs]
    assert window.current_gradient_accumulation_steps == 2 and counts[0] != counts[1], counts
    algorithm = pgloss.get(name, generation_budget=8)
    loss, grads = adapter_step(window, algorithm)
    expected_loss, expected_grads = loop_step(window, name, algorithm)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-7)
    error = relative_error(grads, expected_grads)
    print(f"{name}: micro-batch tokens {counts}; relative gradient error {error:.2e}")
    assert error < 2e-5


def poisoned_batches(batches, seed):
    """Copies of `batches` with NaN, +inf or -inf at every masked position of TRL's float inputs (the advantages
    of the completions left with no token: the truncated ones)."""
    g = torch.Generator().manual_seed(seed)
    poisons = torch.tensor([float("nan"), float("inf"), -float("inf")])
    out = []
    for batch in batches:
        batch = dict(batch)
        mask = batch["completion_mask"].bool()
        for key in ("old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps", "advantages"):
            value = batch[key]
            hole = ~mask if value.ndim == 2 else ~mask.any(dim=-1)
            fill = poisons[torch.randint(0, 3, value.shape, generator=g)].to(value.dtype)
            batch[key] = torch.where(hole, fill, value)
        out.append(batch)
    return out


def logged_step(trainer, algorithm, batches):
    """The adapter's step on `batches`: its gradients and the metrics it logged (pgloss/<name>)."""
    saved, trainer._buffered_inputs = trainer._buffered_inputs, batches
    trainer._metrics["train"].clear()
    try:
        _, grads = adapter_step(trainer, algorithm)
    finally:
        trainer._buffered_inputs = saved
    return grads, {k: list(v) for k, v in trainer._metrics["train"].items()}


def test_non_finite_values_under_the_mask_change_nothing(window):
    """NaN and ±inf in the old, reference and vLLM log-probs where the completion mask is 0, and in the advantages
    of the truncated completions: the same gradient, bit for bit, and the same logged metrics (grpo with its KL
    term, a token TIS and k3 rejection on the vLLM log-probs)."""
    assert completions(window)[1] > 0  # completions left with no token
    generator = torch.Generator().manual_seed(1)
    clean = []
    noisy = lambda old, scale: old + scale * torch.randn(old.shape, generator=generator)  # noqa: E731
    for batch in window._buffered_inputs:
        old = batch["old_per_token_logps"]
        clean.append(dict(batch, ref_per_token_logps=noisy(old, 0.2), sampling_per_token_logps=noisy(old, 0.3)))
    correction = pgloss.RolloutCorrection(upper=2.0, rejection=(pgloss.Rejection("token_k3", upper=0.1),))
    algorithm = pgloss.get("grpo", rollout_correction=correction)
    expected_grads, expected_metrics = logged_step(window, algorithm, clean)
    grads, metrics = logged_step(window, algorithm, poisoned_batches(clean, seed=2))
    assert sum(float(g.norm()) for g in expected_grads.values()) > 0
    assert sorted(grads) == sorted(expected_grads)
    for key in expected_grads:
        assert torch.equal(grads[key], expected_grads[key]), key
    assert "pgloss/kl" in metrics and "pgloss/rollout_is_weight_mean" in metrics
    assert metrics == expected_metrics
