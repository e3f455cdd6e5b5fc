"""ms-swift's GRPO arguments in pgloss's terms: the one owner of that mapping, read by `pgloss.from_swift`, by the
ms-swift adapter (`pgloss.integrations.swift`) and by the conformance check (`pgloss.conformance.ms_swift`). It
reads the arguments' attributes (ms-swift's `GRPOConfig` / `RLHFArguments`, or a dict) and never imports swift.

ms-swift 4.6.0 (`swift/rlhf_trainers/grpo_trainer.py`, `GRPOTrainer._compute_loss_and_metrics` and
`_prepare_algorithm_params`; defaults from `swift/rlhf_trainers/args_mixin.py`, `GRPOArgumentsMixin`):

| ms-swift argument | pgloss | note |
|---|---|---|
| `loss_type` grpo, bnpo, dr_grpo, dapo, cispo, sapo | the algorithm of the same name, through `pgloss.from_trl` | the options ms-swift shares with TRL |
| `loss_type` fipo, real | `fipo` (`fipo_*`, `delta`), `real` (`real_tau`) | |
| `loss_type="pgloss:<name>[,field=value,...]"` | `pgloss.get(name, **fields)` with the options below set away from their defaults | every pgloss name |
| `epsilon`, `epsilon_high`, `delta` | `clip_low`, `clip_high`, `delta` | as TRL's |
| `importance_sampling_level` token, sequence, sequence_token | `ratio_level` token, sequence (GSPO), sequence_token | |
| `tau_pos`, `tau_neg` | SAPO's `tau_pos`, `tau_neg` | TRL's `sapo_temperature_*` |
| `beta` | `kl_coef`, `kl_estimator="k3"` (no ratio weight) | ms-swift's GRPO default is 0.04; `kl_in_reward`: `kl_coef=0` |
| `max_completion_length` | `generation_budget` | Dr.GRPO's divisor |
| `rollout_importance_sampling_mode`, `_threshold` | `RolloutCorrection` (`rollout_correction`) | `weight_kl=True`: ms-swift weighs the KL term too |
| `off_policy_sequence_mask_delta` | `RolloutCorrection(off_policy_mask=)` | |
| `top_entropy_quantile`, `overlong_filter` | masks (`pgloss.correction.token_masks`; the truncated rows) | applied by the adapter, not fields |
| `sdar_loss_coef`, `sdar_gate_beta` | `sdar_coef`, `sdar_gate_beta` (SDAR's term, `pgloss.terms.sdar`) | on the teacher's log-probs: `teacher_log_prob` |
| `teacher_model`, `teacher_model_server`, `teacher_kl_coef` (OPD-RL) | ms-swift's per-token advantages, kept | its teacher's sampled-token log-probs are the adapter's `teacher_log_prob` |
| `advantage_reweight="rlsd"`, `rlsd_*` | ms-swift's per-token advantages, kept (= `pgloss.advantages.rlsd_advantages`) | |

ms-swift computes OPD-RL's A_t + teacher_kl_coef·(log π_T - log π_old) and RLSD's reweighting into
`grpo_batch.advantages` before the loss (`GRPOTrainer._postprocess_batch`); the adapter passes those per-token
advantages as they are. ms-swift's teacher (local model, self-distillation or server) gives the sampled token's
log-prob only (`topk=0`), which is all SDAR and pgloss's distillation names read.

Refused, naming the argument (`refusals`): `advantage_reweight` other than "rlsd"; `chord_sft_dataset` (CHORD's SFT
mix, which ms-swift adds outside the loss), `use_liger_kernel` (ms-swift's fused loss replaces the one pgloss computes),
`sequence_parallel_size > 1` and `rlhf_type` other than grpo. ms-swift options of the rollout, the rewards and
the advantages (`scale_rewards`, `advantage_estimator`, `dynamic_sample`, ...) are ms-swift's and kept.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Mapping
from typing import Any

from ..algorithms import NAMED, Algorithm, get
from ..correction.rejection import Rejection
from ..correction.rollout import RolloutCorrection
from ..losses.ppo import ClippedPolicy
from ..terms.sdar import Options as SDAROptions
from .trl import LOSS_TYPES, from_trl, grpo_options
from .trl_trainer import trainer_algorithm

__all__ = ["DEFAULTS", "PREFIX", "counts_rejected", "from_swift", "parse_loss_type", "refusals", "swift_algorithm"]

PREFIX = "pgloss:"
"""`--loss_type pgloss:<name>[,field=value,...]` names a pgloss algorithm and its fields."""

DEFAULTS: dict[str, Any] = dict(
    loss_type="grpo",
    epsilon=0.2,
    epsilon_high=None,
    delta=None,
    importance_sampling_level="token",
    tau_pos=1.0,
    tau_neg=1.05,
    beta=0.04,
    kl_in_reward=None,
    max_completion_length=512,
    top_entropy_quantile=1.0,
    overlong_filter=False,
    real_tau=0.5,
    fipo_decay_rate=32.0,
    fipo_clip_range=0.2,
    fipo_clip_high_only=True,
    fipo_safety_threshold=4.0,
    rollout_importance_sampling_mode=None,
    rollout_importance_sampling_threshold=2.0,
    off_policy_sequence_mask_delta=None,
    advantage_reweight=None,
    sdar_loss_coef=0.0,
    sdar_gate_beta=5.0,
    chord_sft_dataset=(),
    use_liger_kernel=False,
    sequence_parallel_size=1,
)
"""The arguments pgloss reads, at ms-swift 4.6.0's GRPO defaults (`beta`: RLHFArguments' 0.04 for grpo)."""

_SHARED = ("epsilon", "epsilon_high", "delta", "importance_sampling_level", "tau_pos", "tau_neg")
_SDAR = {"sdar_loss_coef": "sdar_coef", "sdar_gate_beta": "sdar_gate_beta"}
"""ms-swift's SDAR arguments and the fields of pgloss's SDAR term (`pgloss.terms.sdar.Options`)."""


def _get(args: Any, name: str) -> Any:
    if isinstance(args, Mapping):
        return args.get(name, DEFAULTS.get(name))
    return getattr(args, name, DEFAULTS.get(name))


def _is_set(args: Any, name: str) -> bool:
    value = _get(args, name)
    return value != DEFAULTS[name] and not (name == "chord_sft_dataset" and not value)


def parse_loss_type(loss_type: Any) -> tuple[str, dict[str, Any]] | None:
    """`"pgloss:<name>[,field=value,...]"` as (name, fields), values read as Python literals (else strings);
    None for ms-swift's own loss types."""
    if isinstance(loss_type, (list, tuple)) and len(loss_type) == 1:
        loss_type = loss_type[0]
    if not isinstance(loss_type, str) or not loss_type.startswith(PREFIX):
        return None
    name, *items = loss_type[len(PREFIX) :].split(",")
    if name not in NAMED:
        get(name)  # the registry's error, listing the names
    fields: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"loss_type={loss_type!r}: {item!r} is not field=value")
        try:
            fields[key.strip()] = ast.literal_eval(text.strip())
        except (ValueError, SyntaxError):
            fields[key.strip()] = text.strip()
    return name, fields


