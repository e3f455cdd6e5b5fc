"""The estimators beside GRPO's under their earlier module name: `pgloss.advantages.estimators.X` keeps
working. Each estimator family now lives in a file of its own (see `pgloss.advantages`); import from
`pgloss.advantages`."""

from .gae import gae
from .gdpo import GDPO_EPS, gdpo_advantages
from .group import StdConvention, batch_std, group_index, grpo_advantages
from .group_baselines import (
    OPMD_BASELINES,
    SINGLETONS,
    asymre_advantages,
    gpg_advantages,
    opmd_advantages,
    opo_advantages,
    rloo_advantages,
)
from .maxrl import MAXRL_CONVENTIONS, maxrl_advantages
from .optimal_token_baseline import optimal_token_baseline_advantages, tir_optimal_token_baseline_advantages
from .passk import passk_advantages
from .reinforce import reinforce_pp_advantages, reinforce_pp_baseline_advantages, remax_advantages
from .returns import discounted_returns, whiten

__all__ = [
    "gae",
    "GDPO_EPS",
    "gdpo_advantages",
    "StdConvention",
    "batch_std",
    "group_index",
    "grpo_advantages",
    "OPMD_BASELINES",
    "SINGLETONS",
    "asymre_advantages",
    "gpg_advantages",
    "opmd_advantages",
    "opo_advantages",
    "rloo_advantages",
    "MAXRL_CONVENTIONS",
    "maxrl_advantages",
    "optimal_token_baseline_advantages",
    "tir_optimal_token_baseline_advantages",
    "passk_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "remax_advantages",
    "discounted_returns",
    "whiten",
]
