"""verl's on-policy distillation options as pgloss fields: the one map `from_verl(..., distillation=)` reads.

verl 0.9.1 configures its distillation apart from the actor (`distillation.distillation_loss`,
`verl/workers/config/distillation.py` `DistillationLossConfig`); `verl/trainer/distillation/losses.py`
`distillation_ppo_loss` adds it to the actor's policy loss:

    use_task_rewards=True     L = L_task + distillation_loss_coef · L_distill
    use_task_rewards=False    L = L_distill

with L_distill verl's `distillation_loss` (pgloss's term of `terms/distillation.py`). The map:

    loss_mode                  distill_estimator (k1/kl, k2/mse, k3/low_var_kl, abs)
    distillation_loss_coef     distill_coef (1 when use_task_rewards=False, as verl takes it)
    use_task_rewards=False     policy_coef = 0
    loss_max_clamp             distill_clamp
    use_policy_gradient        distill_policy_gradient
    clip_ratio_low / _high     distill_clip_low / distill_clip_high (policy_loss_mode "vanilla" only, as verl)

`loss_mode="forward_kl_topk"` is not a term of the policy loss: verl computes it from the student's logits in its
logits processor; pgloss's is `pgloss.topk_divergence_from_logits` / `_from_hidden` with `beta=0, tail="drop",
log_prob_min=log_prob_min_clamp, value_range=(0, loss_max_clamp)` (refused here by name, pointing there).
"""

from __future__ import annotations

from typing import Any

from ..core.trainer_names import translate_value

__all__ = ["distillation_fields"]

_ESTIMATORS = ("k1", "k2", "k3", "abs")


def _get(config: Any, key: str, default: Any) -> Any:
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def distillation_fields(config: Any) -> dict[str, Any]:
    """pgloss's fields for verl's `distillation` config (its `DistillationConfig`, a DictConfig or a dict, with a
    `distillation_loss` section; or that section itself), verl's dataclass defaults where a key is absent;
    ValueError naming what pgloss cannot express. {} for a config whose distillation is off (`enabled` False)."""
    if not _get(config, "enabled", True):
        return {}
    loss = _get(config, "distillation_loss", config)
    mode = _get(loss, "loss_mode", "k3")
    if mode == "forward_kl_topk":
        raise ValueError(
            "verl's distillation loss_mode='forward_kl_topk' is computed from the student's logits, not in the "
            "policy loss: use pgloss.topk_divergence_from_logits / topk_divergence_from_hidden with beta=0, "
            "tail='drop', log_prob_min=log_prob_min_clamp, value_range=(0, loss_max_clamp)"
        )
    estimator = translate_value("kl_estimator", mode)
    if estimator not in _ESTIMATORS:
        raise ValueError(f"verl's distillation loss_mode={mode!r} has no pgloss estimator (one of {_ESTIMATORS})")
    policy_mode = _get(loss, "policy_loss_mode", "vanilla")
    if policy_mode != "vanilla":
        raise ValueError(f"verl's distillation policy_loss_mode={policy_mode!r}: verl itself takes only 'vanilla'")
    task = bool(_get(loss, "use_task_rewards", True))
    clip = _get(loss, "clip_ratio", 0.2)
    fields = {
        "distill_estimator": estimator,
        "distill_coef": float(_get(loss, "distillation_loss_coef", 1.0)) if task else 1.0,
        "distill_clamp": _get(loss, "loss_max_clamp", 10.0),
        "distill_policy_gradient": bool(_get(loss, "use_policy_gradient", True)),
        "distill_clip_low": float(_get(loss, "clip_ratio_low", clip)),
        "distill_clip_high": float(_get(loss, "clip_ratio_high", clip)),
    }
    return fields if task else fields | {"policy_coef": 0.0}
