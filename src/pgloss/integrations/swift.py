"""pgloss's losses inside ms-swift's GRPOTrainer (ms-swift 4.6.0, on its own TRL 0.29).

From the command line, the plugin file shipped with pgloss (`pgloss swift-plugin` prints its path) swaps ms-swift's
GRPO trainer for `PGLossSwiftGRPOTrainer`, and `--loss_type` names the loss:

    swift rlhf --rlhf_type grpo --external_plugins "$(pgloss swift-plugin)" \
        --loss_type 'pgloss:clip_cov,clip_cov_ratio=0.001' ...      # or ms-swift's own grpo, dapo, ...

From Python, the trainer class takes `algorithm=` (a name or a `pgloss.Algorithm`), as TRL's adapter does;
`install()` is what the plugin file calls (ms-swift's `TrainerFactory` then builds this class for grpo).

ms-swift's rollout, rewards, advantages (RLOO, REINFORCE++, GDPO, ...), dynamic sampling, reference model and
logging are unchanged; the loss of `GRPOTrainer._compute_loss_and_metrics` is replaced by a `pgloss.Step` call. The
algorithm is `pgloss.trainer_options.swift.swift_algorithm(args, algorithm)`, the one owner of the option map
(ms-swift's `loss_type`, clip, KL, ratio level and rollout-correction arguments; refused by name what pgloss cannot
honour).

Normalisation. At the first micro-batch of an optimizer step the adapter builds the step's `pgloss.Step` from the
buffered micro-batches of that step (ms-swift's `_buffered_inputs`, `steps_per_generation` of them per generation):
their masks, old and rollout log-probs and group ids, counted once over every process (`Algorithm.count_step`).
Each micro-batch's loss is then its exact share of the algorithm's loss on the step, times the accumulation steps
that transformers' `Trainer.training_step` divides it by: the step's summed gradient is that of one call on all its
micro-batches, for every name and loss_agg_mode.

Teacher (ms-swift's OPD-RL, RLSD and SDAR: `teacher_model`, `teacher_model_server` or self-distillation's
`teacher_prompt`): ms-swift's `teacher_per_token_logps` (the sampled tokens' log-probs under the teacher) are the
call's `teacher_log_prob` where the algorithm needs them (`sdar_loss_coef` > 0: SDAR's term, a distillation name);
OPD-RL's teacher_kl_coef·(log π_T - log π_old) and RLSD's reweighting are in ms-swift's per-token advantages,
passed as they are.

Inputs: the mask is `completion_mask` (without the truncated rows with `overlong_filter`; with
`top_entropy_quantile < 1`, the top-entropy tokens of the step, `pgloss.correction.token_masks`); `advantages`,
`old_per_token_logps`, `ref_per_token_logps` (computed by ms-swift iff `beta != 0`, so `beta` is the algorithm's
`kl_coef`) and `rollout_per_token_logps` (vLLM's) are ms-swift's `GRPOBatch` fields; group ids number ms-swift's
`prompt_id`s over every process. The step's `pgloss.StepMetrics` are logged once per optimizer step as
`pgloss/<name>`.

Not covered: ms-swift's Megatron trainer (`megatron rlhf`), sequence parallelism, Liger's loss, the multi-turn
chunked loss (`_compute_loss_chunked`, refused when it runs) and the fused path with `padding_free`.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import Tensor

from ..algorithms import Algorithm
from ..core.step_metrics import StepMetrics
from ..correction.token_masks import entropy_threshold, top_entropy_mask
from ..step import Step
from ..trainer_options.swift import counts_rejected, swift_algorithm
from .lm_head import head_options

__all__ = ["SUPPORTED", "PGLossSwiftGRPOTrainer", "PGLossSwiftMixin", "install"]

SUPPORTED = (">=4.6,<4.7",)
"""The ms-swift releases this adapter is tested against (it overrides GRPOTrainer's private loss methods)."""

_log = logging.getLogger(__name__)

try:
    import swift
    from accelerate.utils import gather_object
    from packaging.specifiers import SpecifierSet
    from swift.rlhf_trainers.grpo_trainer import GRPOTrainer
    from swift.rlhf_trainers.utils import get_even_process_data
    from swift.trainers.trainer_factory import TrainerFactory
    from transformers import PreTrainedModel
    from trl.models.utils import _ForwardRedirection
except ImportError as error:  # pragma: no cover - exercised without ms-swift
    raise ImportError("pgloss.integrations.swift needs ms-swift: pip install 'ms-swift>=4.6,<4.7' msgspec") from error

if swift.__version__ not in SpecifierSet(",".join(SUPPORTED)):
    raise ImportError(f"pgloss.integrations.swift supports ms-swift {SUPPORTED[0]}, found {swift.__version__}")

_PASSED = frozenset({"ref_log_prob", "entropy", "rollout_log_prob", "group_ids", "scores", "teacher_log_prob"})
"""The optional inputs (core/inputs.py) the adapter gives the loss from ms-swift's GRPOBatch."""

TRAINER = "pgloss.integrations.swift.PGLossSwiftGRPOTrainer"


def install() -> None:
    """Make ms-swift's `rlhf_type=grpo` build `PGLossSwiftGRPOTrainer` (what the plugin file does)."""
    TrainerFactory.TRAINER_MAPPING["grpo"] = TRAINER


class PGLossSwiftMixin:
    """Replaces ms-swift GRPOTrainer's loss by a pgloss `Algorithm`; put it before the trainer class in the bases.

    Args (keyword, besides the trainer's own):
        algorithm: None (default): from `args.loss_type` (ms-swift's own, or `pgloss:<name>[,field=value,...]`);
            a name of `pgloss.names()`; or a `pgloss.Algorithm`, as given (`swift_algorithm`).
        fused: the loss from the backbone's last hidden states and the LM head (`algorithm.from_hidden`), inside
            the wrapped model's forward, as ms-swift's Liger path.
        chunk_size: tokens per chunk of the fused path (None: pgloss's default).
    """

    # ms-swift's, as the mixin finds them (it is never used without a GRPOTrainer after it)
    args: Any
    model: torch.nn.Module
    accelerator: Any
    state: Any
    template: Any
    temperature: float
    num_iterations: int
    current_gradient_accumulation_steps: int
    _step: int
    _buffered_inputs: list[dict[str, Any]]
    _metrics: dict[str, Any]

    def __init__(
        self,
        *args: Any,
        algorithm: str | Algorithm | None = None,
        fused: bool = False,
        chunk_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        config = kwargs.get("args")
        if config is None:
            raise TypeError("PGLossSwiftGRPOTrainer needs args= (ms-swift's GRPOConfig)")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        algorithm = swift_algorithm(config, algorithm)
        refused = []
        missing = sorted(algorithm.needs - _PASSED)
        if missing:  # an input ms-swift's GRPOBatch does not hold
            refused.append(f"{algorithm.name}, which needs {', '.join(missing)} (the adapter passes {sorted(_PASSED)})")
        in_reward = bool(getattr(config, "kl_in_reward", False))
        if "ref_log_prob" in type(algorithm).required_inputs and algorithm.kl_coef == 0 and not in_reward:
            refused.append(f"{algorithm.name}, which needs ref_log_prob with kl_coef = 0 (ms-swift needs beta != 0)")
        if fused and getattr(config, "padding_free", False):
            refused.append("fused=True with padding_free (the fused path takes [B, T] hidden states)")
        if refused:
            raise ValueError("pgloss's ms-swift adapter cannot honour: " + "; ".join(refused))
        if algorithm.kl_coef != 0 and not in_reward and config.beta != algorithm.kl_coef:
            if config.beta == 0:
                raise ValueError(
                    f"{algorithm.name} with kl_coef={algorithm.kl_coef}: set ms-swift's beta (it builds the reference "
                    "model and its log-probs iff beta != 0)"
                )
            config = copy.copy(config)
            config.beta = algorithm.kl_coef
            kwargs["args"] = config
        self.algorithm = algorithm
        self.fused = fused
        self.chunk_size = chunk_size
        self._pgloss_count_rejected = counts_rejected(config)
        self._pgloss_window: tuple[int, int, Step] | None = None
        self._pgloss_steps: dict[str, StepMetrics] = {}
        super().__init__(*args, **kwargs)
        if fused:
            head_options(self._pgloss_head_owner(self.model))

    # -- the step's inputs -------------------------------------------------------------------------

    def _postprocess_batch(self, samples: list[Any], batch_encoded_inputs: list[dict[str, Any]]) -> None:
        super()._postprocess_batch(samples, batch_encoded_inputs)  # type: ignore[misc]
        # Group ids as ms-swift's advantages group the generation batch gathered over every process: consecutive
        # blocks of num_generations rows, or (multi-turn, `dynamic_num_samples`) the rows of one prompt_id.
        # Scores: the weighted sum of the reward functions (ms-swift's `reward`), this process's rows.
        rewards = self._rewards_per_func  # type: ignore[attr-defined]
        rows = get_even_process_data(self, torch.arange(rewards.shape[0], device=rewards.device))
        size = self.num_generations if self.model.training else self.num_generations_eval  # type: ignore[attr-defined]
        if getattr(self, "dynamic_num_samples", False):
            prompts = gather_object([sample.prompt_id for sample in samples])
            number = {prompt: i for i, prompt in enumerate(dict.fromkeys(prompts))}
            groups = [number[sample.prompt_id] for sample in samples]
        else:
            groups = [int(row) // size for row in rows]
        weights = self.reward_weights.to(rewards.device).unsqueeze(0)  # type: ignore[attr-defined]
        scores = get_even_process_data(self, (rewards * weights).nansum(dim=1))
        group = {id(sample): value for sample, value in zip(samples, groups, strict=True)}
        score = {id(sample): value for sample, value in zip(samples, scores, strict=True)}
        chunks = self.split_by_mini_batches(samples)  # type: ignore[attr-defined]
        for chunk, encoded in zip(chunks, batch_encoded_inputs, strict=True):
            batch = encoded["grpo_batch"]
            device = batch.completion_mask.device
            batch.pgloss_group_ids = torch.tensor([group[id(sample)] for sample in chunk], device=device)
            batch.pgloss_scores = torch.stack([score[id(sample)] for sample in chunk]).float().to(device)

    def _pgloss_mask(self, batch: Any) -> Tensor:
        mask = batch.completion_mask.bool()
        if self.args.overlong_filter:
            mask = mask & ~batch.truncated_mask.bool()[:, None]
        return mask.float()

    def _pgloss_forward(self, model_inputs: dict[str, Any], batch: Any) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            log_prob, entropy = self._get_per_token_logps_and_entropies(  # type: ignore[attr-defined]
                self.model, model_inputs, batch, compute_entropy=True
            )
        return log_prob.float(), entropy.float()

    def _pgloss_masks(self, micro: list[dict[str, Any]]) -> list[Tensor]:
        masks = [self._pgloss_mask(m["grpo_batch"]) for m in micro]
        top = self.args.top_entropy_quantile
        if top >= 1:
            return masks
        entropies = [self._pgloss_forward(m["model_inputs"], m["grpo_batch"])[1] for m in micro]
        threshold = entropy_threshold(entropies, masks, top=top)
        return [top_entropy_mask(e, m, threshold) for e, m in zip(entropies, masks, strict=True)]

    def _pgloss_rollout(self, batch: Any) -> Tensor | None:
        rollout = batch.rollout_per_token_logps
        if rollout is None:
            return None
        use = self.algorithm.rollout_use
        if use == "correction" or (use == "own weight" and self.args.rollout_importance_sampling_mode is not None):
            return rollout.float()
        return None

    def _pgloss_inputs(self, batch: Any, mask: Tensor) -> dict[str, Any]:
        """A micro-batch's call arguments besides the current log-probs, under pgloss's names."""
        ref = batch.ref_per_token_logps if "ref_log_prob" in self.algorithm.needs else None
        needs = self.algorithm.needs
        extra: dict[str, Any] = {
            key: getattr(batch, f"pgloss_{key}", None) for key in ("group_ids", "scores") if key in needs
        }
        if "teacher_log_prob" in needs:
            teacher = batch.teacher_per_token_logps
            if teacher is None:  # ms-swift's own loss would skip SDAR here: say so rather than drop the term
                why = f"sdar_coef={self.algorithm.sdar_coef}" if self.algorithm.sdar_coef else "its distillation loss"
                raise ValueError(
                    f"{self.algorithm.name} needs teacher_log_prob ({why}) and ms-swift computed no teacher "
                    "log-probs for this batch: set teacher_model or teacher_model_server, or give the dataset a "
                    "teacher_prompt column (self-distillation)"
                )
            extra["teacher_log_prob"] = teacher.float()
        inputs = dict(
            old_log_prob=None if batch.old_per_token_logps is None else batch.old_per_token_logps.float(),
            advantages=batch.advantages.float(),
            mask=mask,
            ref_log_prob=None if ref is None else ref.float(),
            rollout_log_prob=self._pgloss_rollout(batch),
        )
        return inputs | {key: value for key, value in extra.items() if value is not None}

    def _pgloss_step(self, model_inputs: dict[str, Any], batch: Any) -> tuple[Step, Tensor]:
        """This micro-batch's `pgloss.Step` and mask: in training the optimizer step's, counted at its first
        micro-batch over every process (a collective, reached in lock-step); in evaluation the batch's own."""
        if not self.model.training:
            mask = self._pgloss_masks([{"model_inputs": model_inputs, "grpo_batch": batch}])[0]
            return Step(
                self.algorithm, [self._pgloss_inputs(batch, mask)], reduce=False, metrics=self._metrics_of("eval")
            ), mask
        number = self.state.global_step
        if self._pgloss_window is None or self._pgloss_window[0] != number:
            size = self.current_gradient_accumulation_steps
            per_generation = self.args.steps_per_generation
            every = per_generation * self.num_iterations
            if any((self._step + j) % every == 0 for j in range(1, size)):
                raise ValueError(
                    f"optimizer step {number} spans two generations (steps_per_generation={per_generation}, "
                    f"num_iterations={self.num_iterations}, gradient_accumulation_steps={size})"
                )
            micro = [self._buffered_inputs[(self._step + j) % per_generation] for j in range(size)]
            masks = self._pgloss_masks(micro)
            calls = [self._pgloss_inputs(m["grpo_batch"], mask) for m, mask in zip(micro, masks, strict=True)]
            step = Step(
                self.algorithm, calls, count_rejected=self._pgloss_count_rejected, metrics=self._metrics_of("train")
            )
            self._pgloss_window = (number, self._step, step)
        _, first, step = self._pgloss_window
        return step, step.micro_batches[self._step - first]["mask"]

    def _metrics_of(self, mode: str) -> StepMetrics:
        return self._pgloss_steps.setdefault(mode, StepMetrics())

    # -- the loss ----------------------------------------------------------------------------------

    def _compute_loss_and_metrics(self, model: torch.nn.Module, model_inputs: dict[str, Any], grpo_batch: Any):
        """ms-swift's hook: (the loss, the metrics its `_update_metrics` reads)."""
        mode = "train" if self.model.training else "eval"
        step, mask = self._pgloss_step(model_inputs, grpo_batch)
        inputs = self._pgloss_inputs(grpo_batch, mask)
        if self.fused:
            out = self._pgloss_fused(model, model_inputs, grpo_batch, step, inputs)
        else:
            log_prob, entropy = self._get_per_token_logps_and_entropies(  # type: ignore[attr-defined]
                model, model_inputs, grpo_batch, compute_entropy=True
            )
            out = step(log_prob=log_prob.float(), entropy=entropy.float(), **inputs)
        loss = out.loss * self._pgloss_undo_accumulation(mode)
        last = mode == "eval" or self._step - self._pgloss_window[1] == self.current_gradient_accumulation_steps - 1  # type: ignore[index]
        if last:
            metrics = self._metrics_of(mode)
            for key, value in metrics.as_floats().items():
                self._metrics[mode][f"pgloss/{key}"].append(value)
            metrics.reset()
        return loss, {"mode": mode, "entropy": {}, "completion_mask": mask, "completion_token_count": mask.sum()}

    def _pgloss_undo_accumulation(self, mode: str) -> float:
        """transformers' `Trainer.training_step` divides the loss by the accumulation steps unless it says the loss
        is scaled for them; pgloss's share is the step's already."""
        if mode != "train":
            return 1.0
        scaled = getattr(self, "loss_is_scaled_for_ga", None)
        if scaled is None:
            scaled = getattr(self, "compute_loss_func", None) is not None
        return 1.0 if scaled else float(self.current_gradient_accumulation_steps)

    def _compute_loss_chunked(self, *args: Any, **kwargs: Any) -> Tensor:
        raise ValueError(
            "pgloss's ms-swift adapter cannot honour ms-swift's chunked loss (a micro-batch larger than "
            "per_device_train_batch_size, from a multi-turn rollout): its chunks are averaged, not counted"
        )

    # -- the fused path ----------------------------------------------------------------------------

    def _pgloss_head_owner(self, unwrapped: torch.nn.Module) -> PreTrainedModel:
        """The transformers model whose backbone and LM head the fused path calls (under PEFT, its base model)."""
        from accelerate.utils import is_peft_model

        owner = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped  # type: ignore[operator]
        if not isinstance(owner, PreTrainedModel):
            raise TypeError(f"fused=True needs a transformers PreTrainedModel, got {type(owner).__name__}")
        return owner

    def _pgloss_fused(self, model: torch.nn.Module, model_inputs: dict[str, Any], batch: Any, step: Step, inputs: dict):
        unwrapped = self.accelerator.unwrap_model(model)

        def loss(*_: Any, **__: Any) -> Any:
            owner = self._pgloss_head_owner(unwrapped)
            length = batch.logits_to_keep
            hidden = self._get_last_hidden_state(unwrapped, model_inputs, length)  # type: ignore[attr-defined]
            targets = model_inputs["input_ids"][:, -length:]
            call = dict(inputs)
            if call["old_log_prob"] is None:
                call.pop("old_log_prob")
            return step.from_hidden(
                hidden,
                owner.get_output_embeddings().weight,
                targets,
                temperature=self.temperature,
                chunk_size=self.chunk_size,
                head=head_options(owner),
                **call,
            )

        # inside the wrapper's forward, as ms-swift's Liger path: DDP's hooks fire
        return _ForwardRedirection()(model, unwrapped, loss, **model_inputs)


class PGLossSwiftGRPOTrainer(PGLossSwiftMixin, GRPOTrainer):
    """ms-swift's GRPOTrainer with a pgloss algorithm's loss: `PGLossSwiftGRPOTrainer(..., algorithm=, fused=)`."""
