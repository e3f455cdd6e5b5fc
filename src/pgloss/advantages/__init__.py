"""Advantages, computed once per step before the loss: GRPO's group advantages with every
framework's std convention, Dr.GRPO, DAPO's dynamic sampling and overlong penalty (`group`), and the
estimators beside them: GAE, RLOO, REINFORCE++, ReMax, OPO, GPG, GDPO, pass@k, the optimal token baseline
(single- and multi-turn), MaxRL, AsymRE, OPMD (`estimators`), and RAE's per-role running baseline, the
one estimator with state across steps (`role_baseline`)."""

from .group import (
    StdConvention,
    STD_CONVENTIONS,
    SCALES,
    group_index,
    grpo_advantages,
    group_advantages,
    batch_std,
    dynamic_sampling_keep,
    overlong_penalty,
)
from .estimators import (
    gae,
    GDPO_EPS,
    rloo_advantages,
    whiten,
    discounted_returns,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    opo_advantages,
    gpg_advantages,
    gdpo_advantages,
    passk_advantages,
    optimal_token_baseline_advantages,
    tir_optimal_token_baseline_advantages,
    MAXRL_CONVENTIONS,
    maxrl_advantages,
    asymre_advantages,
    OPMD_BASELINES,
    opmd_advantages,
)
from .role_baseline import RoleBaseline

__all__ = [
    "StdConvention",
    "STD_CONVENTIONS",
    "SCALES",
    "group_index",
    "grpo_advantages",
    "group_advantages",
    "batch_std",
    "dynamic_sampling_keep",
    "overlong_penalty",
    "gae",
    "GDPO_EPS",
    "rloo_advantages",
    "whiten",
    "discounted_returns",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "opo_advantages",
    "gpg_advantages",
    "gdpo_advantages",
    "passk_advantages",
    "optimal_token_baseline_advantages",
    "tir_optimal_token_baseline_advantages",
    "MAXRL_CONVENTIONS",
    "maxrl_advantages",
    "asymre_advantages",
    "OPMD_BASELINES",
    "opmd_advantages",
    "RoleBaseline",
]
