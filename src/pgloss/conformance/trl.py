"""pgloss against TRL's own loss: `GRPOTrainer._compute_loss` on random batches, value and gradient.

TRL's method runs unchanged on a minimal stand-in trainer (`_Trainer`) that hands it the batch's
log-probs and entropies in place of a model forward, with TRL's attributes for each `GRPOConfig`;
pgloss's side is `pgloss.from_trl(config)` on the same tensors. One micro-batch, one process
(GA = 1), float64. The vLLM importance-sampling ratio TRL computes inline in
`_generate_and_score_completions` is written out here (`_trl_is_ratio`), as TRL 1.16 computes it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from types import MethodType, SimpleNamespace
from typing import Any

import torch

from .case import LENGTH, ROWS, Case, batch, flat_grad, relative

TRAINER = "TRL"
_B, _T = ROWS, LENGTH
_TOL = 1e-9


def available() -> str | None:
    """None when TRL's GRPOTrainer can be imported, else why not."""
    try:
        import trl  # noqa: F401
        from trl import GRPOConfig, GRPOTrainer  # noqa: F401
    except Exception as error:
        return f"trl cannot be imported ({type(error).__name__}: {error})"
    return None


def _trl_is_ratio(
    old: torch.Tensor, sampling: torch.Tensor, mask: torch.Tensor, mode: str, low: float | None, high: float | None
) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling ratio (trl/trainer/grpo_trainer.py, _generate_and_score_completions)."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=low, max=high)
    bad = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
    return ratio.masked_fill(bad, 0.0)


class _Accelerator:
    num_processes = 1
    sync_gradients = True

    @staticmethod
    def gather(x: torch.Tensor) -> torch.Tensor:
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x

    @staticmethod
    def pad_across_processes(x: torch.Tensor, dim: int = 0, pad_index: int = 0) -> torch.Tensor:
        return x


def _trainer(config: Any, log_prob: torch.Tensor, entropy: torch.Tensor) -> Any:
    """What `GRPOTrainer._compute_loss` reads of `self`, set as GRPOTrainer.__init__ sets it."""
    from trl import GRPOTrainer

    stub = SimpleNamespace(
        args=config,
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        _metrics=defaultdict(lambda: defaultdict(list)),
        current_gradient_accumulation_steps=1,
        aux_loss_enabled=False,
        loss_type=config.loss_type,
        beta=config.beta,
        epsilon_low=config.epsilon,
        epsilon_high=config.epsilon if config.epsilon_high is None else config.epsilon_high,
        importance_sampling_level=config.importance_sampling_level,
        top_entropy_quantile=config.top_entropy_quantile,
        off_policy_mask_threshold=config.off_policy_mask_threshold,
        use_vllm=config.use_vllm,
        vllm_importance_sampling_correction=config.vllm_importance_sampling_correction,
        max_completion_length=config.max_completion_length,
        entropy_coef=config.entropy_coef,
        use_adaptive_entropy=config.use_adaptive_entropy,
        _entropy_bonus_enabled=config.entropy_coef != 0.0 or config.use_adaptive_entropy,
        _last_world_entropy=float("inf"),
        _entropy_window_stats=None,
        _get_per_token_logps_and_entropies=lambda *a, **k: (log_prob, entropy, None),
        get_off_policy_mask=GRPOTrainer.get_off_policy_mask,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )
    stub.get_high_entropy_mask = MethodType(GRPOTrainer.get_high_entropy_mask, stub)  # bound to the stand-in
    return stub


def compare(options: dict[str, Any], *, seed: int = 0, empty_row: bool = False) -> tuple[float, float]:
    """(relative loss error, relative gradient error w.r.t. the log-probs and entropies) of
    pgloss.from_trl(GRPOConfig(**options)) against TRL's _compute_loss, on one random batch."""
    from trl import GRPOConfig, GRPOTrainer

    import pgloss

    from ..correction.token_masks import entropy_threshold, top_entropy_mask

    config = GRPOConfig(
        output_dir="pgloss-conformance", report_to=[], use_cpu=True, bf16=False, max_completion_length=_T, **options
    )
    data = batch(seed, empty_row=empty_row)
    mask = data["mask"]
    inputs = dict(
        prompt_ids=torch.zeros(_B, 1, dtype=torch.long),
        prompt_mask=torch.ones(_B, 1, dtype=torch.long),
        completion_ids=torch.zeros(_B, _T, dtype=torch.long),
        completion_mask=mask,
        advantages=data["advantages"],
        old_per_token_logps=data["old"],
        ref_per_token_logps=data["ref"],
        num_items_in_batch=mask.sum(),
    )
    rollout = None
    if config.use_vllm:
        rollout = data["sampling"]
        inputs["sampling_per_token_logps"] = rollout
        inputs["importance_sampling_ratio"] = _trl_is_ratio(
            data["old"],
            rollout,
            mask,
            config.vllm_importance_sampling_mode,
            config.vllm_importance_sampling_clip_min,
            config.vllm_importance_sampling_clip_max,
        )
    grads = []
    for side in ("trl", "pgloss"):
        log_prob = data["log_prob"].clone().requires_grad_(True)
        entropy = data["entropy"].clone().requires_grad_(True)
        if side == "trl":
            loss = GRPOTrainer._compute_loss(_trainer(config, log_prob, entropy), None, dict(inputs))
        else:
            algorithm = pgloss.from_trl(config, entropy_mask_applied=True)
            loss_mask = mask.bool()
            if config.top_entropy_quantile < 1:
                threshold = entropy_threshold(entropy, loss_mask, top=config.top_entropy_quantile, reduce=False)
                loss_mask = top_entropy_mask(entropy, loss_mask, threshold)
            loss = algorithm(
                log_prob,
                data["old"],
                data["advantages"],
                loss_mask,
                entropy=entropy,
                ref_log_prob=data["ref"],
                rollout_log_prob=rollout,
            ).loss
        loss.backward()
        grads.append((loss.detach(), torch.cat([flat_grad(log_prob), flat_grad(entropy)])))
    (theirs, grad_theirs), (mine, grad_mine) = grads
    return relative(mine, theirs), relative(grad_mine, grad_theirs)