def refusals(args: Any) -> list[str]:
    """The ms-swift arguments pgloss's loss cannot honour, each named with its value."""
    refused = []
    if _get(args, "advantage_reweight") not in (None, "rlsd"):
        refused.append(f"advantage_reweight={_get(args, 'advantage_reweight')!r} (ms-swift 4.6.0's is 'rlsd')")
    if _is_set(args, "chord_sft_dataset"):
        refused.append("chord_sft_dataset (CHORD's SFT term is added outside the loss: use loss_type='pgloss:chord')")
    if _get(args, "use_liger_kernel"):
        refused.append("use_liger_kernel=True (Liger's fused GRPO loss would replace pgloss's; use fused=True)")
    if (_get(args, "sequence_parallel_size") or 1) > 1:
        refused.append(f"sequence_parallel_size={_get(args, 'sequence_parallel_size')} (tokens counted per shard)")
    rlhf_type = _get(args, "rlhf_type")
    if rlhf_type not in (None, "grpo"):
        refused.append(f"rlhf_type={rlhf_type!r} (pgloss's losses are GRPO's)")
    return refused


def _kl(args: Any) -> dict[str, Any]:
    """ms-swift's KL term: β·k3 on the token log-ratio, none when it is in the reward."""
    return dict(kl_coef=0.0 if _get(args, "kl_in_reward") else _get(args, "beta"), kl_estimator="k3")


