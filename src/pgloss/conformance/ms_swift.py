"""pgloss against ms-swift's own GRPO loss: `GRPOTrainer._compute_loss_and_metrics`, value and gradient.

ms-swift's `swift` package imports transformers, trl, peft and its templates on import, so its loss is run from
its files (`pgloss.conformance.sources`), found under `$PGLOSS_MS_SWIFT_SRC` or in the installed distribution:
`GRPOTrainer`'s methods `_compute_loss_and_metrics` (with the FIPO influence, the rollout importance
sampling, the off-policy sequence mask and their metrics, which it calls) run unchanged on a stand-in
trainer (`_trainer`) that hands them the batch's log-probs and entropies in place of a model forward. Its
attributes are set by ms-swift's own `_prepare_algorithm_params` from the arguments, whose defaults are
those of ms-swift's `GRPOArgumentsMixin` (`swift/rlhf_trainers/args_mixin.py`). One micro-batch, one
process (GA = 1), float64.

ms-swift's options in pgloss's terms (`algorithm`): the loss types it shares with TRL (grpo, bnpo, dr_grpo,
dapo, cispo, sapo; `epsilon`, `epsilon_high`, `delta`, `importance_sampling_level` token and sequence, `beta`
as k3 without a ratio weight, `tau_pos`/`tau_neg` as TRL's `sapo_temperature_*`) through `pgloss.from_trl`,
the one translation of those options; `importance_sampling_level="sequence_token"` is pgloss's
`ratio_level="sequence_token"`; `fipo` and `real` are pgloss's of the same name, with ms-swift's option
names (`fipo_*`, `delta`, `real_tau`; REAL's groups are consecutive blocks of `num_generations`). The
rollout importance sampling, which ms-swift applies to the KL term too (`weight_kl=True`):

| `rollout_importance_sampling_mode` (threshold C) | pgloss `RolloutCorrection` |
|---|---|
| token_truncate: min(ρ_t, C) | `weight_level="token"`, truncate, `upper=C` |
| token_mask: ρ_t·1[ρ_t ≤ C] | `weight_level="token"`, mask, `upper=C` |
| sequence_truncate: min(ρ̄_i, C), ρ̄_i = exp(mean_t log ρ_t) | `weight_level="sequence_geometric"`, truncate, `upper=C` |
| sequence_mask: ρ_t·1[ρ̄_i ≤ C] | a token weight with `Rejection("seq_mean_k1", lower=1/C)`, counted on the original masks |
| `off_policy_sequence_mask_delta` | `off_policy_mask` |
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator
from pathlib import Path
from types import MethodType, SimpleNamespace
from typing import Any

import torch

from .case import LENGTH, ROWS, Case, batch, flat_grad, relative
from .sources import load, locate_all

__all__ = ["TRAINER", "available", "cases", "compare"]

TRAINER = "ms-swift"
VARIABLE = "PGLOSS_MS_SWIFT_SRC"
PIN = "ms-swift==4.6.0"
TRAINER_FILE, ARGS_FILE = "swift/rlhf_trainers/grpo_trainer.py", "swift/rlhf_trainers/args_mixin.py"
TOLERANCE = 1e-9
GROUP = 3
"""`num_generations`: REAL's groups are consecutive blocks of this many rows."""
_METHODS = (
    "_compute_loss_and_metrics",
    "_compute_fipo_influence",
    "_get_rollout_is_correction",
    "_apply_rollout_importance_sampling",
    "_compute_sequence_level_ratios",
    "_compute_off_policy_sequence_mask",
    "_compute_rollout_offpolicy_metrics",
    "_compute_is_correction_metrics",
    "_undo_gradient_accumulation_scaling",
    "_prepare_algorithm_params",
)
_REF = "docs/reference.md, 'Conformance with ms-swift'"


def _files() -> tuple[Path, ...] | str:
    install = f"pip install --no-deps {PIN}: pgloss reads its loss from its files"
    return locate_all("ms-swift", (TRAINER_FILE, ARGS_FILE), VARIABLE, install)


def available() -> str | None:
    """None when ms-swift's GRPO loss can be read and run, and TRL's GRPOConfig (the translation's vocabulary,
    which ms-swift shares) imports; else why not."""
    found = _files()
    if isinstance(found, str):
        return found
    try:
        from trl import GRPOConfig  # noqa: F401
    except Exception as error:
        return (
            f"trl cannot be imported ({type(error).__name__}: {error}): ms-swift's GRPO options are TRL's "
            "GRPOConfig's, which pgloss.from_trl translates (pip install 'trl>=1.16,<1.17')"
        )
    try:
        _code()
    except Exception as error:
        return f"ms-swift's loss code cannot be loaded ({type(error).__name__}: {error})"
    return None


