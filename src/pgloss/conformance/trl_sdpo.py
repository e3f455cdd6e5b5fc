"""pgloss's `sdpo` against TRL's SDPO (`pgloss conformance --trainer trl_sdpo`): TRL 1.16's own
`trl/experimental/sdpo/sdpo_trainer.py` `SDPOTrainer._compute_self_distillation_loss` and `_compute_policy_loss`,
run on a stand-in trainer that holds the attributes they read, combined as its `compute_loss` combines them,
(1 − w)·policy + w·distillation; pgloss's side is `pgloss.get("sdpo", self_distill_coef=w, policy_coef=1 − w,
self_distill_is_cap=κ)` on the sampled tokens' log-probs. Value and gradient with respect to the student's logits,
float64; a row without a teacher (TRL's `self_distillation_mask` 0) is the student's own log-probs as
`teacher_log_prob` on pgloss's side.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

from .case import Case, relative

__all__ = ["TRAINER", "available", "cases", "trl_loss"]

TRAINER = "TRL"
TOLERANCE = 1e-12
EMPTY_ROW = (
    "TRL's SDPO means over every row, empty ones too; pgloss's seq-mean-token-mean over the rows that hold a token "
    "(docs/reference.md, 'Teachers beside the policy loss')"
)
SETTINGS: tuple[dict[str, Any], ...] = (
    dict(cap=2.0, weight=1.0),
    dict(cap=None, weight=1.0),
    dict(cap=2.0, weight=1.0, on_policy=True),
    dict(cap=2.0, weight=0.4),
    dict(cap=2.0, weight=1.0, no_teacher_row=True),
    dict(cap=2.0, weight=1.0, empty_row=True),
)


def available() -> str | None:
    """None when TRL's SDPO trainer can be imported, else why not."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    try:
        from trl.experimental.sdpo import sdpo_trainer  # noqa: F401
    except Exception as error:
        return f"trl.experimental.sdpo cannot be imported ({type(error).__name__}: {error})"
    return None


def _batch(seed: int, *, empty_row: bool, rows: int = 5, length: int = 6, vocab: int = 11) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, length, vocab, generator=gen, dtype=torch.float64)
    teacher = student + 0.8 * torch.randn(rows, length, vocab, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, vocab, (rows, length), generator=gen)
    lengths = torch.randint(1, length + 1, (rows,), generator=gen)
    if empty_row:
        lengths[2] = 0
    mask = torch.arange(length)[None, :] < lengths[:, None]
    noisy = student + 0.3 * torch.randn(rows, length, vocab, generator=gen, dtype=torch.float64)
    old = torch.log_softmax(noisy, -1).gather(-1, ids[..., None]).squeeze(-1)
    advantages = torch.randn(rows, generator=gen, dtype=torch.float64)
    return dict(student=student, teacher=teacher, ids=ids, mask=mask, old=old, advantages=advantages)


def _sampled(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, ids[..., None]).squeeze(-1)


def trl_loss(batch: dict, has_teacher: torch.Tensor, *, cap: float | None, weight: float, on_policy: bool):
    """TRL's SDPO loss on `batch` (student and teacher logits, sampled ids, mask, old log-probs, advantages), rows
    without a teacher where `has_teacher` is False: (1 − w)·`_compute_policy_loss` + w·`_compute_self_distillation_loss`
    as its `compute_loss` combines them (w = 1: the distillation loss alone), and its gradient to the student's
    logits."""
    from trl.experimental.sdpo import sdpo_trainer as sdpo

    args = SimpleNamespace(
        distillation_mode="sampled_token", distillation_alpha=1.0, distillation_is_clip=cap, distillation_weight=weight
    )
    model = SimpleNamespace(training=True)
    trainer: Any = SimpleNamespace(  # the attributes the two methods read
        args=args,
        model=model,
        accelerator=SimpleNamespace(gather=lambda x: x),
        _log_self_distillation_metric=lambda mode, value: None,
        _metrics={"train": defaultdict(list)},
        importance_sampling_level="token",
        epsilon_low=0.2,
        epsilon_high=0.2,
        loss_type="dapo",
    )
    logits = batch["student"].clone().requires_grad_(True)
    mask = batch["mask"].double()
    distillation = sdpo.DistillationLogits(
        batch["ids"], mask, mask * has_teacher.double()[:, None], logits, batch["teacher"]
    )
    inputs = {"completion_ids": batch["ids"], "completion_mask": mask, "advantages": batch["advantages"]}
    if not on_policy:
        inputs["old_per_token_logps"] = batch["old"]
    loss = weight * sdpo.SDPOTrainer._compute_self_distillation_loss(trainer, model, inputs, distillation)
    if weight != 1.0:
        loss = loss + (1 - weight) * sdpo.SDPOTrainer._compute_policy_loss(trainer, inputs, logits)
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad


def _case(setting: dict[str, Any], seed: int) -> Case:
    from ..algorithms import get

    cap, weight, on_policy = setting["cap"], setting["weight"], setting.get("on_policy", False)
    batch = _batch(seed, empty_row=setting.get("empty_row", False))
    has_teacher = torch.ones(len(batch["mask"]), dtype=torch.bool)
    if setting.get("no_teacher_row"):
        has_teacher[1] = False
    theirs, their_grad = trl_loss(batch, has_teacher, cap=cap, weight=weight, on_policy=on_policy)
    algorithm = get("sdpo", self_distill_is_cap=cap, self_distill_coef=weight, policy_coef=1 - weight)
    logits = batch["student"].clone().requires_grad_(True)
    log_prob = _sampled(logits, batch["ids"])
    teacher = torch.where(has_teacher[:, None], _sampled(batch["teacher"], batch["ids"]), log_prob.detach())
    old = None if on_policy else batch["old"]
    ours = algorithm(log_prob, old, batch["advantages"], batch["mask"], teacher_log_prob=teacher).loss
    (our_grad,) = torch.autograd.grad(ours, logits)
    words = {"on_policy": "on-policy", "no_teacher_row": "a row without a teacher", "empty_row": "an empty row"}
    text = [f"distillation_is_clip={cap}", f"distillation_weight={weight}"]
    text += [word for key, word in words.items() if setting.get(key)]
    return Case(
        TRAINER,
        "SDPOTrainer._compute_self_distillation_loss",
        "sdpo",
        ", ".join(text),
        relative(ours.detach(), theirs),
        relative(our_grad.flatten(), their_grad.flatten()),
        TOLERANCE,
        reason=EMPTY_ROW if setting.get("empty_row") else None,
    )


def cases() -> Iterator[Case]:
    """SDPO's distillation term alone and blended with its policy term, capped and not, on- and off-policy, with a
    row without a teacher, and with an empty row (a documented difference)."""
    for index, setting in enumerate(SETTINGS):
        yield _case(setting, seed=300 + index)