def _trl_options(args: Any, *, only_set: bool) -> dict[str, Any]:
    """The options ms-swift shares with TRL, under TRL's names (for `pgloss.from_trl`, the one translation)."""
    level = _get(args, "importance_sampling_level")
    values = dict(
        epsilon=_get(args, "epsilon"),
        epsilon_high=_get(args, "epsilon_high"),
        delta=_get(args, "delta"),
        importance_sampling_level="token" if level == "sequence_token" else level,
        sapo_temperature_pos=_get(args, "tau_pos"),
        sapo_temperature_neg=_get(args, "tau_neg"),
    )
    names = dict(sapo_temperature_pos="tau_pos", sapo_temperature_neg="tau_neg")
    if only_set:
        values = {key: value for key, value in values.items() if _is_set(args, names.get(key, key))}
    return values


def _sdar(args: Any, algorithm: Algorithm) -> Algorithm:
    """ms-swift's SDAR arguments on the algorithm's SDAR fields (the one owner of that map): `sdar_loss_coef` is
    `sdar_coef`, `sdar_gate_beta` is `sdar_gate_beta`. A field the algorithm already sets (`loss_type`'s
    `pgloss:<name>,sdar_coef=...`, or an Algorithm given) away from its default and from ms-swift's is a conflict."""
    set_here: dict[str, Any] = {field: float(_get(args, n)) for n, field in _SDAR.items() if _is_set(args, n)}
    if not set_here:
        return algorithm
    plain = SDAROptions()
    for name, field in _SDAR.items():
        ours = getattr(algorithm, field)
        if field in set_here and ours != getattr(plain, field) and ours != set_here[field]:
            raise ValueError(f"{name}={set_here[field]} with the algorithm's {field}={ours}: give one")
    return dataclasses.replace(algorithm, **set_here)


def _sequence_token(args: Any, algorithm: Algorithm) -> Algorithm:
    if _get(args, "importance_sampling_level") != "sequence_token":
        return algorithm
    if not isinstance(algorithm, ClippedPolicy):  # ms-swift's GSPO-token: the ratio level of the clipped family
        raise ValueError(f"importance_sampling_level='sequence_token' needs a clipped-ratio loss, got {algorithm.name}")
    return dataclasses.replace(algorithm, ratio_level="sequence_token")


def rollout_correction(args: Any) -> RolloutCorrection | None:
    """ms-swift's rollout importance sampling (threshold C, ρ_t = π_old/π_rollout) and off-policy sequence mask:

    | mode | pgloss |
    |---|---|
    | token_truncate: min(ρ_t, C) | `weight_level="token"`, truncate, `upper=C` |
    | token_mask: ρ_t·1[ρ_t ≤ C] | `weight_level="token"`, mask, `upper=C` |
    | sequence_truncate: min(ρ̄_i, C), ρ̄_i = exp(mean_t log ρ_t) | `weight_level="sequence_geometric"`, `upper=C` |
    | sequence_mask: ρ_t·1[ρ̄_i ≤ C] | token weight with `Rejection("seq_mean_k1", lower=1/C)`, counted on the original masks |
    """
    mode, cap = _get(args, "rollout_importance_sampling_mode"), _get(args, "rollout_importance_sampling_threshold")
    delta = _get(args, "off_policy_sequence_mask_delta")
    if mode is None and delta is None:
        return None
    weights = {
        None: dict(weight_level=None),
        "token_truncate": dict(weight_level="token", upper=cap),
        "token_mask": dict(weight_level="token", weight_mode="mask", upper=cap),
        "sequence_truncate": dict(weight_level="sequence_geometric", upper=cap),
        "sequence_mask": dict(
            weight_level="token", upper=None, rejection=(Rejection("seq_mean_k1", upper=None, lower=1 / cap),)
        ),
    }
    if mode not in weights:
        raise ValueError(f"rollout_importance_sampling_mode={mode!r} is not one of ms-swift's {list(weights)[1:]}")
    return RolloutCorrection(off_policy_mask=delta, weight_kl=True, **weights[mode])


def counts_rejected(args: Any) -> bool:
    """Whether the step counts the rows the rollout correction rejects (ms-swift's sequence_mask keeps them)."""
    return _get(args, "rollout_importance_sampling_mode") == "sequence_mask"


