"""pgloss against verl's own loss functions, case by case (the verl part of `pgloss conformance`).

For every verl policy loss pgloss also computes (`pgloss.trainer_options.verl.LOSS_MODES`: vanilla, gspo, sapo,
cispo, gpg, clip_cov, kl_cov, geo_mean, dro, dppo_tv, dppo_kl) and each of verl's five
`loss_agg_mode`s, on a random float64 batch: verl's `core_algos.compute_policy_loss_<mode>` (with
its `agg_loss`) against the algorithm `pgloss.from_verl` gives for the same `ActorConfig`, loss
value and gradient with respect to the log-probs. Then pgloss's `gspo` (the sequence form) against
verl's `gspo`, and verl's KL estimators (`core_algos.kl_penalty`, every `kl_loss_type`) against
pgloss's KL term (`kl_variants.kl_term`). verl is imported only when `cases()` runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from ..core.aggregate import AGG_MODES
from ..core.trainer_names import translate_value
from ..kl.corrections import kl_term
from ..trainer_options.verl import LOSS_MODES, from_verl
from .case import Case, flat_grad

__all__ = ["TRAINER", "available", "cases"]

TRAINER = "verl"
TOLERANCE = 1e-7
"""Relative, float64: verl divides a sequence's sum by |y| + 1e-8 (seq-mean-token-mean, geo_mean), a
relative 1e-8/|y| from the exact mean (measured up to 3e-8); everything else agrees to 1e-12."""
ROWS, LENGTH, BUDGET = 6, 9, 12
VERL_AGG_MODES = tuple(mode for mode in AGG_MODES if mode not in ("group-mean-token-mean", "delta-l-norm"))
POLICY_LOSS_KEYS = ("dro_beta", "ppo_kl_coef", "kl_cov_ratio", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")

FIELDS: dict[str, dict[str, Any]] = {  # each verl loss with its fields set away from the defaults
    "vanilla": dict(clip_ratio_low=0.1, clip_ratio_high=0.28, clip_ratio_c=2.0),
    "gspo": dict(clip_ratio_low=0.1, clip_ratio_high=0.2),
    "sapo": dict(tau_pos=1.3, tau_neg=2.0),
    "cispo": dict(clip_ratio_low=0.5, clip_ratio_high=0.1),
    "gpg": dict(),
    # k = N: every candidate is detached, so the draw (verl's randperm, pgloss's keys) does not enter
    "clip_cov": dict(clip_cov_ratio=1.0, clip_cov_lb=-0.5, clip_cov_ub=2.0, clip_ratio_high=0.1),
    "kl_cov": dict(ppo_kl_coef=1.0, kl_cov_ratio=0.5),
    "geo_mean": dict(clip_ratio_low=0.1, clip_ratio_high=0.15),
    "dro": dict(dro_beta=0.05),
    "dppo_tv": dict(clip_ratio_c=1.5, clip_ratio_low=0.05, clip_ratio_high=0.1),
    "dppo_kl": dict(clip_ratio_c=1.2, clip_ratio_low=0.02, clip_ratio_high=0.05),
}
KL_TYPES = (
    "kl",
    "k1",
    "abs",
    "mse",
    "k2",
    "low_var_kl",
    "k3",
    "kl+",
    "k1+",
    "abs+",
    "mse+",
    "k2+",
    "low_var_kl+",
    "k3+",
)

EMPTY_ROW = (
    "verl's geo_mean takes torch.mean over a micro-batch's rows, empty ones included; pgloss's gmpo "
    "averages over the non-empty sequences (docs/reference.md, 'Where the frameworks disagree': "
    "GMPO's reduction)"
)


def available() -> str | None:
    """None when verl's loss functions can be imported, else why not (the runner's interface)."""
    try:
        found = version("verl")
    except PackageNotFoundError:
        return "verl is not installed"
    try:
        from verl.trainer.ppo import core_algos  # noqa: F401
    except Exception as error:
        return f"verl {found} cannot be imported ({type(error).__name__}: {error})"
    return None


def _batch(seed: int, *, empty_row: bool = False) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, LENGTH + 1, (ROWS,), generator=gen)
    if empty_row:
        lengths[2] = 0
    mask = torch.arange(LENGTH)[None, :] < lengths[:, None]
    old = -torch.rand(ROWS, LENGTH, generator=gen, dtype=torch.float64) * 2 - 0.1
    log_prob = -(old + 0.3 * torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64)).abs()  # <= 0
    ref = -(old + 0.4 * torch.randn(ROWS, LENGTH, generator=gen, dtype=torch.float64)).abs()
    advantages = torch.randn(ROWS, 1, generator=gen, dtype=torch.float64).expand(ROWS, LENGTH).clone()
    return dict(log_prob=log_prob, old=old, ref=ref, advantages=advantages, mask=mask)


def _errors(
    ours: torch.Tensor, theirs: torch.Tensor, our_grad: torch.Tensor, their_grad: torch.Tensor
) -> tuple[float, float]:
    loss = abs(float(ours - theirs)) / max(abs(float(theirs)), 1e-12)
    grad = float((our_grad - their_grad).norm()) / max(float(their_grad.norm()), 1e-12)
    return loss, grad


def _config(loss_mode: str, fields: dict[str, Any], loss_agg_mode: str) -> Any:
    from verl.workers.config import ActorConfig, PolicyLossConfig

    fields = dict(fields)
    policy = {key: fields.pop(key) for key in POLICY_LOSS_KEYS if key in fields}
    config = ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        loss_agg_mode=loss_agg_mode,
        loss_scale_factor=BUDGET,
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, **policy),
        **fields,
    )
    config.global_batch_info["loss_scale_factor"] = BUDGET  # as verl's ppo_loss sets it
    return config


def _policy_case(mode: str, agg: str, seed: int, *, name: str | None = None, empty_row: bool = False) -> Case:
    from verl.trainer.ppo import core_algos

    config = _config(mode, FIELDS[mode], agg)
    algorithm = from_verl(config)
    if name is not None:  # another pgloss name for the same loss (gspo's sequence form)
        import dataclasses

        from ..algorithms import get

        algorithm = get(
            name,
            **{
                f.name: getattr(algorithm, f.name)
                for f in dataclasses.fields(algorithm)
                if f.name not in ("name", "ratio_level")
            },
        )
    batch = _batch(seed, empty_row=empty_row)
    theirs_leaf = batch["log_prob"].clone().requires_grad_()
    torch.manual_seed(seed)  # clip_cov's draw: the same generator state for both
    theirs, _ = getattr(core_algos, f"compute_policy_loss_{mode}")(
        batch["old"], theirs_leaf, batch["advantages"], batch["mask"].double(), agg, config
    )
    theirs.backward()
    ours_leaf = batch["log_prob"].clone().requires_grad_()
    torch.manual_seed(seed)
    ours = algorithm(
        log_prob=ours_leaf, old_log_prob=batch["old"], advantages=batch["advantages"], mask=batch["mask"]
    ).loss
    ours.backward()
    loss_error, grad_error = _errors(ours.detach(), theirs.detach(), flat_grad(ours_leaf), flat_grad(theirs_leaf))
    fields = ", ".join(f"{k}={v}" for k, v in FIELDS[mode].items())
    setting = f"loss_agg_mode={agg}" + (f", {fields}" if fields else "") + (", an empty row" if empty_row else "")
    return Case(
        TRAINER,
        f"compute_policy_loss_{mode}",
        algorithm.name,
        setting,
        loss_error,
        grad_error,
        TOLERANCE,
        reason=EMPTY_ROW if empty_row and mode == "geo_mean" else None,
    )


def _kl_case(kind: str, seed: int) -> Case:
    from verl.trainer.ppo import core_algos

    batch = _batch(seed)
    mask = batch["mask"]
    estimator = str(translate_value("kl_estimator", kind))  # a str for a str
    theirs_leaf = batch["log_prob"].clone().requires_grad_()
    # verl annotates torch.FloatTensor, the legacy type name, which a float64 tensor satisfies at runtime
    per_token = core_algos.kl_penalty(theirs_leaf, batch["ref"], kind)  # type: ignore[arg-type]
    theirs = (per_token * mask).sum() / mask.sum()
    theirs.backward()
    ours_leaf = batch["log_prob"].clone().requires_grad_()
    ours = kl_term(ours_leaf, batch["ref"], batch["old"], estimator=estimator)
    ours = torch.where(mask, ours, 0.0).sum() / mask.sum()
    ours.backward()
    loss_error, grad_error = _errors(ours.detach(), theirs.detach(), flat_grad(ours_leaf), flat_grad(theirs_leaf))
    return Case(
        TRAINER, "kl_penalty", f"kl_estimator={estimator}", f"kl_penalty={kind}", loss_error, grad_error, TOLERANCE
    )


def cases() -> Iterator[Case]:
    """Every case: each verl policy loss under each loss_agg_mode, gspo's sequence form, verl's
    geo_mean with an empty row, and each KL estimator."""
    for index, mode in enumerate(FIELDS):
        for offset, agg in enumerate(VERL_AGG_MODES):
            yield _policy_case(mode, agg, seed=10 * index + offset)
    yield _policy_case("gspo", "seq-mean-token-mean", seed=3, name="gspo")
    yield _policy_case("geo_mean", "token-mean", seed=4, empty_row=True)
    for index, kind in enumerate(KL_TYPES):
        yield _kl_case(kind, seed=100 + index)


assert set(FIELDS) == set(LOSS_MODES), "every verl loss pgloss computes has a conformance case"