@functools.cache
def _code() -> tuple[dict, dict]:
    """(GRPOTrainer's methods, the arguments' defaults), executed from ms-swift's files."""
    from trl.trainer.grpo_trainer import nanmax, nanmin

    files = _files()
    if isinstance(files, str):
        raise LookupError(files)
    trainer_file, args_file = files
    arguments = load(
        args_file,
        ("VllmArguments", "RolloutTrainerArgumentsMixin", "GRPOArgumentsMixin"),
        dict(dataclass=dataclasses.dataclass, field=dataclasses.field, json_parse_to_dict=None),
    )
    mixin = arguments["GRPOArgumentsMixin"]  # its decorator dropped: the defaults are class attributes
    defaults = {
        name: getattr(mixin, name)
        for name in dir(mixin)
        if not name.startswith("_") and not callable(getattr(mixin, name))
    }
    namespace = dict(
        torch=torch,
        gather=lambda x: x,
        gather_object=lambda x: x,
        nanmax=nanmax,
        nanmin=nanmin,
        logger=SimpleNamespace(info=lambda *a: None, warning=lambda *a: None),
    )
    load(trainer_file, ("WINDOW_NORMALIZED_LOSS_TYPES",), namespace)
    load(trainer_file, _METHODS, namespace, within="GRPOTrainer")
    return namespace, defaults


class _Accelerator:
    num_processes = 1

    @staticmethod
    def gather_for_metrics(x: torch.Tensor) -> torch.Tensor:
        return x


def _trainer(code: dict, args: SimpleNamespace, log_prob: torch.Tensor, entropy: torch.Tensor) -> Any:
    """What `_compute_loss_and_metrics` reads of `self`, set as GRPOTrainer.__init__ sets it."""
    stub = SimpleNamespace(
        args=args,
        model=SimpleNamespace(training=True),
        accelerator=_Accelerator(),
        beta=args.beta,
        max_completion_length=args.max_completion_length,
        num_generations=args.num_generations,
        _has_teacher=False,
        disable_rollout_importance_sampling=False,
        chord_sft_iterator=None,
        model_accepts_loss_kwargs=False,
        compute_loss_func=None,
        current_gradient_accumulation_steps=1,
        _get_per_token_logps_and_entropies=lambda *a, **k: (log_prob, entropy),
    )
    for name in _METHODS:
        setattr(stub, name, MethodType(code[name], stub))
    stub._prepare_algorithm_params()
    stub.compute_entropy = args.log_entropy or stub.top_entropy_quantile < 1.0  # as _prepare_metrics
    return stub


def _arguments(defaults: dict, options: dict[str, Any]) -> SimpleNamespace:
    """ms-swift's GRPO arguments: its defaults, then `options` (with β = 0.04, ms-swift's GRPO default)."""
    values = dict(defaults) | dict(
        loss_type="grpo",
        beta=0.04,
        num_iterations=1,
        max_completion_length=LENGTH,
        num_generations=GROUP,
        gradient_accumulation_steps=1,
    )
    return SimpleNamespace(**(values | options))


def algorithm(args: SimpleNamespace) -> tuple[Any, bool]:
    """The pgloss algorithm for ms-swift's GRPO arguments `args` (`pgloss.trainer_options.swift.from_swift`, the one
    owner of that mapping, which the ms-swift adapter runs too), and whether its rollout rejection is counted on the
    original masks (sequence_mask keeps its rows in ms-swift's counts)."""
    from ..trainer_options.swift import counts_rejected, from_swift

    return from_swift(vars(args)), counts_rejected(vars(args))


def compare(options: dict[str, Any], *, seed: int = 0, empty_row: bool = False) -> tuple[float, float]:
    """(relative loss error, relative gradient error w.r.t. the log-probs) of ms-swift's
    `_compute_loss_and_metrics` with the GRPO arguments `options` against pgloss, on one random batch."""
    from ..correction.token_masks import entropy_threshold, top_entropy_mask

    code, defaults = _code()
    args = _arguments(defaults, options)
    ours, counted = algorithm(args)
    data = batch(seed, empty_row=empty_row)
    mask = data["mask"].bool()
    rollout = (
        data["sampling"]
        if (args.rollout_importance_sampling_mode is not None or args.off_policy_sequence_mask_delta is not None)
        else None
    )
    group_ids = torch.arange(ROWS) // GROUP
    losses, grads = [], []
    for side in ("ms-swift", "pgloss"):
        log_prob = data["log_prob"].clone().requires_grad_(True)
        if side == "ms-swift":
            trainer = _trainer(code, args, log_prob, data["entropy"])
            grpo_batch = SimpleNamespace(
                completion_mask=mask,
                truncated_mask=torch.zeros(ROWS, dtype=torch.bool),
                ref_per_token_logps=data["ref"],
                advantages=data["advantages"][:, None].expand(ROWS, mask.shape[1]),
                old_per_token_logps=data["old"],
                rollout_per_token_logps=rollout,
                num_items_in_batch=mask.sum(),
                teacher_per_token_logps=None,
            )
            loss, _ = trainer._compute_loss_and_metrics(None, {}, grpo_batch)
        else:
            loss_mask = mask
            if args.top_entropy_quantile < 1:
                threshold = entropy_threshold(data["entropy"], mask, top=args.top_entropy_quantile, reduce=False)
                loss_mask = top_entropy_mask(data["entropy"], mask, threshold)
            normalizer = (
                ours.rollout_correction.normalizer(
                    loss_mask, data["old"], rollout, group_ids=group_ids, count_rejected=True
                )
                if counted
                else None
            )
            loss = ours(
                log_prob,
                data["old"],
                data["advantages"],
                loss_mask,
                ref_log_prob=data["ref"],
                rollout_log_prob=rollout,
                group_ids=group_ids,
                normalizer=normalizer,
            ).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append(flat_grad(log_prob))
    return relative(losses[1], losses[0]), relative(grads[1], grads[0])


