"""KL between the policy and a reference: the per-token estimators and the reward penalty with its
controllers (`estimators`), and the KL loss term with its gradient corrections (`corrections`)."""

from .estimators import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_estimate, kl_penalized_rewards

__all__ = ["KL_ESTIMATORS", "AdaptiveKLController", "FixedKLController", "kl_estimate", "kl_penalized_rewards"]
