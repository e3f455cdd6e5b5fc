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
builds the step's `pgloss.Step` at its first micro-batch from the buffered micro-batches (their masks, old
and rollout log-probs, group ids): it counts W once with the algorithm's own rule (`Algorithm.count_step`,
all-reduced over processes: rejections, batch-normalised weights and group counts included), and every
micro-batch's call through it returns its exact share of the algorithm's loss on W:

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
from ..core.output import LossOutput
from ..step import Step
from ..trainer_options.trl import adaptive_entropy
from ..trainer_options.trl_trainer import reference_model_refusal, trainer_algorithm
from .lm_head import head_options
from .trl_inputs import MULTIMODAL, TRLInputs, schedule_refusals

__all__ = ["SUPPORTED", "PGLossGRPOTrainer", "PGLossMixin"]

SUPPORTED = (">=1.16", "<1.17")
"""The TRL releases this adapter is tested against (it overrides private GRPOTrainer methods)."""

_log = logging.getLogger(__name__)

try:
    import trl
    from packaging.specifiers import SpecifierSet
    from transformers import PreTrainedModel
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import _ForwardRedirection
    from trl.trainer.utils import get_config_model_id, maybe_gather_lm_head_ctx
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError("pgloss.integrations.trl needs TRL: pip install -e '.[trl]' in a clone of pgloss") from error

if trl.__version__ not in SpecifierSet(",".join(SUPPORTED)):
    raise ImportError(f"pgloss.integrations.trl supports trl {','.join(SUPPORTED)}, found trl {trl.__version__}")


_PASSED = frozenset({"ref_log_prob", "entropy", "rollout_log_prob", "group_ids", "scores"})
"""The optional inputs (core/inputs.py) the adapter gives the loss from GRPOTrainer's batch."""


