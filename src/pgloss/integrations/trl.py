"""pgloss's losses inside TRL's GRPOTrainer (TRL 1.16).

    from .trl import PGLossGRPOTrainer          # was: from trl import GRPOTrainer
    trainer = PGLossGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                algorithm="dapo")                   # a name or a pgloss.Algorithm

TRL's generation, rewards, advantages, reference model, logging and checkpointing are unchanged;
only the loss is replaced, by `algorithm(...)` (or, with `fused=True`, `algorithm.from_hidden(...)`).
`PGLossMixin` does the same for a class that already subclasses GRPOTrainer:
`class MyTrainer(PGLossMixin, MyGRPOTrainer)`.

The loss is the one the config asks for: `algorithm=None` (the default) is `pgloss.from_trl(args)`,
TRL's `loss_type` with its options; a name or an Algorithm replaces it, with the TRL options the
caller set translated onto it (`pgloss.trainer_options.trl`, the one owner of that mapping).
`args=None` builds TRL's default GRPOConfig, as GRPOTrainer does.

Normalisation. For an optimizer step whose micro-batches over every process are W = {(r, j)}
(the step's `gradient_accumulation_steps` micro-batches, each on every process), the adapter
counts the step once, at its first micro-batch, with the algorithm's own rule
`algorithm.step_normalizer(masks, old_log_probs=, rollout_log_probs=, group_ids=)` over W (all-reduced
over processes: rejections, batch-normalised weights and group counts included), and every
micro-batch returns its exact share of the algorithm's loss on W:

    loss_{r,j} = world_size · Σ_{i,t} w_{i,t} ℓ_{i,t},     w from the mode and the counts of W,

never divided again by the accumulation steps or the number of processes (TRL and Accelerate do
not scale GRPO's loss; DDP/FSDP average over processes, which `world_size` cancels). The summed
gradient is that of one call on the whole window, for every loss_agg_mode.

Mapping of TRL's inputs: completion_mask (· tool_mask, · the top-entropy mask of
`top_entropy_quantile`, taken over the step's tokens) is the mask; `advantages` TRL's;
`old_per_token_logps` the old log-probs (absent on-policy: the detached current ones);
`ref_per_token_logps` the reference (TRL computes it iff `beta != 0`, so `beta` is set to the
algorithm's `kl_coef`, and the KL term is pgloss's); vLLM's `sampling_per_token_logps` the
rollout log-probs of the algorithm's rollout correction (TRL's vLLM importance sampling and
off-policy mask become one); group ids, global over processes, are added to each generation batch.
Options that cannot be honoured are refused by name. The step's metrics (`pgloss.StepMetrics` over its
micro-batches and processes) are logged once per optimizer step as `pgloss/<name>`.

`use_adaptive_entropy=True`: `pgloss.controllers.AdaptiveEntropy` (`pgloss.trainer_options.trl.adaptive_entropy`)
holds the coefficient. Every micro-batch of a step runs the algorithm with the coefficient it
applies this step (TRL's gate on the previous step's entropy), its entropy over the loss's mask is
added to the step's window, and at the optimizer-step boundary (`sync_gradients`) the window is
summed over processes and the coefficient moves, as TRL's `_compute_loss`. TRL's own
`entropy_coef` and `_last_world_entropy` follow the controller, so TRL's checkpoint file
(entropy_ctrl_state.json) saves and restores it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

import pgloss

from ..algorithms import Algorithm
from ..core.aggregate import Normalizer
from ..core.output import LossOutput
from ..correction.token_masks import entropy_threshold, top_entropy_mask
from ..trainer_options.trl import adaptive_entropy, trainer_algorithm
from .lm_head import head_options

__all__ = ["SUPPORTED", "PGLossGRPOTrainer", "PGLossMixin"]

SUPPORTED = (">=1.16", "<1.17")
"""The TRL releases this adapter is tested against (it overrides private GRPOTrainer methods)."""

_log = logging.getLogger(__name__)

try:
    import trl
    from packaging.specifiers import SpecifierSet
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import _ForwardRedirection
    from trl.trainer.utils import get_config_model_id, maybe_gather_lm_head_ctx
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError("pgloss.integrations.trl needs TRL: pip install -e '.[trl]' in a clone of pgloss") from error

if trl.__version__ not in SpecifierSet(",".join(SUPPORTED)):
    raise ImportError(f"pgloss.integrations.trl supports trl {','.join(SUPPORTED)}, found trl {trl.__version__}")

# Inputs TRL forwards to a vision-language model; the non-fused path passes them on unchanged.
_MULTIMODAL = (
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


_PASSED = frozenset({"ref_log_prob", "entropy", "rollout_log_prob", "group_ids", "scores"})
"""The optional inputs (core/inputs.py) the adapter gives the loss from GRPOTrainer's batch."""


