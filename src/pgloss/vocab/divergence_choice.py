"""Which student-teacher divergence a call of `divergence_from_logits` / `divergence_from_hidden` computes: the one
owner of the choice and of its parameters' checks (`choose`).

    divergence="forward"          KL(p_T‖p_S)
    divergence="reverse"          KL(p_S‖p_T)
    divergence="jsd", beta=β      JSD(β) = β KL(p_T‖m) + (1 − β) KL(p_S‖m), m = β p_T + (1 − β) p_S (0 and 1: the ends)
    divergence="skewed_forward"   KL(p_T‖λ p_T + (1 − λ) p_S), skew=λ (default 0.1)
    divergence="skewed_reverse"   KL(p_S‖λ p_S + (1 − λ) p_T), skew=λ (default 0.1)
    divergence="adaptive"         AKL: the head-tail weighted sum of the forward and reverse KL, mu=μ (default 0.5)

`beta=` alone (no `divergence=`) keeps its earlier meaning: β = 0 forward, β = 1 reverse, between JSD(β). Each
parameter belongs to its divergences and is refused with any other.
"""

from __future__ import annotations

from typing import NamedTuple

from ..core.checks import check_number

__all__ = ["DIVERGENCES", "Choice", "choose", "check_beta", "check_skew", "check_mu"]

DIVERGENCES = ("forward", "reverse", "jsd", "skewed_forward", "skewed_reverse", "adaptive")
SKEWED = ("skewed_forward", "skewed_reverse")
DEFAULT_SKEW = 0.1  # DistiLLM's α (arXiv 2402.03898) and ROLL's `skew_lambda` default
DEFAULT_MU = 0.5  # AKL's μ (arXiv 2404.02657) and ROLL's `adaptive_kl_alpha` default (α = 1 − μ, the same at 0.5)


class Choice(NamedTuple):
    """A resolved choice: the divergence's name, and its parameter (β of "jsd", λ of the skewed KLs, μ of "adaptive";
    None for the others)."""

    name: str
    beta: float | None = None
    skew: float | None = None
    mu: float | None = None


def check_beta(beta: object) -> float:
    """β as a float in [0, 1]: TypeError for a non-number, ValueError outside the interval."""
    beta = check_number("beta", beta)
    if not 0.0 <= beta <= 1.0:
        raise ValueError(
            f"beta must be in [0, 1] (0: forward KL(teacher‖student), 1: reverse KL(student‖teacher), "
            f"between: the generalised JSD), got {beta}"
        )
    return beta


def check_skew(skew: object) -> float:
    """λ of the skewed KLs as a float in (0, 1): at 0 they are the plain forward and reverse KL (name those), at 1
    they are 0."""
    skew = check_number("skew", skew)
    if not 0.0 < skew < 1.0:
        raise ValueError(
            f"skew must be in (0, 1) (the weight of the first distribution in the skewed mixture; 0 is the plain "
            f'KL: divergence="forward" or "reverse"), got {skew}'
        )
    return skew


def check_mu(mu: object) -> float:
    """μ of AKL as a float in (0, 1): the teacher's mass that its head reaches."""
    mu = check_number("mu", mu)
    if not 0.0 < mu < 1.0:
        raise ValueError(f"mu must be in (0, 1) (the teacher's cumulative mass its head reaches), got {mu}")
    return mu


def choose(divergence: object, beta: object, skew: object, mu: object) -> Choice:
    """The divergence named by the keywords of a call (module docstring), each parameter checked; ValueError for a
    parameter given to a divergence that does not take it, TypeError / ValueError naming a bad one."""
    if divergence is None:
        if beta is None:
            raise TypeError(
                f"beta must be a real number in [0, 1] (the JSD(β) family), got None; or pass divergence= (one of "
                f"{DIVERGENCES})"
            )
        divergence = "jsd"
    if not isinstance(divergence, str):
        raise TypeError(f"divergence must be a str, one of {DIVERGENCES}, got {type(divergence).__name__}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    takes = {"beta": divergence == "jsd", "skew": divergence in SKEWED, "mu": divergence == "adaptive"}
    for name, value in (("beta", beta), ("skew", skew), ("mu", mu)):
        if value is not None and not takes[name]:
            raise ValueError(f"{name} does not apply to divergence={divergence!r}")
    if divergence == "jsd":
        if beta is None:
            raise ValueError('divergence="jsd" needs beta= in [0, 1]')
        beta = check_beta(beta)
        return Choice("forward" if beta == 0.0 else "reverse" if beta == 1.0 else "jsd", beta=beta)
    if divergence in SKEWED:
        return Choice(divergence, skew=check_skew(DEFAULT_SKEW if skew is None else skew))
    if divergence == "adaptive":
        return Choice(divergence, mu=check_mu(DEFAULT_MU if mu is None else mu))
    return Choice(divergence)
