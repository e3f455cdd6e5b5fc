"""pgloss against verl's on-policy distillation through the policy loss (`pgloss conformance`, its own module beside
`verl.py`'s policy losses: `--trainer verl_distillation`).

verl 0.9.1's `verl/trainer/distillation/losses.py` `distillation_loss` (its estimator loss
`compute_distillation_loss_reverse_kl_estimator`, then the clamp and the `vanilla` clipped surrogate on
A_t = −D_t, or D_t itself without the policy gradient), added to the actor's `vanilla` policy loss as
`distillation_ppo_loss` adds them: L_task + coef·L_distill, or L_distill alone without task rewards. pgloss's side is
`pgloss.from_verl(actor_config, distillation=...)` on the same tensors, so the option map
(`trainer_options/verl_distillation.py`) is checked with the term. verl reads its tensors through a layout function
for its padding-free batches (`no_padding_2_padding`); the batch here is padded, so that function is the identity
for the duration of the call.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..trainer_options.verl import from_verl
from .case import Case, flat_grad
from .verl import TOLERANCE, TRAINER, _batch, _config, _errors, available

__all__ = ["TRAINER", "available", "cases"]

COEF = 0.5
SETTINGS = (  # (verl's loss_mode, use_task_rewards, use_policy_gradient)
    ("kl", True, True),
    ("mse", True, True),
    ("low_var_kl", True, True),
    ("abs", True, True),
    ("kl", False, True),
    ("low_var_kl", False, False),
)


def _case(mode: str, task: bool, policy_gradient: bool, seed: int) -> Case:
    from verl.trainer.distillation import losses
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import DistillationConfig, DistillationLossConfig

    batch = _batch(seed, empty_row=seed % 2 == 1)
    mask, teacher = batch["mask"], batch["ref"]
    loss = DistillationLossConfig(
        loss_mode=mode, distillation_loss_coef=COEF, use_task_rewards=task, use_policy_gradient=policy_gradient
    )
    actor = _config("vanilla", dict(clip_ratio_c=3.0), "token-mean")
    algorithm = from_verl(actor, distillation={"enabled": True, "distillation_loss": loss})
    counts = dict(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=int((mask.sum(-1) > 0).sum()))
    leaf = batch["log_prob"].clone().requires_grad_()
    data = dict(response_mask=mask, teacher_logprobs=teacher.unsqueeze(-1), old_log_probs=batch["old"], **counts)
    layout = losses.no_padding_2_padding
    losses.no_padding_2_padding = lambda tensor, data: tensor  # the batch is padded [B, T] already
    try:
        distill, _ = losses.distillation_loss(
            actor,
            DistillationConfig(distillation_loss=loss),
            {"log_probs": leaf},
            data,
        )
    finally:
        losses.no_padding_2_padding = layout
    theirs = distill
    if task:  # the actor's config now holds the step's counts, as verl's ppo_loss reads them
        policy, _ = get_policy_loss_fn("vanilla")(batch["old"], leaf, batch["advantages"], mask, "token-mean", actor)
        theirs = policy + COEF * distill
    theirs.backward()
    ours_leaf = batch["log_prob"].clone().requires_grad_()
    ours = algorithm(
        log_prob=ours_leaf,
        old_log_prob=batch["old"],
        advantages=batch["advantages"],
        mask=mask,
        teacher_log_prob=teacher,
    ).loss
    ours.backward()
    loss_error, grad_error = _errors(ours.detach(), theirs.detach(), flat_grad(ours_leaf), flat_grad(leaf))
    setting = f"loss_mode={mode}, use_task_rewards={task}, use_policy_gradient={policy_gradient}"
    if task:
        setting += f", distillation_loss_coef={COEF}"
    if seed % 2 == 1:
        setting += ", an empty row"
    name = f"{algorithm.name} + distill_estimator={algorithm.distill_estimator}"
    return Case(TRAINER, "distillation_loss", name, setting, loss_error, grad_error, TOLERANCE)


def cases() -> Iterator[Case]:
    """verl's distillation through the policy loss: each estimator with task rewards, and without them (with and
    without the policy gradient)."""
    for index, (mode, task, policy_gradient) in enumerate(SETTINGS):
        yield _case(mode, task, policy_gradient, seed=200 + index)
