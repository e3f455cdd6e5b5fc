"""How the TRL adapter reads an optimizer step of GRPOTrainer (TRL 1.16): the inputs it adds to each generation
batch (group ids, global over processes, and the raw scores), the loss masks of the step's micro-batches, the old
and rollout log-probs, and the step itself: a `pgloss.Step` over its window of buffered micro-batches, which
counts it once.

`TRLInputs` is the base of `pgloss.integrations.trl.PGLossMixin`, which documents the mapping and the counting;
`schedule_refusals` lists the GRPOConfig schedules whose optimizer step that window cannot hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..algorithms import Algorithm
from ..core.step_metrics import StepMetrics
from ..correction.token_masks import entropy_threshold, top_entropy_mask
from ..step import Step

if TYPE_CHECKING:  # what the mixin reads of the GRPOTrainer it is placed before (it is never used without one)
    from trl import GRPOConfig, GRPOTrainer

    _Trainer = GRPOTrainer
else:
    _Trainer = object

__all__ = ["MULTIMODAL", "TRLInputs", "schedule_refusals"]

# Inputs TRL forwards to a vision-language model; the non-fused path passes them on unchanged.
MULTIMODAL = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


def schedule_refusals(args: Any) -> list[str]:
    """The GRPOConfig options about the trainer's schedule whose effect the adapter cannot reproduce
    (the loss options are `pgloss.trainer_options.trl`'s)."""
    refused = []
    every = args.steps_per_generation * args.num_iterations
    if every % args.gradient_accumulation_steps:
        refused.append(
            f"steps_per_generation={args.steps_per_generation} with num_iterations={args.num_iterations} "
            f"and gradient_accumulation_steps={args.gradient_accumulation_steps} (an optimizer step would "
            "span two generations; make steps_per_generation·num_iterations a multiple of it)"
        )
    parallel = getattr(args, "parallelism_config", None)
    if parallel is not None and (getattr(parallel, "cp_size", 1) > 1 or getattr(parallel, "sp_size", 1) > 1):
        refused.append("parallelism_config with cp_size or sp_size > 1 (tokens would be counted once per shard)")
    return refused


class TRLInputs(_Trainer):
    """GRPOTrainer's batches and optimizer steps as pgloss's inputs and counts (a base of `PGLossMixin`)."""

    # GRPOTrainer's, as the mixin finds them after its __init__ (TRL types them more loosely)
    args: GRPOConfig
    model: torch.nn.Module
    # TRL sets None in __init__ (read by mypy as its type); _prepare_inputs fills it before any loss
    _buffered_inputs: list[dict[str, Any]]  # type: ignore[assignment]
    # the adapter's own, set by PGLossMixin.__init__
    algorithm: Algorithm
    _pgloss_top: float | None
    _pgloss_window: tuple[int, int, Step] | None
    _pgloss_steps: dict[str, StepMetrics]
    _pgloss_rewards_per_func: Tensor | None

    def _calculate_rewards(self, *args: Any, **kwargs: Any) -> Tensor:
        rewards_per_func = super()._calculate_rewards(*args, **kwargs)
        self._pgloss_rewards_per_func = rewards_per_func  # [rows over every process, reward functions]
        return rewards_per_func

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        self._pgloss_rewards_per_func = None
        out = super()._generate_and_score_completions(inputs)
        # Rows of one prompt are consecutive in the generation batch gathered over processes, and
        # each process holds an equal slice of it: the global row index // G is the prompt.
        rows = out["completion_ids"].shape[0]
        size = self.num_generations if self.model.training else self.num_generations_eval
        first = self.accelerator.process_index * rows
        out["group_ids"] = (first + torch.arange(rows, device=out["completion_ids"].device)) // size
        if self._pgloss_rewards_per_func is not None:  # the raw reward TRL logs as `reward`, this process's rows
            weights = self.reward_weights.to(self._pgloss_rewards_per_func.device)
            out["scores"] = (self._pgloss_rewards_per_func * weights).nansum(dim=1)[first : first + rows]
        return out

    @staticmethod
    def _pgloss_mask(inputs: dict[str, Any]) -> Tensor:
        mask = inputs["completion_mask"]
        return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]

    def _pgloss_forward(self, inputs: dict[str, Any]) -> tuple[Tensor, Tensor]:
        """The current log-probs and entropies of a micro-batch, without gradient (the model does not
        change within an optimizer step, so these are the values its loss call sees)."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with torch.no_grad():
            log_prob, entropy, _ = self._get_per_token_logps_and_entropies(
                self.model,
                ids,
                attention,
                inputs["completion_ids"].size(1),
                compute_entropy=True,
                **{key: inputs.get(key) for key in MULTIMODAL},
            )
        return log_prob.float(), entropy.float()

    def _pgloss_uses_rollout(self, inputs: dict[str, Any]) -> bool:
        """Whether the loss gets vLLM's log-probs: for the algorithm's rollout correction (TRL's vLLM
        importance sampling and off-policy mask), or for a family that folds them in itself (VESPO)."""
        if inputs.get("sampling_per_token_logps") is None:
            return False
        # The algorithm says what they do (`rollout_use`); TRL applies no weight unless asked, so they are
        # not passed where the algorithm would apply its implicit truncated IS.
        use = self.algorithm.rollout_use
        return use == "correction" or (
            use == "own weight" and self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _pgloss_old_and_rollout(
        self, inputs: dict[str, Any], log_prob: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        """(old log-probs, rollout log-probs or None), float32. Old: TRL's, else the detached current
        ones (`log_prob`, or a no-grad pass when not given). Rollout: NaN where vLLM could not score
        becomes the old log-prob (weight 1, as TRL's nan_to_num)."""
        old = inputs.get("old_per_token_logps")
        if old is None and log_prob is not None:
            old = log_prob.detach()
        rollout = inputs.get("sampling_per_token_logps") if self._pgloss_uses_rollout(inputs) else None
        if rollout is None:
            return None if old is None else old.float(), None
        old = (self._pgloss_forward(inputs)[0] if old is None else old).float()
        return old, torch.where(torch.isnan(rollout), old, rollout.float())

    def _pgloss_masks(self, batches: list[dict[str, Any]]) -> list[Tensor]:
        """The loss masks of a step's micro-batches: completion · tool mask, and with
        `top_entropy_quantile` < 1 the top-entropy mask over the step's tokens (`pgloss.correction.token_masks`;
        TRL takes the quantile per micro-batch, gathered over processes: a collective here too)."""
        masks = [self._pgloss_mask(batch) for batch in batches]
        if self._pgloss_top is None:
            return masks
        entropies = [self._pgloss_forward(batch)[1] for batch in batches]
        threshold = entropy_threshold(entropies, masks, top=self._pgloss_top)
        return [top_entropy_mask(e, m, threshold) for e, m in zip(entropies, masks, strict=True)]

    def _pgloss_micro_batches(self, batches: list[dict[str, Any]], masks: list[Tensor]) -> list[dict[str, Any]]:
        """The micro-batches as the loss call takes them, with what the step's count reads: the masks, the old
        and rollout log-probs (the latter where the loss gets them), the group ids and scores."""
        micro_batches: list[dict[str, Any]] = []
        for batch, mask in zip(batches, masks, strict=True):
            old, rollout = self._pgloss_old_and_rollout(batch, None)
            extra: dict[str, Any] = {k: batch[k] for k in ("group_ids", "scores") if k in self.algorithm.needs}
            micro_batches.append({"mask": mask, "old_log_prob": old, "rollout_log_prob": rollout, **extra})
        return micro_batches

    def _pgloss_step(self, inputs: dict[str, Any], algorithm: Algorithm) -> tuple[Step, Tensor]:
        """This micro-batch's `pgloss.Step` and its mask. Training: the optimizer step's, built (and counted,
        over its micro-batches on every process) at its first micro-batch: a collective, which every process
        reaches at the same micro-step (TRL's schedule is lock-step). Evaluation: the batch is its own step,
        counted on this process."""
        if not self.model.training:
            mask = self._pgloss_masks([inputs])[0]
            batches = self._pgloss_micro_batches([inputs], [mask])
            return Step(algorithm, batches, reduce=False, metrics=self._pgloss_metrics("eval")), mask
        step = self.state.global_step
        if self._pgloss_window is None or self._pgloss_window[0] != step:
            size = self.current_gradient_accumulation_steps
            per_generation = self.args.steps_per_generation
            assert per_generation is not None  # GRPOConfig.__post_init__ sets it (default: gradient_accumulation_steps)
            every = per_generation * self.num_iterations
            if any((self._step + j) % every == 0 for j in range(1, size)):
                raise ValueError(
                    f"optimizer step {step} spans two generations (steps_per_generation={per_generation}, "
                    f"num_iterations={self.num_iterations}, gradient_accumulation_steps={size})"
                )
            window = [self._buffered_inputs[(self._step + j) % per_generation] for j in range(size)]
            batches = self._pgloss_micro_batches(window, self._pgloss_masks(window))
            self._pgloss_window = (step, self._step, Step(algorithm, batches, metrics=self._pgloss_metrics("train")))
        _, first, counted = self._pgloss_window
        return counted, counted.micro_batches[self._step - first]["mask"]

    def _pgloss_metrics(self, mode: str) -> StepMetrics:
        """The metrics of the current step in `mode` (kept until logged: `PGLossMixin._pgloss_log`)."""
        return self._pgloss_steps.setdefault(mode, StepMetrics())
