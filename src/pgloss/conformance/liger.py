"""pgloss against Liger-Kernel's own GRPO loss (`liger_kernel/chunked_loss/grpo_loss.py`), value and gradient.

Liger's `LigerFusedLinearGRPOLoss(...)` is built as a user builds it; its options are TRL's `GRPOConfig`'s
(the same names and meanings, `epsilon_low` for TRL's `epsilon`: Liger's docstring says it matches
`GRPOTrainer`), so pgloss's side is `pgloss.from_trl` of the GRPOConfig with those values, the one
translation of these options. Two routes on random batches:

- the loss math, on log-probs: `LigerFusedLinearGRPOFunction.ppo_loss_fn` (the function the chunked forward
  calls on each chunk; here the whole batch is one chunk) on float64 log-probs against pgloss's algorithm,
  loss and gradient with respect to the log-probs, to 1e-9;
- the fused route, from hidden states: `LigerFusedLinearGRPOLoss(...)(hidden, weight, ids, ...)` against
  `algorithm.from_hidden(...)`, gradient with respect to the hidden states and the head. Liger computes the
  log-softmax in float32 and casts the old and reference log-probs to float32 (`fused_linear_ppo.py`), so
  these agree to float32's rounding (`FUSED_TOLERANCE`) on float64 inputs.

The vLLM importance-sampling ratio Liger takes as an input (`vllm_is_ratio`) is TRL's, computed as TRL
computes it (`trl._trl_is_ratio`); pgloss gets the rollout log-probs and the same bounds.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from .case import LENGTH, Case, batch, flat_grad, relative
from .trl import _trl_is_ratio

__all__ = ["TRAINER", "available", "cases", "compare", "compare_fused"]

TRAINER = "Liger-Kernel"
TOLERANCE = 1e-9
FUSED_TOLERANCE = 1e-5
"""Relative: Liger's fused route computes log π in float32 (measured about 1e-7 on these batches)."""
PIN = "liger-kernel==0.8.5"
_REF = "docs/reference.md, 'Conformance with Liger-Kernel'"


def available() -> str | None:
    """None when Liger's GRPO loss and TRL's GRPOConfig (the translation's vocabulary) import, else why not."""
    try:
        found = version("liger-kernel")
    except PackageNotFoundError:
        return f"liger-kernel is not installed (pip install --no-deps {PIN}: its GRPO loss needs only torch and triton)"
    try:
        from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction  # noqa: F401
    except Exception as error:
        return f"liger-kernel {found} cannot be imported ({type(error).__name__}: {error})"
    try:
        from trl import GRPOConfig  # noqa: F401
    except Exception as error:
        return (
            f"trl cannot be imported ({type(error).__name__}: {error}): Liger's GRPO options are TRL's "
            "GRPOConfig's, which pgloss.from_trl translates (pip install 'trl>=1.16,<1.17')"
        )
    return None


def _module(options: dict[str, Any]) -> Any:
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    options = dict(options)
    options.setdefault("max_completion_length", LENGTH)
    return LigerFusedLinearGRPOLoss(compiled=False, use_ref_model=options.get("beta", 0.04) != 0, **options)


def _config(liger: Any, vllm: dict[str, Any] | None) -> Any:
    """TRL's GRPOConfig holding the options of the Liger module `liger` (Liger's attribute of the same
    name; TRL's `epsilon` is Liger's `epsilon_low`), with TRL's vLLM IS settings `vllm`."""
    import dataclasses

    from trl import GRPOConfig

    shared = {f.name for f in dataclasses.fields(GRPOConfig)} & set(vars(liger))
    values = {name: getattr(liger, name) for name in shared} | dict(epsilon=liger.epsilon_low)
    values |= dict(use_vllm=True, **vllm) if vllm else dict(use_vllm=False)
    return GRPOConfig(output_dir="pgloss-conformance", report_to=[], use_cpu=True, bf16=False, **values)