def from_swift(args: Any) -> Algorithm:
    """The pgloss `Algorithm` of ms-swift's own `loss_type` with its options (the module's table)."""
    name = _get(args, "loss_type")
    if isinstance(name, (list, tuple)) and len(name) == 1:
        name = name[0]
    kl = _kl(args)
    if name in LOSS_TYPES and name not in ("vespo", "luspo"):
        options = _trl_options(args, only_set=False) | dict(
            loss_type=name,
            beta=kl["kl_coef"],
            use_bias_correction_kl=False,
            max_completion_length=_get(args, "max_completion_length"),
        )
        ours = _sequence_token(args, from_trl(options))
    elif name == "fipo":
        high = _get(args, "epsilon_high")
        ours = get(
            "fipo",
            clip_low=_get(args, "epsilon"),
            clip_high=_get(args, "epsilon") if high is None else high,
            delta=_get(args, "delta"),
            fipo_decay_rate=_get(args, "fipo_decay_rate"),
            fipo_clip_range=_get(args, "fipo_clip_range"),
            fipo_clip_high_only=_get(args, "fipo_clip_high_only"),
            fipo_safety_threshold=_get(args, "fipo_safety_threshold"),
            **kl,
        )
    elif name == "real":
        ours = get("real", real_tau=_get(args, "real_tau"), **kl)
    else:
        raise ValueError(f"loss_type={name!r}: not one of ms-swift's losses (or {PREFIX}<name> for pgloss's)")
    correction = rollout_correction(args)
    ours = _sdar(args, ours)
    return ours if correction is None else dataclasses.replace(ours, rollout_correction=correction)


def swift_algorithm(args: Any, algorithm: str | Algorithm | None = None) -> Algorithm:
    """The algorithm the ms-swift adapter runs: `algorithm=None` takes it from `loss_type` (ms-swift's own through
    `from_swift`, or `pgloss:<name>,...`); a name is that algorithm with its own defaults, the fields `loss_type`
    gives, ms-swift's shared loss options set away from their defaults, ms-swift's `beta` as `kl_coef` and its
    rollout correction; an Algorithm is used as given. Refuses (ValueError, naming them) what pgloss cannot honour.
    """
    refused = refusals(args)
    if refused:
        raise ValueError("pgloss's ms-swift adapter cannot honour: " + "; ".join(refused))
    spec = parse_loss_type(_get(args, "loss_type"))
    if algorithm is None and spec is None:
        return from_swift(args)
    if isinstance(algorithm, Algorithm):
        if spec is not None:
            raise ValueError(f"loss_type={_get(args, 'loss_type')!r} with algorithm={algorithm.name}: give one")
        return _sdar(args, algorithm)
    fields: dict[str, Any] = {}
    if algorithm is None:
        assert spec is not None
        algorithm, fields = spec
    elif not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be None, a name or a pgloss.Algorithm, got {type(algorithm).__name__}")
    elif spec is not None and spec[0] != algorithm:
        raise ValueError(f"loss_type={_get(args, 'loss_type')!r} with algorithm={algorithm!r}: give one")
    budget = _get(args, "max_completion_length")
    trl = _trl_options(args, only_set=True) | dict(
        beta=_kl(args)["kl_coef"], use_bias_correction_kl=False, max_completion_length=budget
    )
    try:  # TRL's translation of the options the two trainers share, its message in ms-swift's names
        ours = _sequence_token(args, trainer_algorithm(grpo_options(trl), algorithm))
    except ValueError as error:
        message = str(error).replace("PGLossGRPOTrainer cannot honour", "pgloss's ms-swift adapter cannot honour")
        for theirs, swift_name in (("sapo_temperature_pos", "tau_pos"), ("sapo_temperature_neg", "tau_neg")):
            message = message.replace(theirs, swift_name)
        raise ValueError(message) from error
    if fields:  # the loss_type's own fields over what ms-swift's options made of the name's defaults
        plain = get(algorithm, generation_budget=float(budget))
        changed = {
            f.name: getattr(ours, f.name)
            for f in dataclasses.fields(ours)
            if f.init and getattr(ours, f.name) != getattr(plain, f.name)
        }
        try:
            ours = get(algorithm, generation_budget=float(budget), **(changed | fields))
        except (TypeError, ValueError) as error:
            raise ValueError(f"loss_type={_get(args, 'loss_type')!r}: {error}") from error
    ours = _sdar(args, ours)
    correction = rollout_correction(args)
    if correction is not None:
        if not type(ours).takes_rollout_correction():
            raise ValueError(f"rollout_importance_sampling_mode / off_policy_sequence_mask_delta with {ours.name}")
        ours = dataclasses.replace(ours, rollout_correction=correction)
    return ours
