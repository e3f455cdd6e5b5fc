"""Shared by the ms-swift tests and their two-process worker: ms-swift 4.6.0's own GRPO pipeline on a tiny Qwen2
built in code (examples/trl_tiny.py: nothing downloaded), its trainer driven for one optimizer step on recorded
micro-batches, and the step's gradient from one plain pgloss call on them (the adapter's promise)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

import trl_tiny

import pgloss

REWARD_PLUGIN = """
from swift.rewards import ORM, orms


class Digits(ORM):
    def __call__(self, completions, **kwargs):
        return [sum(w.isdigit() for w in t.split()) / max(len(t.split()), 1) for t in completions]


orms["pgloss_digits"] = Digits
"""


def workspace(root: Path) -> dict[str, str]:
    """The tiny model, a dataset of chat prompts and a reward plugin under `root` (made once)."""
    paths = {"model": root / "model", "data": root / "data.jsonl", "reward": root / "reward.py"}
    if not (paths["model"] / "config.json").exists():
        trl_tiny.make_tiny_model(str(paths["model"]))
        with open(paths["data"], "w") as f:
            for prompt in trl_tiny.PROMPTS * 4:
                f.write(json.dumps({"messages": [{"role": "user", "content": prompt}]}) + "\n")
        paths["reward"].write_text(REWARD_PLUGIN)
    return {key: str(value) for key, value in paths.items()}


def arguments(root: Path, *, plugins: tuple[str, ...] = (), **overrides: Any):
    """ms-swift's RLHFArguments for GRPO on the tiny model, on the CPU in float32."""
    from swift import RLHFArguments

    paths = workspace(root)
    values: dict[str, Any] = dict(
        rlhf_type="grpo",
        model=paths["model"],
        model_type="qwen2",
        template="default",
        dataset=[paths["data"]],
        external_plugins=[paths["reward"], *plugins],
        reward_funcs=["pgloss_digits"],
        num_generations=4,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_completion_length=8,
        max_steps=2,
        learning_rate=2e-2,
        max_grad_norm=0.0,
        output_dir=str(root / "out"),
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        torch_dtype="float32",
        tuner_type="full",
        beta=0.0,
        logging_steps=1,
        split_dataset_ratio=0,
        dataloader_num_workers=0,
        seed=0,
        use_hf=True,
        check_model=False,  # no hub lookup of the local model
    )
    values.update(overrides)
    return RLHFArguments(**values)


def build_trainer(args, trainer_cls=None):
    """ms-swift's own pipeline (`swift.pipelines.train.rlhf.SwiftRLHF`, what `rlhf_main` runs) up to the trainer it
    would train: the model, template, dataset, reward functions and reference as ms-swift prepares them."""
    from swift.pipelines.train.rlhf import SwiftRLHF
    from swift.trainers.trainer_factory import TrainerFactory

    class Build(SwiftRLHF):
        def train(self, trainer):
            return trainer

    if trainer_cls is not None:
        TrainerFactory.TRAINER_MAPPING["grpo"] = f"{trainer_cls.__module__}.{trainer_cls.__qualname__}"
    return Build(args).main()


def off_policy(trainer, seed: int = 0, *, rollout: bool = False) -> list[dict]:
    """One generation of ms-swift (its rollout, rewards, advantages and old log-probs), made off-policy so that
    clipping, weights and signs all occur: old = log π + 0.3·N(0, 1), Â ~ N(0, 1) per row, ref = log π + 0.2·N,
    and with `rollout` vLLM-like rollout log-probs = old + 0.3·N; a teacher's log-probs = log π + 0.25·N (for the
    names that read `teacher_log_prob`; ms-swift's own losses read them only with `sdar_loss_coef` > 0)."""
    trainer.model.train()
    batches = trainer._generate_and_score_completions(next(iter(trainer.get_train_dataloader())))
    generator = torch.Generator().manual_seed(seed)
    for micro in batches:
        batch = micro["grpo_batch"]
        log_prob = batch.old_per_token_logps
        shape = log_prob.shape
        batch.old_per_token_logps = log_prob + 0.3 * torch.randn(shape, generator=generator)
        batch.ref_per_token_logps = log_prob + 0.2 * torch.randn(shape, generator=generator)
        rows = torch.randn(log_prob.shape[0], 1, generator=generator)
        batch.advantages = rows.expand_as(log_prob).contiguous()
        batch.rollout_per_token_logps = (
            batch.old_per_token_logps + 0.3 * torch.randn(shape, generator=generator) if rollout else None
        )
        batch.teacher_per_token_logps = log_prob + 0.25 * torch.randn(shape, generator=generator)
    return batches