def _inputs(config: Any, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(Liger's vllm_is_ratio, pgloss's rollout log-probs) for `config`, or (None, None) without vLLM."""
    if not config.use_vllm:
        return None, None
    ratio = _trl_is_ratio(
        data["old"],
        data["sampling"],
        data["mask"],
        config.vllm_importance_sampling_mode,
        config.vllm_importance_sampling_clip_min,
        config.vllm_importance_sampling_clip_max,
    )
    return ratio, data["sampling"]


def compare(
    options: dict[str, Any],
    vllm: dict[str, Any] | None = None,
    *,
    seed: int = 0,
    empty_row: bool = False,
    below_ref: float = 0.0,
) -> tuple[float, float]:
    """(relative loss error, relative gradient error w.r.t. the log-probs) of Liger's `ppo_loss_fn` with
    `LigerFusedLinearGRPOLoss(**options)`'s settings against pgloss on one random float64 batch
    (`below_ref`: the policy's, old and sampling log-probs lowered by that much, the reference's not)."""
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

    import pgloss

    liger = _module(options)
    config = _config(liger, vllm)
    data = batch(seed, empty_row=empty_row)
    data |= {name: data[name] - below_ref for name in ("old", "log_prob", "sampling")}
    mask = data["mask"]
    is_ratio, rollout = _inputs(config, data)
    keywords = {
        name: getattr(liger, name)
        for name in inspect.signature(LigerFusedLinearGRPOFunction.ppo_loss_fn).parameters
        if hasattr(liger, name)
    }
    losses, grads = [], []
    for side in ("liger", "pgloss"):
        log_prob = data["log_prob"].clone().requires_grad_(True)
        if side == "liger":
            loss, _ = LigerFusedLinearGRPOFunction.ppo_loss_fn(
                per_token_logps=log_prob,
                attention_mask=mask,
                advantages=data["advantages"],
                full_attention_mask=mask,
                ref_per_token_logps=data["ref"],
                old_per_token_logps=data["old"],
                vllm_is_ratio=is_ratio,
                **keywords,
            )
        else:
            loss = pgloss.from_trl(config)(
                log_prob,
                data["old"],
                data["advantages"],
                mask.bool(),
                ref_log_prob=data["ref"],
                rollout_log_prob=rollout,
            ).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(flat_grad(log_prob))
    return relative(losses[1], losses[0]), relative(grads[1], grads[0])


def compare_fused(
    options: dict[str, Any], *, seed: int = 0, vocab: int = 13, hidden_size: int = 8
) -> tuple[float, float]:
    """(relative loss error, relative gradient error w.r.t. the hidden states and the head) of
    `LigerFusedLinearGRPOLoss(**options)` against pgloss's `algorithm.from_hidden`, float64 inputs."""
    import pgloss

    liger = _module(options)
    config = _config(liger, None)
    data = batch(seed)
    mask = data["mask"]
    g = torch.Generator().manual_seed(1000 + seed)
    rows, length = mask.shape
    hidden = torch.randn(rows, length, hidden_size, generator=g, dtype=torch.float64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.float64) / math.sqrt(hidden_size)
    ids = torch.randint(0, vocab, (rows, length), generator=g)
    # the old and reference log-probs near the policy's (k3 stays below pgloss's clamp at 10)
    log_prob = torch.log_softmax(hidden @ weight.T, -1).gather(-1, ids[..., None])[..., 0]
    near = lambda scale: -(log_prob + scale * torch.randn(rows, length, generator=g, dtype=torch.float64)).abs()  # noqa: E731
    data |= dict(old=near(0.3), ref=near(0.2))
    losses, grads = [], []
    for side in ("liger", "pgloss"):
        h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
        if side == "liger":
            loss, _ = liger(
                h,
                w,
                ids,
                mask.long(),
                data["advantages"],
                ref_per_token_logps=data["ref"],
                old_per_token_logps=data["old"],
            )
        else:
            loss = (
                pgloss.from_trl(config)
                .from_hidden(
                    h,
                    w,
                    ids,
                    old_log_prob=data["old"],
                    advantages=data["advantages"],
                    mask=mask.bool(),
                    ref_log_prob=data["ref"],
                )
                .loss
            )
        loss.backward()
        losses.append(loss.detach().double())
        grads.append(torch.cat([flat_grad(h), flat_grad(w)]))
    return relative(losses[1], losses[0]), relative(grads[1], grads[0])


_VLLM = [
    dict(
        vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_min=low,
        vllm_importance_sampling_clip_max=high,
    )
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    for low, high in ((None, 3.0), (0.5, 2.0))
]

_AGREE: list[tuple[dict[str, Any], dict[str, Any] | None]] = [
    (dict(loss_type=name, beta=0.0), None) for name in ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "vespo")
] + [
    (dict(), None),  # Liger's defaults: dapo, β = 0.04, ε = 0.2
    (dict(loss_type="dapo", beta=0.0, epsilon_high=0.28), None),
    (dict(loss_type="cispo", beta=0.0, epsilon_high=5.0), None),
    (dict(loss_type="cispo", epsilon_high=5.0), None),
    (dict(loss_type="sapo", beta=0.0, sapo_temperature_pos=2.0, sapo_temperature_neg=0.5), None),
    (dict(loss_type="grpo", beta=0.0, importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4), None),
    (dict(loss_type="grpo", beta=0.0, delta=1.5), None),
    (dict(loss_type="dapo", beta=0.0, delta=1.5, epsilon_high=0.28), None),
    (dict(loss_type="grpo"), None),
    (dict(loss_type="grpo", use_bias_correction_kl=True), None),
    (dict(loss_type="bnpo", beta=0.1, use_bias_correction_kl=True), None),
    (dict(loss_type="dr_grpo", beta=0.1), None),
    (
        dict(loss_type="vespo", beta=0.0),
        dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=3.0),
    ),
    *[(dict(loss_type=name, beta=0.0), v) for name in ("dapo", "grpo") for v in _VLLM],
    (dict(loss_type="dapo"), _VLLM[0]),
    (dict(loss_type="luspo", beta=0.0, importance_sampling_level="sequence"), None),  # one ℓ per row: no padding
]

