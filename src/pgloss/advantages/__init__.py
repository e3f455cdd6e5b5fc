"""Advantages, computed once per step before the loss: GRPO's group advantages with every
framework's std convention, Dr.GRPO, DAPO's dynamic sampling and overlong penalty (`group`), and the
estimators beside them: GAE, RLOO, REINFORCE++, ReMax, OPO, GPG, GDPO, pass@k, the optimal token baseline
(`estimators`)."""

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
)

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
]