_VLLM = [
    dict(
        use_vllm=True,
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    for low, high in ((None, 3.0), (0.5, 2.0))
]

_AGREE: list[dict[str, Any]] = [
    dict(loss_type="grpo"),
    dict(loss_type="bnpo"),
    dict(loss_type="dr_grpo"),
    dict(loss_type="dapo"),
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="cispo", epsilon_high=5.0),
    dict(loss_type="sapo", sapo_temperature_pos=2.0, sapo_temperature_neg=0.5),
    dict(loss_type="vespo"),
    dict(loss_type="luspo"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    dict(loss_type="grpo", delta=1.5),
    dict(loss_type="dapo", delta=1.5, epsilon_high=0.28),
    dict(loss_type="grpo", beta=0.04),
    dict(loss_type="grpo", beta=0.04, use_bias_correction_kl=False),
    dict(loss_type="dapo", beta=0.1),
    dict(loss_type="cispo", epsilon_high=5.0, beta=0.04),
    dict(loss_type="dapo", off_policy_mask_threshold=0.02),
    dict(loss_type="grpo", off_policy_mask_threshold=0.02),
    dict(loss_type="dapo", entropy_coef=0.01),
    dict(loss_type="bnpo", entropy_coef=0.01),
    *[dict(loss_type=t, **v) for t in ("dapo", "grpo") for v in _VLLM],
    dict(loss_type="dapo", use_vllm=True, off_policy_mask_threshold=0.05),
]

_REF = "docs/reference.md, 'Conformance with TRL'"
_DOCUMENTED: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    (
        dict(loss_type="sapo"),
        {},
        f"TRL's sapo makes its temperatures float32 (torch.where on Python floats: 1.05 -> 1.0499999523) ({_REF})",
    ),
    (
        dict(loss_type="grpo", entropy_coef=0.01),
        {},
        f"TRL's entropy bonus is a token mean for every loss_type; pgloss aggregates H like the loss ({_REF})",
    ),
    (dict(loss_type="dr_grpo", entropy_coef=0.01), {}, f"entropy bonus aggregation ({_REF})"),
    (
        dict(loss_type="dapo", top_entropy_quantile=0.5),
        {},
        f"TRL keeps the tokens its entropy mask drops in the denominator; pgloss counts the mask ({_REF})",
    ),
    (
        dict(loss_type="grpo"),
        dict(empty_row=True),
        f"TRL's grpo counts an empty completion as a sequence of the mean; pgloss does not ({_REF})",
    ),
    (dict(loss_type="dr_grpo"), dict(empty_row=True), f"dr_grpo: TRL divides by every row, empty ones too ({_REF})"),
    (dict(loss_type="luspo"), dict(empty_row=True), f"luspo: TRL averages over every row, empty ones too ({_REF})"),
    (
        dict(loss_type="dapo", beta=0.04, off_policy_mask_threshold=0.02),
        {},
        f"TRL's off-policy mask leaves the KL term of a dropped sequence; pgloss drops the sequence ({_REF})",
    ),
]


def cases() -> Iterator[Case]:
    """Every TRL loss_type and the IS, KL, entropy and mask settings, each on a random batch."""

    def one(options: dict[str, Any], extra: dict[str, Any], reason: str | None) -> Case:
        setting = ", ".join(f"{k}={v!r}" for k, v in options.items() if k != "loss_type")
        setting = ", ".join(filter(None, [setting, "an empty completion" if extra.get("empty_row") else ""]))
        try:
            loss_error, grad_error = compare(options, **extra)
        except Exception as error:
            loss_error = grad_error = math.inf
            setting += f" [{type(error).__name__}: {error}]"
            reason = None
        return Case(
            trainer=TRAINER,
            function="GRPOTrainer._compute_loss",
            algorithm=options["loss_type"],
            setting=setting or "defaults",
            loss_error=loss_error,
            grad_error=grad_error,
            tolerance=_TOL,
            reason=reason,
        )

    for seed, options in enumerate(_AGREE):
        yield one(options, dict(seed=seed), None)
    for options, extra, reason in _DOCUMENTED:
        yield one(options, extra, reason)