class PGLossMixin(TRLInputs):
    """Replaces GRPOTrainer's loss by a pgloss `Algorithm`; put it before the trainer class in the bases.

    Args (keyword, besides the trainer's own):
        algorithm: None (default): `pgloss.from_trl(args)`, the loss TRL's config asks for; a name of
            `pgloss.names()` (built with `generation_budget=max_completion_length`, TRL's loss options
            set away from their defaults translated onto it); or a `pgloss.Algorithm`, as given.
        fused: compute the loss from the backbone's last hidden states and the LM head through
            `algorithm.from_hidden`, inside the wrapped model's forward, with the head's bias, logit scale
            and soft-cap as the model's forward applies them (`pgloss.integrations.lm_head`).
        chunk_size: tokens per chunk of the fused path (None: pgloss's default).

    What is translated and what is refused: `pgloss.trainer_options.trl_trainer.trainer_algorithm`.
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
            if model is None:
                raise TypeError("PGLossGRPOTrainer needs model= (a model id or a transformers PreTrainedModel)")
            name = model if isinstance(model, str) else get_config_model_id(model.config)
            config = GRPOConfig(f"{name.split('/')[-1]}-GRPO")
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"args must be a trl.GRPOConfig or None, got {type(config).__name__}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        algorithm = trainer_algorithm(config, algorithm)
        refused = schedule_refusals(config)
        no_reference = reference_model_refusal(kwargs.get("model", args[0] if args else None), algorithm)
        if no_reference:
            refused.append(no_reference)
        missing = sorted(algorithm.needs - _PASSED)
        if missing:  # e.g. on-policy distillation's teacher_log_prob: GRPOTrainer has no teacher
            refused.append(
                f"{algorithm.name}, which needs {', '.join(missing)} in each call (GRPOTrainer passes "
                f"{', '.join(sorted(_PASSED))})"
            )
        if "ref_log_prob" in type(algorithm).required_inputs and algorithm.kl_coef == 0:  # A*-PO
            refused.append(
                f"{algorithm.name}, which needs ref_log_prob with kl_coef = 0 (GRPOTrainer computes the reference "
                "log-probs only when beta != 0)"
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
        self._pgloss_window: tuple[int, int, Step] | None = None  # (optimizer step, its first micro-step, Step)
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

    def _pgloss_arguments(self, inputs: dict[str, Any], log_prob: Tensor | None, mask: Tensor) -> dict[str, Any]:
        """Everything but the current log-probs: TRL's inputs under pgloss's names, in float32. On-policy without
        `log_prob` (the fused path) old_log_prob is None: the loss takes its own log π, detached."""
        old, rollout = self._pgloss_old_and_rollout(inputs, log_prob)
        ref = inputs.get("ref_per_token_logps") if "ref_log_prob" in self.algorithm.needs else None
        extra: dict[str, Tensor] = {key: inputs[key] for key in ("group_ids", "scores") if key in self.algorithm.needs}
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
        mode = "train" if self.model.training else "eval"
        step, mask = self._pgloss_step(inputs, self._pgloss_algorithm())
        aux = None
        entropy = None
        if self.fused:
            out = self._pgloss_fused(model, inputs, step, mask)
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
                **{key: inputs.get(key) for key in MULTIMODAL},
            )
            log_prob = log_prob.float()
            entropy = None if entropy is None else entropy.float()
            out = step(log_prob=log_prob, entropy=entropy, **self._pgloss_arguments(inputs, log_prob, mask))
        if self.fused and self.entropy_controller is not None and mode == "train":
            entropy = self._pgloss_forward(inputs)[1]  # the fused path keeps no [B, T] entropy outside its call
        loss = out.loss
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if aux is not None and self.aux_loss_enabled:  # TRL's own convention for the MoE router loss
            loss = loss + self.router_aux_loss_coef * aux / accumulation
        self._pgloss_entropy_step(mode, entropy, mask)
        self._pgloss_log(mode, step.algorithm)
        return loss

    def _pgloss_log(self, mode: str, algorithm: Algorithm) -> None:
        """The step's metrics, logged as `pgloss/<name>` once per optimizer step (in evaluation, once per
        batch): the `pgloss.Step` adds each micro-batch's to the mode's `pgloss.StepMetrics`, which at the
        step's last micro-batch (`sync_gradients`) combines them over the step's micro-batches and processes
        (a mean over the step's tokens; `pg_loss` and `kl_loss` the step's loss terms) in two collectives and
        one host sync."""
        if mode == "train" and not self.accelerator.sync_gradients:
            return
        metrics = self._pgloss_metrics(mode)
        logged = metrics.as_floats()
        metrics.reset()
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

    def _pgloss_head_owner(self, unwrapped: torch.nn.Module) -> PreTrainedModel:
        """The transformers model whose backbone and LM head the fused path calls (under PEFT, its base model)."""
        from accelerate.utils import is_peft_model

        # PEFT is optional and untyped here: mypy reads PeftModel.get_base_model through nn.Module.__getattr__
        owner = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped  # type: ignore[operator]
        if not isinstance(owner, PreTrainedModel):
            raise TypeError(f"fused=True needs a transformers PreTrainedModel, got {type(owner).__name__}")
        return owner

    def _check_fused_head(self) -> None:
        """Refuse, at construction, a head whose options `lm_head.head_options` cannot read."""
        head_options(self._pgloss_head_owner(self.model))

    def _pgloss_fused(self, model: torch.nn.Module, inputs: dict[str, Any], step: Step, mask: Tensor) -> LossOutput:
        present = [key for key in MULTIMODAL if inputs.get(key) is not None]
        if present:
            raise ValueError(f"fused=True supports text-only models; these inputs need fused=False: {present}")
        unwrapped = self.accelerator.unwrap_model(model)
        # The loss must run inside the wrapper's forward: called beside it, DDP/FSDP/ZeRO-3 hooks do not
        # fire and the gradient is silently wrong (TRL's Liger integration did the same).
        return _ForwardRedirection()(model, unwrapped, self._pgloss_fused_loss, unwrapped, inputs, step, mask)

    def _pgloss_fused_loss(
        self,
        unwrapped: torch.nn.Module,
        inputs: dict[str, Any],
        step: Step,
        mask: Tensor,
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
            return step.from_hidden(
                hidden,
                weight,
                targets,
                temperature=self.temperature,
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