def _refusals(args: Any) -> list[str]:
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


class PGLossMixin:
    """Replaces GRPOTrainer's loss by a pgloss `Algorithm`; put it before the trainer class in the bases.

    Args (keyword, besides the trainer's own):
        algorithm: None (default): `pgloss.from_trl(args)`, the loss TRL's config asks for; a name of
            `pgloss.names()` (built with `generation_budget=max_completion_length`, TRL's loss options
            set away from their defaults translated onto it); or a `pgloss.Algorithm`, as given.
        fused: compute the loss from the backbone's last hidden states and the LM head through
            `algorithm.from_hidden`, inside the wrapped model's forward, with the head's bias, logit scale
            and soft-cap as the model's forward applies them (`pgloss.integrations.lm_head`).
        chunk_size: tokens per chunk of the fused path (None: pgloss's default).

    What is translated and what is refused: `pgloss.trainer_options.trl.trainer_algorithm`.
    """

    def __init__(
        self,
        *args: Any,
        algorithm: str | Algorithm | None = None,
        fused: bool = False,
        chunk_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if config is None:  # what GRPOTrainer does without args
            model = kwargs.get("model", args[0] if args else None)
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            config = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"args must be a trl.GRPOConfig or None, got {type(config).__name__}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        algorithm = trainer_algorithm(config, algorithm)
        refused = _refusals(config)
        missing = sorted(algorithm.needs - _PASSED)
        if missing:  # e.g. on-policy distillation's teacher_log_prob: GRPOTrainer has no teacher
            refused.append(
                f"{algorithm.name}, which needs {', '.join(missing)} in each call (GRPOTrainer passes "
                f"{', '.join(sorted(_PASSED))})"
            )
        if refused:
            raise ValueError("PGLossGRPOTrainer cannot honour: " + "; ".join(refused))
        config = copy.copy(config)  # the caller's config stays as it was
        config.beta = algorithm.kl_coef  # TRL builds the reference model and its log-probs iff beta != 0
        if algorithm.kl_coef != 0 and config.use_bias_correction_kl and algorithm.kl_correction != "ratio_weighted":
            _log.warning(
                "%s: the KL term is pgloss's %s estimate (kl_coef=%s, kl_correction=%s). TRL's "
                "use_bias_correction_kl=True (its default) would multiply k3 by the importance ratio "
                "(kl_correction='ratio_weighted').",
                algorithm.name,
                algorithm.kl_estimator,
                algorithm.kl_coef,
                algorithm.kl_correction,
            )
        paper = pgloss.recipe(algorithm.name) if algorithm.name in pgloss.names() else pgloss.algorithms.Recipe()
        if paper.scale_rewards != (config.scale_rewards != "none"):
            _log.warning(
                "%s's paper %s the group advantages by their std; TRL's scale_rewards=%r is kept.",
                algorithm.name,
                "divides" if paper.scale_rewards else "does not divide",
                config.scale_rewards,
            )
        if paper.dynamic_sampling:
            _log.warning(
                "%s's paper drops groups whose rewards are all equal (dynamic sampling); TRL has no such "
                "option, so every group is kept.",
                algorithm.name,
            )
        if len(args) > 2:
            args = (*args[:2], config, *args[3:])
        else:
            kwargs["args"] = config
        self.algorithm = algorithm
        self.entropy_controller = adaptive_entropy(config)
        self.fused = fused
        self.chunk_size = chunk_size
        self._pgloss_top = config.top_entropy_quantile if config.top_entropy_quantile < 1 else None
        self._pgloss_window: tuple[int, int, Normalizer, list[Tensor]] | None = None
        self._pgloss_steps: dict[str, pgloss.StepMetrics] = {}  # the current step's metrics, by mode
        super().__init__(*args, **kwargs)
        if fused:
            self._check_fused_head()
        if getattr(type(algorithm), "couples_rows", False) and (
            config.gradient_accumulation_steps > 1 or self.accelerator.num_processes > 1
        ):
            _log.warning(
                "%s couples the rows of a call (a selection among its tokens, or a group contrast), and "
                "TRL's micro-batches do not hold whole groups: its loss is computed per micro-batch, as "
                "verl does, and is not the loss of the whole step.",
                algorithm.name,
            )

    # -- inputs ---------------------------------------------------------------------------------

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
                **{key: inputs.get(key) for key in _MULTIMODAL},
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
        rollout = inputs.get("sampling_per_token_logps") if self._pgloss_uses_rollout(inputs) else None
        if old is None and (log_prob is not None or rollout is not None):
            old = log_prob.detach() if log_prob is not None else self._pgloss_forward(inputs)[0]
        old = None if old is None else old.float()
        if rollout is not None:
            rollout = torch.where(torch.isnan(rollout), old, rollout.float())
        return old, rollout

    def _pgloss_masks(self, batches: list[dict[str, Any]]) -> list[Tensor]:
        """The loss masks of a step's micro-batches: completion · tool mask, and with
        `top_entropy_quantile` < 1 the top-entropy mask over the step's tokens (`pgloss.correction.token_masks`;
        TRL takes the quantile per micro-batch, gathered over processes: a collective here too)."""
        masks = [self._pgloss_mask(batch) for batch in batches]
        if self._pgloss_top is None:
            return masks
        entropies = [self._pgloss_forward(batch)[1] for batch in batches]
        threshold = entropy_threshold(entropies, masks, top=self._pgloss_top)
        return [top_entropy_mask(e, m, threshold) for e, m in zip(entropies, masks)]

    def _pgloss_count(self, batches: list[dict[str, Any]], masks: list[Tensor], *, reduce: bool = True) -> Normalizer:
        """The algorithm's counts of these micro-batches (a step), over every process (`reduce`)."""
        olds, rollouts = zip(*(self._pgloss_old_and_rollout(batch, None) for batch in batches))
        with_rollout = all(r is not None for r in rollouts)
        groups = [batch["group_ids"] for batch in batches] if "group_ids" in self.algorithm.needs else None
        scores = [batch["scores"] for batch in batches] if "scores" in self.algorithm.needs else None
        return self.algorithm.step_normalizer(
            masks,
            old_log_probs=list(olds) if with_rollout else None,
            rollout_log_probs=list(rollouts) if with_rollout else None,
            group_ids=groups,
            scores=scores,
            reduce=reduce,
        )

    def _pgloss_step(self) -> tuple[Normalizer, Tensor]:
        """This optimizer step's normalizer, counted once per step over its micro-batches on every
        process, and this micro-batch's mask. A collective: every process reaches it at the same
        micro-step (TRL's schedule is lock-step)."""
        step = self.state.global_step
        if self._pgloss_window is None or self._pgloss_window[0] != step:
            size = self.current_gradient_accumulation_steps
            per_generation, every = self.args.steps_per_generation, self.args.steps_per_generation * self.num_iterations
            if any((self._step + j) % every == 0 for j in range(1, size)):
                raise ValueError(
                    f"optimizer step {step} spans two generations (steps_per_generation={per_generation}, "
                    f"num_iterations={self.num_iterations}, gradient_accumulation_steps={size})"
                )
            window = [self._buffered_inputs[(self._step + j) % per_generation] for j in range(size)]
            masks = self._pgloss_masks(window)
            self._pgloss_window = (step, self._step, self._pgloss_count(window, masks), masks)
        _, first, normalizer, masks = self._pgloss_window
        return normalizer, masks[self._step - first]

    def _pgloss_arguments(self, inputs: dict[str, Any], log_prob: Tensor | None, mask: Tensor) -> dict[str, Any]:
        """Everything but the current log-probs: TRL's inputs under pgloss's names, in float32. On-policy without
        `log_prob` (the fused path) old_log_prob is None: the loss takes its own log π, detached."""
        old, rollout = self._pgloss_old_and_rollout(inputs, log_prob)
        ref = inputs.get("ref_per_token_logps") if "ref_log_prob" in self.algorithm.needs else None
        extra = {key: inputs[key] for key in ("group_ids", "scores") if key in self.algorithm.needs}
        return dict(
            old_log_prob=old,
            advantages=inputs["advantages"],
            mask=mask,
            ref_log_prob=None if ref is None else ref.float(),
            rollout_log_prob=rollout,
            **extra,
        )

    # -- the loss -------------------------------------------------------------------------------

    def _pgloss_algorithm(self) -> Algorithm:
        """The algorithm of this step: with adaptive entropy, the coefficient the controller applies."""
        if self.entropy_controller is None:
            return self.algorithm
        return self.entropy_controller.algorithm(self.algorithm)

    def _pgloss_entropy_step(self, mode: str, entropy: Tensor | None, mask: Tensor) -> None:
        """Adaptive entropy (train only, as TRL): add this micro-batch to the step's window; at the
        optimizer-step boundary move the coefficient from the step's entropy over every process."""
        controller = self.entropy_controller
        if controller is None or mode != "train":
            return
        if entropy is None:
            raise ValueError("use_adaptive_entropy needs the entropies of the loss's tokens")
        controller.observe(entropy, mask)
        if self.accelerator.sync_gradients:
            controller.step(device=mask.device)
            # TRL's attributes, which its _save_checkpoint / _load_optimizer_and_scheduler keep
            self.entropy_coef, self._last_world_entropy = controller.coef, controller.last_entropy

    def _load_optimizer_and_scheduler(self, checkpoint: Any) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)  # TRL restores entropy_coef and _last_world_entropy
        if self.entropy_controller is not None and checkpoint is not None:
            self.entropy_controller.load_state_dict(
                {"coef": self.entropy_coef, "last_entropy": self._last_world_entropy}
            )

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        training = self.model.training
        mode = "train" if training else "eval"
        if training:
            normalizer, mask = self._pgloss_step()
        else:  # eval: the batch is its own step
            mask = self._pgloss_masks([inputs])[0]
            normalizer = self._pgloss_count([inputs], [mask], reduce=False)
        algorithm = self._pgloss_algorithm()
        aux = None
        entropy = None
        if self.fused:
            out = self._pgloss_fused(model, inputs, normalizer, mask, algorithm)
        else:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            log_prob, entropy, aux = self._get_per_token_logps_and_entropies(
                model,
                ids,
                attention,
                inputs["completion_ids"].size(1),
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
                **{key: inputs.get(key) for key in _MULTIMODAL},
            )
            log_prob = log_prob.float()
            entropy = None if entropy is None else entropy.float()
            out = algorithm(
                log_prob=log_prob,
                entropy=entropy,
                normalizer=normalizer,
                **self._pgloss_arguments(inputs, log_prob, mask),
            )
        if self.fused and self.entropy_controller is not None and mode == "train":
            entropy = self._pgloss_forward(inputs)[1]  # the fused path keeps no [B, T] entropy outside its call
        loss = out.loss
        accumulation = self.current_gradient_accumulation_steps if training else 1
        if aux is not None and self.aux_loss_enabled:  # TRL's own convention for the MoE router loss
            loss = loss + self.router_aux_loss_coef * aux / accumulation
        self._pgloss_entropy_step(mode, entropy, mask)
        self._pgloss_log(mode, out, algorithm)
        return loss

    def _pgloss_log(self, mode: str, out: LossOutput, algorithm: Algorithm) -> None:
        """The step's metrics, logged as `pgloss/<name>` once per optimizer step (in evaluation, once per
        batch): each micro-batch's are added to a `pgloss.StepMetrics`, which at the step's last micro-batch
        (`sync_gradients`) combines them over the step's micro-batches and processes (a mean over the step's
        tokens; `pg_loss` and `kl_loss` the step's loss terms) in two collectives and one host sync."""
        step = self._pgloss_steps.setdefault(mode, pgloss.StepMetrics())
        step.add(out)
        if mode == "train" and not self.accelerator.sync_gradients:
            return
        logged = step.as_floats()
        step.reset()
        for k, value in logged.items():
            self._metrics[mode][f"pgloss/{k}"].append(value)
        # TRL's own names, where TRL logs them: the mean entropy; with an entropy bonus, the loss before
        # the bonus (policy and KL terms) and the coefficient at each optimizer step.
        if "entropy" in logged:
            self._metrics[mode]["entropy"].append(logged["entropy"])
        if algorithm.entropy_coef != 0 or self.entropy_controller is not None:
            policy = logged["pg_loss"] + algorithm.kl_coef * logged.get("kl_loss", 0.0)
            self._metrics[mode]["policy_loss"].append(policy)
            if mode == "train":  # adaptive: the coefficient after the update
                coef = algorithm.entropy_coef if self.entropy_controller is None else self.entropy_controller.coef
                self._metrics[mode]["entropy_coef"].append(coef)

    # -- the fused path -------------------------------------------------------------------------

    def _pgloss_head_owner(self, unwrapped: torch.nn.Module) -> torch.nn.Module:
        from accelerate.utils import is_peft_model

        return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped

    def _check_fused_head(self) -> None:
        """Refuse, at construction, a head whose options `lm_head.head_options` cannot read."""
        head_options(self._pgloss_head_owner(self.model))

    def _pgloss_fused(
        self, model: torch.nn.Module, inputs: dict[str, Any], normalizer: Normalizer, mask: Tensor, algorithm: Algorithm
    ):
        present = [key for key in _MULTIMODAL if inputs.get(key) is not None]
        if present:
            raise ValueError(f"fused=True supports text-only models; these inputs need fused=False: {present}")
        unwrapped = self.accelerator.unwrap_model(model)
        # The loss must run inside the wrapper's forward: called beside it, DDP/FSDP/ZeRO-3 hooks do not
        # fire and the gradient is silently wrong (TRL's Liger integration did the same).
        return _ForwardRedirection()(
            model, unwrapped, self._pgloss_fused_loss, unwrapped, inputs, normalizer, mask, algorithm
        )

    def _pgloss_fused_loss(
        self,
        unwrapped: torch.nn.Module,
        inputs: dict[str, Any],
        normalizer: Normalizer,
        mask: Tensor,
        algorithm: Algorithm,
    ) -> LossOutput:
        owner = self._pgloss_head_owner(unwrapped)
        targets = inputs["completion_ids"]
        length = targets.size(1)
        ids = torch.cat([inputs["prompt_ids"], targets], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        hidden = owner.base_model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
        hidden = hidden[:, -length - 1 : -1]  # the positions that predict the completion tokens
        weight = owner.get_output_embeddings().weight
        head = head_options(owner)  # the bias, logit scale and soft-cap of the model's own logits
        # FSDP2: the whole head, its gradient averaged back onto the shards
        weight, bias = pgloss.vocab.fused.full_head(weight), pgloss.vocab.fused.full_head(head.bias)
        if self.args.cast_lm_head_to_fp32:
            hidden, weight, bias = hidden.float(), weight.float(), None if bias is None else bias.float()
        head = dataclasses.replace(head, bias=bias)
        params = [p for p in (weight, bias) if isinstance(p, torch.nn.Parameter)]
        with maybe_gather_lm_head_ctx(*params) if params else nullcontext():
            self._pgloss_check_zero3(weight, length)
            # On-policy (no old_per_token_logps) the loss takes log π_old as the detached log π of its own pass
            # (old_log_prob=None). With vLLM's log-probs, those it could not score take log π_old before the
            # loss (`_pgloss_old_and_rollout`): one no-grad pass over the head gives it.
            log_prob = None
            if inputs.get("old_per_token_logps") is None and self._pgloss_uses_rollout(inputs):
                with torch.no_grad():
                    log_prob, _ = pgloss.log_prob_and_entropy_from_hidden(
                        hidden,
                        weight,
                        torch.where(mask.bool(), targets, 0),
                        temperature=self.temperature,
                        chunk_size=self.chunk_size,
                        head=head,
                    )
            return algorithm.from_hidden(
                hidden,
                weight,
                targets,
                temperature=self.temperature,
                normalizer=normalizer,
                chunk_size=self.chunk_size,
                head=head,
                **self._pgloss_arguments(inputs, log_prob, mask),
            )

    def _pgloss_check_zero3(self, weight: Tensor, length: int) -> None:
        """Under ZeRO-3 the head is gathered for the forward only: the one-pass path (whole sequences in
        a chunk, gradients formed in the forward) is required."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        from ..vocab.entropy import check_chunk_size

        if is_deepspeed_zero3_enabled() and length > check_chunk_size(self.chunk_size, weight.shape[0]):
            raise ValueError(f"fused=True under ZeRO-3 needs chunk_size >= the completion length {length}")


class PGLossGRPOTrainer(PGLossMixin, GRPOTrainer):
    """TRL's GRPOTrainer with a pgloss algorithm's loss: `PGLossGRPOTrainer(..., algorithm=, fused=)`."""
