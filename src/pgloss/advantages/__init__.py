"""Advantages, computed once per step before the loss, one estimator family per file:

    group.py                   GRPO's group advantages with every framework's std convention, Dr.GRPO, DAPO's
                               dynamic sampling and overlong penalty
    gae.py                     generalised advantage estimation (with a critic)
    returns.py                 the discounted return-to-go and the whitening over the batch's tokens
    reinforce.py               REINFORCE++, its group-baseline variant, ReMax, FlashREINFORCE (the batch mean)
    group_baselines.py         RLOO, OPO, GPG, AsymRE, OPMD: the reward minus a baseline from its group
    maxrl.py                   MaxRL
    gdpo.py                    GDPO (several rewards per response)
    passk.py                   pass@k training
    optimal_token_baseline.py  the optimal token baseline, single- and multi-turn
    role_baseline.py           RAE's per-role running baseline, the one estimator with state across steps
    multi_step.py              multi-step (agentic) episodes, one row per step: step-wise GRPO, GiGPO
    distillation.py            from a teacher's log-probs: Trinity's JSD advantage, RLSD's reweighting and its λ

Sequence-level estimators take one score per sequence, `scores` `[B]`, and integer `group_ids`
`[B]` (the prompt of each sequence; every member of a group must be in the call, as in every
framework, where advantages are computed once per step on the whole rollout). Token-level ones
take `[B, T]` rewards and a mask. Everything returned is detached; arithmetic is in float64 and
the result comes back in the input's floating dtype.

Statistics over the whole batch (REINFORCE++'s whitening, TRL's batch std, GPG's α) are global:
with `process_group` (or the default group, when torch.distributed is initialized and
`reduce=True`) they are all-reduced, so a rollout spread over ranks gets the advantages of the
whole rollout on one process.
"""

from .distillation import jsd_advantages, rlsd_advantages, rlsd_lambda
from .gae import gae
from .gdpo import GDPO_EPS, gdpo_advantages
from .group import (
    SCALES,
    STD_CONVENTIONS,
    StdConvention,
    batch_std,
    dynamic_sampling_keep,
    group_advantages,
    group_index,
    grpo_advantages,
    overlong_penalty,
)
from .group_baselines import (
    OPMD_BASELINES,
    asymre_advantages,
    gpg_advantages,
    opmd_advantages,
    opo_advantages,
    rloo_advantages,
)
from .maxrl import MAXRL_CONVENTIONS, maxrl_advantages
from .multi_step import FNORMS, gigpo_advantages, step_wise_grpo_advantages, step_wise_grpo_keep
from .optimal_token_baseline import optimal_token_baseline_advantages, tir_optimal_token_baseline_advantages
from .passk import passk_advantages
from .reinforce import (
    FLASH_REINFORCE_CONVENTIONS,
    flash_reinforce_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
)
from .returns import discounted_returns, whiten
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
    "FLASH_REINFORCE_CONVENTIONS",
    "flash_reinforce_advantages",
    "step_wise_grpo_advantages",
    "step_wise_grpo_keep",
    "FNORMS",
    "gigpo_advantages",
    "jsd_advantages",
    "rlsd_advantages",
    "rlsd_lambda",
]