_DOCUMENTED: list[tuple[dict[str, Any], dict[str, Any] | None, dict[str, Any], str]] = [
    (
        dict(loss_type="luspo", beta=0.0),
        None,
        {},
        f"Liger's luspo sums ℓ·|y_i| over every position, padding included, ÷ B·T; pgloss sums valid tokens ({_REF})",
    ),
    (
        dict(loss_type="grpo", beta=0.0),
        None,
        dict(empty_row=True),
        f"Liger's grpo counts an empty completion as a row of the mean; pgloss does not ({_REF})",
    ),
    (
        dict(loss_type="dr_grpo", beta=0.0),
        None,
        dict(empty_row=True),
        f"dr_grpo: Liger divides by every row, empty ones too ({_REF})",
    ),
    (
        dict(loss_type="grpo"),
        None,
        dict(below_ref=3.0),
        f"k3 past 10 (log π_ref − log π ≈ 3): pgloss clamps k3 at 10, Liger does not ({_REF})",
    ),
]

_FUSED: list[dict[str, Any]] = [dict(loss_type="grpo"), dict(loss_type="dapo", beta=0.0, epsilon_high=0.28)]


def _setting(options: dict[str, Any], vllm: dict[str, Any] | None, extra: dict[str, Any]) -> str:
    parts = [f"{k}={v!r}" for k, v in {**options, **(vllm or {})}.items() if k != "loss_type"]
    if extra.get("empty_row"):
        parts.append("an empty completion")
    if extra.get("below_ref"):
        parts.append(f"log π {extra['below_ref']} below log π_ref")
    return ", ".join(parts) or "defaults"


def cases() -> Iterator[Case]:
    """Every Liger loss_type with the clip, δ, sequence ratio, KL (with and without its ratio weight) and
    vLLM IS settings on log-probs; then the fused route from hidden states."""

    def one(
        function: str,
        options: dict[str, Any],
        vllm: dict[str, Any] | None,
        extra: dict[str, Any],
        reason: str | None,
        tolerance: float,
        run: Callable[[], tuple[float, float]],
    ) -> Case:
        setting = _setting(options, vllm, extra)
        try:
            loss_error, grad_error = run()
        except Exception as error:
            loss_error = grad_error = math.inf
            setting += f" [{type(error).__name__}: {error}]"
            reason = None
        return Case(
            trainer=TRAINER,
            function=function,
            algorithm=options.get("loss_type", "dapo"),
            setting=setting,
            loss_error=loss_error,
            grad_error=grad_error,
            tolerance=tolerance,
            reason=reason,
        )

    function = "LigerFusedLinearGRPOFunction.ppo_loss_fn"
    for seed, (options, vllm) in enumerate(_AGREE):
        yield one(function, options, vllm, {}, None, TOLERANCE, functools.partial(compare, options, vllm, seed=seed))
    for options, vllm, extra, reason in _DOCUMENTED:
        yield one(function, options, vllm, extra, reason, TOLERANCE, functools.partial(compare, options, vllm, **extra))
    for seed, options in enumerate(_FUSED):
        yield one(
            "LigerFusedLinearGRPOLoss (from hidden states)",
            options,
            None,
            {},
            None,
            FUSED_TOLERANCE,
            functools.partial(compare_fused, options, seed=seed),
        )
