"""pgloss's losses inside TRL's GRPOTrainer (TRL 1.16).

    from pgloss.integrations.trl import PGLossGRPOTrainer          # was: from trl import GRPOTrainer
    trainer = PGLossGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...,
                                algorithm="dapo")                   # a name or a pgloss.Algorithm

TRL's generation, rewards, advantages, reference model, logging and checkpointing are unchanged;
only the loss is replaced, by `algorithm(...)` (or, with `fused=True`, `algorithm.from_hidden(...)`).
`PGLossMixin` does the same for a class that already subclasses GRPOTrainer:
`class MyTrainer(PGLossMixin, MyGRPOTrainer)`.

Normalisation. For an optimizer step whose micro-batches over every process are W = {(r, j)}
(the step's `gradient_accumulation_steps` micro-batches, each on every process), the adapter
counts one `pgloss.Normalizer` over the masks of W (all-reduced over processes) at the step's
first micro-batch, and every micro-batch returns its exact share of the algorithm's loss on W:

    loss_{r,j} = world_size · Σ_{i,t} w_{i,t} ℓ_{i,t},     w from the mode and the counts of W,

never divided again by the accumulation steps or the number of processes (TRL and Accelerate do
not scale GRPO's loss; DDP/FSDP average over processes, which `world_size` cancels). The summed
gradient is that of one call on the whole window, for every loss_agg_mode.

Mapping of TRL's inputs: completion_mask (· tool_mask) is the mask; `advantages` TRL's;
`old_per_token_logps` the old log-probs (absent on-policy: the detached current ones);
`ref_per_token_logps` the reference (TRL computes it iff `beta != 0`, so `beta` is set to the
algorithm's `kl_coef`, and the KL term is pgloss's); vLLM's `sampling_per_token_logps` the
rollout log-probs (token-truncated importance sampling only); group ids, global over processes,
are added to each generation batch for `group-mean-token-mean`. Options that cannot be honoured
are refused by name (see `PGLossMixin.__init__`). Metrics are logged as `pgloss/<name>`.
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
from pgloss.aggregate import Normalizer
from pgloss.algorithms import Algorithm, LossOutput
from pgloss.rollout import RolloutCorrection

__all__ = ["SUPPORTED", "PGLossGRPOTrainer", "PGLossMixin"]

SUPPORTED = (">=1.16", "<1.17")
"""The TRL releases this adapter is tested against (it overrides private GRPOTrainer methods)."""

_log = logging.getLogger(__name__)

try:
    import trl
    from packaging.specifiers import SpecifierSet
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import _ForwardRedirection
    from trl.trainer.utils import maybe_gather_lm_head_ctx
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError("pgloss.integrations.trl needs TRL: pip install 'pgloss[trl]'") from error

if trl.__version__ not in SpecifierSet(",".join(SUPPORTED)):
    raise ImportError(f"pgloss.integrations.trl supports trl {','.join(SUPPORTED)}, found trl {trl.__version__}")

# Inputs TRL forwards to a vision-language model; the non-fused path passes them on unchanged.
_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
               "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


def _refusals(args: Any) -> list[str]:
    """The GRPOConfig options whose effect the adapter cannot reproduce, each with why."""
    refused = []
    if args.top_entropy_quantile < 1.0:
        refused.append(f"top_entropy_quantile={args.top_entropy_quantile} (TRL's entropy mask of the loss)")
    if args.off_policy_mask_threshold is not None:
        refused.append(f"off_policy_mask_threshold={args.off_policy_mask_threshold} (TRL's off-policy sequence mask)")
    if args.entropy_coef != 0 or args.use_adaptive_entropy:
        refused.append(f"entropy_coef={args.entropy_coef}, use_adaptive_entropy={args.use_adaptive_entropy} "
                       "(TRL's entropy bonus; use the algorithm's entropy_coef)")
    if args.use_vllm and args.vllm_importance_sampling_correction:
        if args.vllm_importance_sampling_mode != "token_truncate" or args.vllm_importance_sampling_clip_min is not None:
            refused.append(f"vllm_importance_sampling_mode={args.vllm_importance_sampling_mode!r}, "
                           f"vllm_importance_sampling_clip_min={args.vllm_importance_sampling_clip_min} (only "
                           "'token_truncate' without a lower clip is pgloss's truncated importance sampling)")
    every = args.steps_per_generation * args.num_iterations
    if every % args.gradient_accumulation_steps:
        refused.append(f"steps_per_generation={args.steps_per_generation} with num_iterations={args.num_iterations} "
                       f"and gradient_accumulation_steps={args.gradient_accumulation_steps} (an optimizer step would "
                       "span two generations; make steps_per_generation·num_iterations a multiple of it)")
    parallel = getattr(args, "parallelism_config", None)
    if parallel is not None and (getattr(parallel, "cp_size", 1) > 1 or getattr(parallel, "sp_size", 1) > 1):
        refused.append("parallelism_config with cp_size or sp_size > 1 (tokens would be counted once per shard)")
    return refused


# TRL's loss options and the algorithm field each one would set; the adapter reads the algorithm's.
_LOSS_OPTIONS = (("loss_type", "name"), ("epsilon", "clip_low"), ("epsilon_high", "clip_high"), ("delta", "delta"),
                 ("importance_sampling_level", "ratio_level"), ("sapo_temperature_pos", "tau_pos"),
                 ("sapo_temperature_neg", "tau_neg"))


def _conflicting_loss_options(args: Any, algorithm: Algorithm) -> list[str]:
    """TRL loss options the caller set (away from GRPOConfig's default) to a value the algorithm
    does not have: refused rather than silently ignored, since the loss is the algorithm's."""
    defaults = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    conflicts = []
    for option, field in _LOSS_OPTIONS:
        value = getattr(args, option)
        if value == defaults[option] or not hasattr(algorithm, field) or getattr(algorithm, field) == value:
            continue
        conflicts.append(f"{option}={value!r} (the loss is {algorithm.name}'s, with {field}="
                         f"{getattr(algorithm, field)!r}: set it on the algorithm, e.g. "
                         f"pgloss.get({algorithm.name!r}, {field}=...), and leave {option} at its default)")
    return conflicts


class PGLossMixin:
    """Replaces GRPOTrainer's loss by a pgloss `Algorithm`; put it before the trainer class in the bases.

    Args (keyword, besides the trainer's own):
        algorithm: a name of `pgloss.names()` (built with `norm_constant=max_completion_length`,
            TRL's Dr.GRPO divisor) or a `pgloss.Algorithm`. Default "dapo", TRL's default loss.
        fused: compute the loss from the backbone's last hidden states and the LM head through
            `algorithm.from_hidden`, inside the wrapped model's forward.
        chunk_size: tokens per chunk of the fused path (None: pgloss's default).

    TRL's own loss options (`loss_type`, `epsilon`, `epsilon_high`, `delta`,
    `importance_sampling_level`, `sapo_temperature_*`) are not read: the algorithm's fields are. One
    set away from its default to a value the algorithm does not have is refused by name.
    """

    def __init__(self, *args: Any, algorithm: str | Algorithm = "dapo", fused: bool = False,
                 chunk_size: int | None = None, **kwargs: Any) -> None:
        config = kwargs.get("args", args[2] if len(args) > 2 else None)
        if not isinstance(config, GRPOConfig):
            raise TypeError(f"args must be a trl.GRPOConfig, got {type(config).__name__}")
        if isinstance(algorithm, str):
            algorithm = pgloss.get(algorithm, norm_constant=float(config.max_completion_length))
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"algorithm must be a name or a pgloss.Algorithm, got {type(algorithm).__name__}")
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
        refused = _refusals(config) + _conflicting_loss_options(config, algorithm)
        if refused:
            raise ValueError("PGLossGRPOTrainer cannot honour: " + "; ".join(refused))
        config = copy.copy(config)  # the caller's config stays as it was
        config.beta = algorithm.kl_coef  # TRL builds the reference model and its log-probs iff beta != 0
        if config.use_vllm and config.vllm_importance_sampling_correction:
            cap = config.vllm_importance_sampling_clip_max
            if cap is not None:
                algorithm = dataclasses.replace(algorithm, rollout_is_cap=float(cap))
            elif algorithm.rollout_correction is None and not algorithm.consumes_rollout_log_prob:
                # untruncated weights (a cap must be finite; no bound is RolloutCorrection(upper=None))
                algorithm = dataclasses.replace(algorithm, rollout_correction=RolloutCorrection(upper=None))
        if algorithm.kl_coef != 0 and config.use_bias_correction_kl:
            _log.warning("%s: the KL term is pgloss's %s estimate (kl_coef=%s). TRL's use_bias_correction_kl=True "
                         "(its default) would multiply k3 by the importance ratio: a different KL gradient, which "
                         "this trainer does not compute.", algorithm.name, algorithm.kl_estimator, algorithm.kl_coef)
        if algorithm.scale_rewards != (config.scale_rewards != "none"):
            _log.warning("%s's paper %s the group advantages by their std; TRL's scale_rewards=%r is kept.",
                         algorithm.name, "divides" if algorithm.scale_rewards else "does not divide",
                         config.scale_rewards)
        if algorithm.dynamic_sampling:
            _log.warning("%s's paper drops groups whose rewards are all equal (dynamic sampling); TRL has no such "
                         "option, so every group is kept.", algorithm.name)
        if len(args) > 2:
            args = (*args[:2], config, *args[3:])
        else:
            kwargs["args"] = config
        self.algorithm = algorithm
        self.fused = fused
        self.chunk_size = chunk_size
        self._pgloss_window: tuple[int, Normalizer] | None = None
        super().__init__(*args, **kwargs)
        if fused:
            self._check_fused_head()
        if getattr(type(algorithm), "couples_rows", False) and (
                config.gradient_accumulation_steps > 1 or self.accelerator.num_processes > 1):
            _log.warning("%s couples the rows of a call (a selection among its tokens, or a group contrast), and "
                         "TRL's micro-batches do not hold whole groups: its loss is computed per micro-batch, as "
                         "verl does, and is not the loss of the whole step.", algorithm.name)

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
            out["scores"] = (self._pgloss_rewards_per_func * weights).nansum(dim=1)[first:first + rows]
        return out

    @staticmethod
    def _pgloss_mask(inputs: dict[str, Any]) -> Tensor:
        mask = inputs["completion_mask"]
        return mask if "tool_mask" not in inputs else mask * inputs["tool_mask"]

    def _pgloss_needs(self, key: str) -> bool:
        if key == "group_ids" and self.algorithm.loss_agg_mode == "group-mean-token-mean":
            return True
        return key in getattr(type(self.algorithm), "required_inputs", ())

    def _pgloss_window_normalizer(self) -> Normalizer:
        """The counts of this optimizer step's micro-batches over every process, counted once per step.

        A collective: every process reaches it at the same micro-step (TRL's schedule is lock-step).
        """
        step = self.state.global_step
        if self._pgloss_window is not None and self._pgloss_window[0] == step:
            return self._pgloss_window[1]
        size = self.current_gradient_accumulation_steps
        per_generation, every = self.args.steps_per_generation, self.args.steps_per_generation * self.num_iterations
        if any((self._step + j) % every == 0 for j in range(1, size)):
            raise ValueError(f"optimizer step {step} spans two generations (steps_per_generation={per_generation}, "
                             f"num_iterations={self.num_iterations}, gradient_accumulation_steps={size})")
        window = [self._buffered_inputs[(self._step + j) % per_generation] for j in range(size)]
        group_ids = [batch["group_ids"] for batch in window] if self._pgloss_needs("group_ids") else None
        normalizer = Normalizer.count([self._pgloss_mask(batch) for batch in window], group_ids=group_ids)
        self._pgloss_window = (step, normalizer)
        return normalizer

    def _pgloss_arguments(self, inputs: dict[str, Any], log_prob: Tensor | None) -> dict[str, Any]:
        """Everything but the current log-probs: TRL's inputs under pgloss's names, in float32."""
        old = inputs.get("old_per_token_logps")
        if old is None:
            if log_prob is None:
                raise ValueError("on-policy inputs need the current log-probs for old_log_prob")
            old = log_prob.detach()
        old = old.float()
        rollout = inputs.get("sampling_per_token_logps")
        if rollout is not None and self.use_vllm and self.vllm_importance_sampling_correction:
            rollout = torch.where(torch.isnan(rollout), old, rollout.float())  # NaN: vLLM could not score; weight 1
        else:
            rollout = None
        ref = inputs.get("ref_per_token_logps") if self.algorithm.uses_reference else None
        extra = {key: inputs[key] for key in ("group_ids", "scores") if self._pgloss_needs(key)}
        return dict(old_log_prob=old, advantages=inputs["advantages"], mask=self._pgloss_mask(inputs),
                    ref_log_prob=None if ref is None else ref.float(), rollout_log_prob=rollout, **extra)

    # -- the loss -------------------------------------------------------------------------------

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> Tensor:
        training = self.model.training
        mode = "train" if training else "eval"
        normalizer = self._pgloss_window_normalizer() if training else None  # eval: the batch is the step
        aux = None
        if self.fused:
            out = self._pgloss_fused(model, inputs, normalizer)
        else:
            ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
            attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
            log_prob, entropy, aux = self._get_per_token_logps_and_entropies(
                model, ids, attention, inputs["completion_ids"].size(1), compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled, **{key: inputs.get(key) for key in _MULTIMODAL},
            )
            log_prob = log_prob.float()
            out = self.algorithm(log_prob=log_prob, entropy=None if entropy is None else entropy.float(),
                                 normalizer=normalizer, **self._pgloss_arguments(inputs, log_prob))
        loss = out.loss
        accumulation = self.current_gradient_accumulation_steps if training else 1
        if aux is not None and self.aux_loss_enabled:  # TRL's own convention for the MoE router loss
            loss = loss + self.router_aux_loss_coef * aux / accumulation
        self._pgloss_log(mode, out, accumulation)
        return loss

    def _pgloss_log(self, mode: str, out: LossOutput, accumulation: int) -> None:
        """One gather for every metric. `pg_loss` and `kl_loss` are this micro-batch's shares of the
        step's value, so they are logged × accumulation steps: their mean over the step is the value."""
        names = sorted(out.metrics)
        shares = {"pg_loss", "kl_loss"}
        values = torch.stack([out.metrics[k].detach().float() * (accumulation if k in shares else 1) for k in names])
        gathered = self.accelerator.gather(values[None]).reshape(-1, len(names))
        for k, value in zip(names, gathered.nanmean(dim=0).tolist()):
            self._metrics[mode][f"pgloss/{k}"].append(value)

    # -- the fused path -------------------------------------------------------------------------

    def _pgloss_head_owner(self, unwrapped: torch.nn.Module) -> torch.nn.Module:
        from accelerate.utils import is_peft_model

        return unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped

    def _check_fused_head(self) -> None:
        """Refuse heads whose logits are not hidden @ Wᵀ / τ (pgloss's fused path has no bias or scaling)."""
        owner = self._pgloss_head_owner(self.model)
        head = owner.get_output_embeddings()
        config = owner.config.get_text_config() if hasattr(owner.config, "get_text_config") else owner.config
        problems = []
        if getattr(head, "bias", None) is not None:
            problems.append("an LM head with a bias")
        if getattr(config, "final_logit_softcapping", None) is not None:
            problems.append(f"final_logit_softcapping={config.final_logit_softcapping}")
        for key in ("logit_scale", "lm_head_multiplier", "logits_scaling"):
            if getattr(config, key, None) not in (None, 1, 1.0):
                problems.append(f"{key}={getattr(config, key)}")
        if problems:
            raise ValueError("fused=True cannot compute this model's logits: " + ", ".join(problems)
                             + "; use fused=False")

    def _pgloss_fused(self, model: torch.nn.Module, inputs: dict[str, Any], normalizer: Normalizer | None):
        present = [key for key in _MULTIMODAL if inputs.get(key) is not None]
        if present:
            raise ValueError(f"fused=True supports text-only models; these inputs need fused=False: {present}")
        unwrapped = self.accelerator.unwrap_model(model)
        # The loss must run inside the wrapper's forward: called beside it, DDP/FSDP/ZeRO-3 hooks do not
        # fire and the gradient is silently wrong (TRL's Liger integration did the same).
        return _ForwardRedirection()(model, unwrapped, self._pgloss_fused_loss, unwrapped, inputs, normalizer)

    def _pgloss_fused_loss(self, unwrapped: torch.nn.Module, inputs: dict[str, Any],
                           normalizer: Normalizer | None) -> LossOutput:
        owner = self._pgloss_head_owner(unwrapped)
        targets = inputs["completion_ids"]
        length = targets.size(1)
        ids = torch.cat([inputs["prompt_ids"], targets], dim=1)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        hidden = owner.base_model(input_ids=ids, attention_mask=attention, use_cache=False).last_hidden_state
        hidden = hidden[:, -length - 1:-1]  # the positions that predict the completion tokens
        weight = owner.get_output_embeddings().weight
        from torch.distributed.tensor import DTensor

        if isinstance(weight, DTensor):  # FSDP2: gather the head, as TRL's own fused head does
            weight = weight.full_tensor()
        if self.args.cast_lm_head_to_fp32:
            hidden, weight = hidden.float(), weight.float()
        weight_ctx = maybe_gather_lm_head_ctx(weight) if isinstance(weight, torch.nn.Parameter) else nullcontext()
        with weight_ctx:
            self._pgloss_check_zero3(weight, length)
            log_prob = None
            if inputs.get("old_per_token_logps") is None:  # on-policy: log π_old is the detached log π
                with torch.no_grad():
                    log_prob, _ = pgloss.log_prob_and_entropy_from_hidden(
                        hidden, weight, torch.where(self._pgloss_mask(inputs).bool(), targets, 0),
                        temperature=self.temperature, chunk_size=self.chunk_size)
            return self.algorithm.from_hidden(hidden, weight, targets, temperature=self.temperature,
                                              normalizer=normalizer, chunk_size=self.chunk_size,
                                              **self._pgloss_arguments(inputs, log_prob))

    def _pgloss_check_zero3(self, weight: Tensor, length: int) -> None:
        """Under ZeRO-3 the head is gathered for the forward only: the one-pass path (whole sequences in
        a chunk, gradients formed in the forward) is required."""
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

        from pgloss.entropy import check_chunk_size

        if is_deepspeed_zero3_enabled() and length > check_chunk_size(self.chunk_size, weight.shape[0]):
            raise ValueError(f"fused=True under ZeRO-3 needs chunk_size >= the completion length {length}")


class PGLossGRPOTrainer(PGLossMixin, GRPOTrainer):
    """TRL's GRPOTrainer with a pgloss algorithm's loss: `PGLossGRPOTrainer(..., algorithm=, fused=)`."""
