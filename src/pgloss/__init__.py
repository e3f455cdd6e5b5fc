"""pgloss: policy-gradient losses for reinforcement learning of language models.

import pgloss
algorithm = pgloss.get("dapo")
out = algorithm(log_prob=lp, old_log_prob=old, advantages=adv, mask=mask)
out.loss.backward()
"""

from importlib.metadata import PackageNotFoundError, version

from . import advantages, kl
from .advantages.role_baseline import RoleBaseline  # RAE's per-role running baseline: state across steps
from .algorithms import (
    CEGPPO,
    CHORD,
    CISPO,
    DPPO,
    DRO,
    FIPO,
    GMPO,
    GPG,
    GVPO,
    LUSPO,
    OPD,
    OPMD,
    REAL,
    REC,
    SAPO,
    SPPO,
    TISPG,
    TOPR,
    VESPO,  # families: losses/<family>.py
    Algorithm,
    ClipCov,
    ClippedPolicy,
    KLCov,
    LossOutput,
    families,
    get,
    names,
    recipe,
    register,
)
from .base import PartialGroupWarning  # a row-coupled call given part of a group of its step
from .controllers import AdaptiveEntropy, MuSchedule  # TRL's adaptive entropy coefficient: state across steps
from .core import checks
from .core.aggregate import AGG_MODES, aggregate
from .core.checks import detect_anomaly
from .core.normalizer import Normalizer
from .core.sequence_parallel import SequenceParallel  # sequences split over a sequence/context group
from .core.step_metrics import StepMetrics  # a step's metrics over micro-batches and ranks
from .correction import m2po, proximal, rollout, token_masks
from .correction.gating import Gate  # a rollout correction's rule on probabilities (binary KL, TV, difference)
from .correction.rejection import Rejection
from .correction.rollout import RolloutCorrection
from .from_hidden import loss_from_hidden
from .kl.estimators import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimate, kl_penalized_rewards
from .step import Step  # one optimizer step: counted once, its micro-batches' losses and metrics
from .trainer_options.swift import from_swift  # ms-swift's GRPO arguments as an Algorithm (imports no swift)
from .trainer_options.trl import from_trl  # TRL's GRPOConfig as an Algorithm (imports no trl)
from .trainer_options.verl import from_verl  # verl's actor config as an Algorithm (imports no verl)
from .vocab.chunks import HeadOptions  # an LM head's bias, logit scale and soft-cap: head=, ref_head=, teacher_head=
from .vocab.divergence import divergence_from_hidden, divergence_from_logits
from .vocab.entropy import log_prob_and_entropy
from .vocab.full_kl import full_kl_from_hidden, full_kl_from_logits
from .vocab.fused import log_prob_and_entropy_from_hidden
from .vocab.topk_divergence import (
    student_topk_divergence_from_hidden,
    student_topk_divergence_from_logits,
    topk_divergence_from_hidden,
    topk_divergence_from_logits,
)

try:
    __version__ = version("pgloss")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "AdaptiveEntropy",
    "AdaptiveKLController",
    "AGG_MODES",
    "Algorithm",
    "CEGPPO",
    "CHORD",
    "CISPO",
    "ClipCov",
    "ClippedPolicy",
    "DPPO",
    "DRO",
    "FIPO",
    "FixedKLController",
    "GMPO",
    "GPG",
    "GVPO",
    "HeadOptions",
    "KL_ESTIMATORS",
    "KLCov",
    "LossOutput",
    "LUSPO",
    "MuSchedule",
    "OPD",
    "OPMD",
    "Normalizer",
    "PartialGroupWarning",
    "REAL",
    "REC",
    "Rejection",
    "Gate",
    "RoleBaseline",
    "RolloutCorrection",
    "SAPO",
    "SequenceParallel",
    "SPPO",
    "Step",
    "StepMetrics",
    "TISPG",
    "TOPR",
    "VESPO",
    "advantages",
    "aggregate",
    "checks",
    "detect_anomaly",
    "divergence_from_hidden",
    "divergence_from_logits",
    "families",
    "from_swift",
    "from_trl",
    "from_verl",
    "full_kl_from_hidden",
    "full_kl_from_logits",
    "get",
    "kl",
    "kl_estimate",
    "kl_penalized_rewards",
    "log_prob_and_entropy",
    "log_prob_and_entropy_from_hidden",
    "loss_from_hidden",
    "m2po",
    "names",
    "proximal",
    "recipe",
    "register",
    "rollout",
    "student_topk_divergence_from_hidden",
    "student_topk_divergence_from_logits",
    "token_masks",
    "topk_divergence_from_hidden",
    "topk_divergence_from_logits",
]
