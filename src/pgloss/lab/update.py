"""One step's update: ``epochs`` passes over the batch, each cut into ``minibatches`` optimizer steps of whole
groups, each step made of ``micro_batches`` combined by one ``pgloss.Normalizer`` (counted over the step's
micro-batches and all ranks). Ratios move away from one after the first optimizer step, so clipping matters.
The diagnostics it returns (clip fraction with its high/low split, ppo_kl, gradient norm and the share of
clipped gradients, the rollout correction's) are tensors; ``trainer.train`` turns them into numbers once per step.
"""

from __future__ import annotations

import torch
from torch import Tensor

import pgloss

from ..core.metrics import Stat
from . import distributed as dist
from .batch import Batch
from .config import LabConfig
from .sampling import response_log_probs

# the rollout correction's metrics, recorded when the loss sees rollout log-probs (a simulated mismatch)
ROLLOUT_METRICS = (
    "rollout_kl",
    "rollout_k3_kl",
    "rollout_chi2_token",
    "rollout_ppl_ratio",
    "rollout_is_weight_mean",
    "rollout_is_weight_min",
    "rollout_is_weight_max",
    "rollout_is_ess",
    "rollout_is_bounded_frac",
    "rollout_rejected_frac",
)
# the loss's metric behind each update diagnostic; an algorithm without one (SAPO has no clipping) logs None
LOSS_METRICS = {
    "clip_frac": "pg_clipfrac",
    "clip_frac_high": "pg_clipfrac_high",
    "clip_frac_low": "pg_clipfrac_low",
    "ppo_kl": "ppo_kl",
}
UPDATE_METRICS = (*LOSS_METRICS, "grad_norm", "grad_clipped", "loss", "entropy_coef", *ROLLOUT_METRICS)


def update(
    policy,
    optimizer,
    algorithm,
    batch: Batch,
    cfg: LabConfig,
    n_groups: int,
    generator: torch.Generator,
    scheduler=None,
    entropy_control=None,
) -> dict[str, Tensor]:
    """``epochs`` x ``minibatches`` optimizer steps on one batch; returns each step's diagnostics averaged over the
    steps (the loss's: `pgloss.StepMetrics` over the step's micro-batches and ranks): ``UPDATE_METRICS``, NaN for one
    the algorithm lacks, the ``ROLLOUT_METRICS`` only when the loss saw rollout log-probs, ``entropy_coef`` applied.

    With `entropy_control` (`make_entropy_control`), each optimizer step's loss is the algorithm with the
    controller's applied coefficient, the controller sees the step's entropy under the loss's mask and
    steps once after the optimizer (all ranks together).

    Minibatches, and the micro-batches inside them, are cut from a permutation of the global group
    ids (the same on every rank), so one process and several processes make the same optimizer
    steps and a call always holds whole groups (which losses that couple a group's rows need).
    ``grad_clipped`` is the share of optimizer steps whose gradient norm exceeded ``max_grad_norm``.
    """
    values: dict[str, list[Tensor]] = {k: [] for k in UPDATE_METRICS}

    def add(name: str, value: Tensor) -> None:  # one value per optimizer step; the update's is their mean
        values[name].append(value.detach().float().cpu())

    for _ in range(cfg.epochs):
        order = torch.randperm(n_groups, generator=generator).to(batch.advantages.device)
        for chunk in order.tensor_split(cfg.minibatches):
            micros = [
                batch.select(torch.isin(batch.rollout.group_ids, part).nonzero().squeeze(1))
                for part in chunk.tensor_split(cfg.micro_batches)
            ]
            normalizer = algorithm.step_normalizer(  # it counts the groups and scores when the loss needs them
                [m.rollout.mask for m in micros],
                old_log_probs=[m.old_log_prob for m in micros],
                rollout_log_probs=None if batch.rollout_log_prob is None else [m.rollout_log_prob for m in micros],
                group_ids=[m.rollout.group_ids for m in micros],
                scores=[m.scores for m in micros],
            )
            if float(normalizer.tokens) == 0:  # e.g. DAPO dropped every group of this minibatch
                continue
            optimizer.zero_grad(set_to_none=True)
            step_metrics = pgloss.StepMetrics()  # compute() is a collective: every rank, with or without calls
            loss_fn = algorithm if entropy_control is None else entropy_control.algorithm(algorithm)
            add("entropy_coef", torch.tensor(float(loss_fn.entropy_coef)))
            for micro in micros:
                if micro.advantages.numel() == 0:
                    continue
                log_prob, entropy = response_log_probs(policy, micro.rollout, temperature=cfg.temperature)
                if entropy_control is not None:
                    entropy_control.observe(entropy, micro.rollout.mask)
                out = loss_fn(
                    log_prob=log_prob,
                    old_log_prob=micro.old_log_prob,
                    advantages=micro.advantages,
                    mask=micro.rollout.mask,
                    entropy=entropy,
                    normalizer=normalizer,
                    **micro.inputs(loss_fn),
                )
                out.loss.backward()
                step_metrics.add(out)
                step_metrics.add({"loss": Stat.loss(out.loss)})
            step_values = step_metrics.compute()
            for name, key in (*LOSS_METRICS.items(), *((k, k) for k in ROLLOUT_METRICS), ("loss", "loss")):
                if key in step_values:
                    add(name, step_values[key])
            dist.average_gradients(policy)
            norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
            add("grad_norm", norm)
            add("grad_clipped", norm > cfg.max_grad_norm)
            optimizer.step()
            if entropy_control is not None:
                entropy_control.step(device=batch.advantages.device)
            if scheduler is not None:
                scheduler.step()
    return {
        k: torch.stack(v).nanmean() if v else torch.tensor(float("nan"))  # a metric over no token is NaN
        for k, v in values.items()
        if v or k not in ROLLOUT_METRICS
    }