def drive_step(trainer, algorithm, batches: list[dict], number: int):
    """One optimizer step of `trainer` over `batches` (its micro-batches, GA = len(batches)) through its own
    `training_step` (ms-swift's, TRL's and transformers': the loss scaling and backward), from zero gradients;
    returns the accumulated gradients and the step's logged pgloss metrics (and `step_loss`)."""
    trainer.algorithm = algorithm
    trainer._pgloss_window = None
    trainer._buffered_inputs = batches
    trainer._prepare_inputs = lambda inputs: inputs  # the recorded micro-batches, not a new generation
    trainer.state.global_step = number
    trainer.current_gradient_accumulation_steps = len(batches)
    trainer.args.steps_per_generation = len(batches)
    trainer._step = 0
    model = trainer.model_wrapped
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    loss = sum(float(trainer.training_step(model, micro)) for micro in batches)
    unwrapped = trainer.accelerator.unwrap_model(model)
    grads = {k: p.grad.detach().clone() for k, p in unwrapped.named_parameters() if p.grad is not None}
    logged = {k: v[-1] for k, v in trainer._metrics["train"].items() if k.startswith("pgloss/")}
    logged["step_loss"] = loss  # the summed losses training_step returns (what the Trainer logs)
    return grads, logged


def _pad(tensors: list[torch.Tensor], value: float = 0) -> torch.Tensor:
    width = max(t.shape[1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value) for t in tensors])


def records(trainer, batches: list[dict]) -> list[dict]:
    """What the reference needs of each micro-batch (CPU tensors, for the two-process worker too)."""
    out = []
    for micro in batches:
        batch, inputs = micro["grpo_batch"], micro["model_inputs"]
        mask = batch.completion_mask.float()
        if trainer.args.overlong_filter:
            mask = mask * (~batch.truncated_mask.bool())[:, None]
        record = dict(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            mask=mask,
            old=batch.old_per_token_logps,
            ref=batch.ref_per_token_logps,
            advantages=batch.advantages,
            group_ids=batch.pgloss_group_ids,
            scores=batch.pgloss_scores,
            teacher=batch.teacher_per_token_logps,
        )
        record["rollout"] = trainer._pgloss_rollout(batch)  # where the adapter passes them (the algorithm's use)
        out.append({k: v.detach().clone() for k, v in record.items() if v is not None})
    return out


def window_gradient(model: torch.nn.Module, recorded: list[dict], algorithm, temperature: float = 1.0):
    """The gradient of one plain `algorithm(...)` call on every recorded micro-batch, from full logits, and its
    metrics. A family that couples the rows of a call by a selection among its tokens (`couples_rows`) is computed
    per micro-batch, as ms-swift's trainer calls it: then the reference is one `pgloss.Step` over the
    micro-batches, each micro-batch's call through it."""
    model.zero_grad(set_to_none=True)
    calls = []
    for record in recorded:
        length = record["mask"].shape[1]
        ids = record["input_ids"]
        logits = model(input_ids=ids, attention_mask=record["attention_mask"]).logits[:, -length - 1 : -1]
        logp = (logits.float() / temperature).log_softmax(-1)
        call: dict[str, Any] = dict(
            log_prob=logp.gather(-1, ids[:, -length:, None]).squeeze(-1),
            entropy=-(logp.exp() * logp).sum(-1),
            old_log_prob=record["old"],
            advantages=record["advantages"],
            mask=record["mask"],
        )
        if "ref_log_prob" in algorithm.needs:
            call["ref_log_prob"] = record["ref"]
        if "teacher_log_prob" in algorithm.needs:
            call["teacher_log_prob"] = record["teacher"]
        for key in ("group_ids", "scores"):
            if key in algorithm.needs:
                call[key] = record[key]
        if "rollout" in record:
            call["rollout_log_prob"] = record["rollout"]
        calls.append(call)
    if type(algorithm).couples_rows:
        step = pgloss.Step(algorithm, calls)
        for call in calls:
            step(**call).loss.backward()
        metrics = step.metrics.as_floats()
    else:
        rows = ("group_ids", "scores")
        joined = {key: _pad([c[key] for c in calls]) for key in calls[0] if key not in rows}
        joined |= {key: torch.cat([c[key] for c in calls]) for key in rows if key in calls[0]}
        out = algorithm(**joined)
        out.loss.backward()
        metrics = {key: float(value) for key, value in out.metrics.items()}
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}, metrics


def relative_error(grads: dict, reference: dict) -> float:
    keys = sorted(reference)
    diff = torch.cat([(grads[k] - reference[k]).flatten() for k in keys]).norm()
    return float(diff / torch.cat([reference[k].flatten() for k in keys]).norm().clamp_min(1e-30))


def named_algorithm(args, name: str):
    """`name` as the adapter builds it from ms-swift's arguments (`loss_type=pgloss:<name>`)."""
    from pgloss.trainer_options.swift import swift_algorithm

    view = {key: getattr(args, key) for key in dir(args) if not key.startswith("_")}
    return swift_algorithm(view | {"loss_type": "grpo"}, name)


def tiny_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
