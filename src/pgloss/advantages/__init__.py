"""Advantages, computed once per step before the loss: GAE, GRPO's group advantages with every
framework's std convention, Dr.GRPO, DAPO's dynamic sampling and overlong penalty (`group`), and the
estimators beyond them: RLOO, REINFORCE++, ReMax, OPO, GPG, GDPO, pass@k, the optimal token baseline
(`estimators`)."""

from .group import (
    gae,
    group_index,
    group_advantages,
    dynamic_sampling_keep,
    overlong_penalty,
)
from .estimators import (
    StdConvention,
    STD_CONVENTIONS,
    GDPO_EPS,
    SCALES,
    grpo_advantages,
    batch_std,
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

__all__ = ["gae", "group_index", "group_advantages", "dynamic_sampling_keep", "overlong_penalty", "StdConvention", "STD_CONVENTIONS", "GDPO_EPS", "SCALES", "grpo_advantages", "batch_std", "rloo_advantages", "whiten", "discounted_returns", "reinforce_pp_advantages", "reinforce_pp_baseline_advantages", "remax_advantages", "opo_advantages", "gpg_advantages", "gdpo_advantages", "passk_advantages", "optimal_token_baseline_advantages"]