_IS = [
    dict(rollout_importance_sampling_mode=mode, rollout_importance_sampling_threshold=cap)
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    for cap in (2.0, 1.2)
]

_AGREE: list[dict[str, Any]] = [
    *[dict(loss_type=name, beta=0.0) for name in ("grpo", "bnpo", "dr_grpo", "dapo", "sapo", "fipo", "real")],
    dict(),  # ms-swift's GRPO defaults: grpo, β = 0.04
    dict(loss_type="dapo", beta=0.0, epsilon_high=0.28),
    dict(loss_type="cispo", beta=0.0, epsilon_high=5.0),
    dict(loss_type="cispo", epsilon_high=5.0),
    dict(loss_type="bnpo"),
    dict(loss_type="dr_grpo"),
    dict(loss_type="dapo", epsilon_high=0.28),
    dict(loss_type="sapo", beta=0.0, tau_pos=2.0, tau_neg=0.5),
    dict(loss_type="sapo"),
    dict(loss_type="grpo", beta=0.0, delta=1.5),
    dict(loss_type="dapo", beta=0.0, delta=1.5, epsilon_high=0.28),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4),
    dict(loss_type="grpo", importance_sampling_level="sequence_token", epsilon=3e-4, epsilon_high=4e-4),
    dict(loss_type="fipo", beta=0.0, delta=3.0, fipo_clip_high_only=False, fipo_safety_threshold=1.2),
    dict(loss_type="fipo", beta=0.0, fipo_clip_range=None),
    dict(loss_type="fipo", epsilon_high=0.28),
    dict(loss_type="real", beta=0.0, real_tau=0.2),
    *[dict(loss_type=name, **v) for name in ("dapo", "grpo") for v in _IS],
    dict(loss_type="grpo", beta=0.0, off_policy_sequence_mask_delta=0.02),
    dict(loss_type="dapo", off_policy_sequence_mask_delta=0.02),
]

_DOCUMENTED: list[tuple[dict[str, Any], dict[str, Any], str]] = [
    (
        dict(loss_type="grpo", beta=0.0),
        dict(empty_row=True),
        f"ms-swift's grpo counts an empty completion as a row of the mean; pgloss does not ({_REF})",
    ),
    (
        dict(loss_type="dr_grpo", beta=0.0),
        dict(empty_row=True),
        f"dr_grpo: ms-swift divides by every row, empty ones too ({_REF})",
    ),
    (
        dict(loss_type="bnpo", beta=0.0, off_policy_sequence_mask_delta=0.02),
        {},
        f"ms-swift's off-policy mask leaves the token count; pgloss keeps a dropped sequence's tokens in it ({_REF})",
    ),
    (
        dict(loss_type="dapo", beta=0.0, top_entropy_quantile=0.5),
        {},
        f"ms-swift keeps the tokens its entropy mask drops in the denominator; pgloss counts the mask ({_REF})",
    ),
    (
        dict(loss_type="real"),
        {},
        f"REAL's KL: a token mean in ms-swift; pgloss aggregates it like the loss, per group ({_REF})",
    ),
]


def cases() -> Iterator[Case]:
    """Every ms-swift loss_type pgloss computes with the clip, δ, ratio levels, KL, FIPO and REAL options,
    the rollout importance sampling modes and the off-policy mask, each on a random batch."""

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
            function="GRPOTrainer._compute_loss_and_metrics",
            algorithm=options.get("loss_type", "grpo"),
            setting=setting or "defaults",
            loss_error=loss_error,
            grad_error=grad_error,
            tolerance=TOLERANCE,
            reason=reason,
        )

    for seed, options in enumerate(_AGREE):
        yield one(options, dict(seed=seed), None)
    for options, extra, reason in _DOCUMENTED:
        yield one(options, extra, reason)
