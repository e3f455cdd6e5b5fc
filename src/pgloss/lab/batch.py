"""One step's batch: sample a group per prompt, score it, and prepare what the loss reads.

``collect`` samples G completions per prompt at the sampling temperature, scores them (``score``), computes
the group advantages (scaled by the group std unless the name's `pgloss.recipe` says not to) and the old,
reference, teacher and entropy values under no_grad. A simulated mismatched sampler (``sampler_temperature``,
``sampler_noise``: ``trainer.make_sampler``) samples instead of the policy; its log-probs become
``rollout_log_prob``. DAPO's dynamic sampling then refills the batch (``refill``). ``trainer.train`` calls
them once per step; ``update.update`` trains on the `Batch` they make.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

import pgloss

from ..advantages.group import dynamic_sampling_keep, group_advantages
from ..kl.estimators import kl_estimate
from . import distributed as dist
from .config import LabConfig
from .sampling import Rollout, pad_responses, response_log_probs, sample
from .tasks import Problem, reward
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Batch:
    """One step's training data, on this rank."""

    rollout: Rollout
    old_log_prob: Tensor
    """[N, R] log-probabilities of the sampling policy."""
    ref_log_prob: Tensor
    """[N, R] log-probabilities of the frozen reference (the warm-start model)."""
    advantages: Tensor
    """[N] group-relative advantages."""
    scores: Tensor
    """[N] the raw rewards (TOPR splits on their sign)."""
    rollout_log_prob: Tensor | None = None
    """[N, R] log-probabilities of the sampler, when it is not the policy (or a correction is set)."""
    teacher_log_prob: Tensor | None = None
    """[N, R] log-probabilities of the teacher (on-policy distillation); None: the reference is the teacher."""

    def select(self, index: Tensor) -> Batch:
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return Batch(
            self.rollout.select(index),
            self.old_log_prob[index],
            self.ref_log_prob[index],
            self.advantages[index],
            self.scores[index],
            pick(self.rollout_log_prob),
            pick(self.teacher_log_prob),
        )

    def inputs(self, algorithm) -> dict[str, Tensor | None]:
        """The optional inputs of `algorithm`'s call from this batch: those it `needs`, and the sampler's
        log-probs. The teacher (on-policy distillation) is the reference when the run has none of its own."""
        teacher = self.ref_log_prob if self.teacher_log_prob is None else self.teacher_log_prob
        available = dict(
            ref_log_prob=self.ref_log_prob,
            group_ids=self.rollout.group_ids,
            scores=self.scores,
            teacher_log_prob=teacher,
        )
        return {key: value for key, value in available.items() if key in algorithm.needs} | {
            "rollout_log_prob": self.rollout_log_prob
        }

    @staticmethod
    def cat(parts: list[Batch]) -> Batch:
        """The rows of `parts` in order (responses right-padded to the longest)."""

        def padded_optional(values: list[Tensor | None], name: str) -> Tensor | None:
            present = [v for v in values if v is not None]
            if present and len(present) < len(values):
                raise ValueError(f"Batch.cat: {name} is None in some parts only; every part comes from one run")
            return pad_responses(present) if present else None

        return Batch(
            Rollout.cat([b.rollout for b in parts]),
            pad_responses([b.old_log_prob for b in parts]),
            pad_responses([b.ref_log_prob for b in parts]),
            torch.cat([b.advantages for b in parts]),
            torch.cat([b.scores for b in parts]),
            padded_optional([b.rollout_log_prob for b in parts], "rollout_log_prob"),
            padded_optional([b.teacher_log_prob for b in parts], "teacher_log_prob"),
        )


def score(rollout: Rollout, problems: list[Problem], tokenizer: Tokenizer, group_size: int) -> tuple[Tensor, list[str]]:
    """Rewards ``[N]`` (0 for a response cut off before its end token) and the response texts."""
    texts = [tokenizer.decode(row) for row in rollout.responses.tolist()]
    rewards = [
        reward(t, problems[i // group_size]) if done else 0.0
        for i, (t, done) in enumerate(zip(texts, rollout.finished.tolist(), strict=True))
    ]
    return torch.tensor(rewards, device=rollout.tokens.device), texts


@torch.no_grad()
def collect(
    policy,
    reference,
    algorithm,
    problems,
    tokenizer,
    cfg: LabConfig,
    generator: torch.Generator,
    rank: int = 0,
    world: int = 1,
    sampler=None,
    offset: int = 0,
    teacher=None,
) -> tuple[Batch, dict[str, Tensor], list[str]]:
    """Sample, score and prepare one round of a step's batch. This rank holds the round's prompts
    ``rank, rank + world, ...``; group ids are those global prompt indices plus `offset` (distinct
    over a step's refill rounds). `sampler` (the policy when None) samples at ``sampler_temperature``;
    the batch carries its log-probs when it is not the policy or a rollout correction is set, and the
    `teacher`'s when there is one (``kl_teacher``: the reverse KL to it, k3, per token)."""
    sampler = policy if sampler is None else sampler
    temperature = cfg.temperature if cfg.sampler_temperature is None else cfg.sampler_temperature
    prompts = [tokenizer.encode(p.prompt) for p in problems]
    rollout = sample(
        sampler,
        prompts,
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=temperature,
        generator=generator,
    )
    rollout = Rollout(
        rollout.tokens,
        rollout.valid,
        rollout.prompt_len,
        rollout.mask,
        rollout.finished,
        rollout.group_ids * world + rank + offset,
    )
    rewards, texts = score(rollout, problems, tokenizer, cfg.group_size)
    old_log_prob, entropy = response_log_probs(policy, rollout, temperature=cfg.temperature)
    ref_log_prob, _ = response_log_probs(reference, rollout, temperature=cfg.temperature)
    teacher_log_prob = None if teacher is None else response_log_probs(teacher, rollout, temperature=cfg.temperature)[0]
    rollout_log_prob = None
    if sampler is not policy or temperature != cfg.temperature:
        rollout_log_prob = response_log_probs(sampler, rollout, temperature=temperature)[0]
    elif algorithm.rollout_use == "correction":  # the sampler is the policy: weight 1, no mismatch
        rollout_log_prob = old_log_prob
    advantages = cfg.reward_coef * group_advantages(
        rewards, rollout.group_ids, scale=pgloss.recipe(algorithm.name).scale_rewards
    )
    batch = Batch(rollout, old_log_prob, ref_log_prob, advantages, rewards, rollout_log_prob, teacher_log_prob)
    mask = rollout.mask.float()
    tokens = mask.sum()
    scratch = rollout.responses[:, 0] != tokenizer.stoi["|"]  # the response writes a scratchpad
    stats = {
        "reward": rewards.mean(),
        "length": tokens / mask.shape[0],
        "entropy": (entropy * mask).sum() / tokens,
        "kl_ref": (kl_estimate(old_log_prob, ref_log_prob, "k3") * mask).sum() / tokens,
        "kl_teacher": (
            kl_estimate(old_log_prob, ref_log_prob if teacher_log_prob is None else teacher_log_prob, "k3") * mask
        ).sum()
        / tokens,
        "scratchpad": scratch.float().mean(),
        "reward_scratchpad": rewards[scratch].mean(),  # NaN (None in the record) when no response has one
        "reward_direct": rewards[~scratch].mean(),
    }
    return batch, stats, texts


def refill(batch: Batch, draw, n_groups: int, max_rounds: int) -> tuple[Batch, dict[str, Tensor]]:
    """DAPO's dynamic sampling with refill (Yu et al. 2025, Algorithm 1): drop the groups whose rewards
    are all equal and, while fewer than `n_groups` groups remain, call ``draw(round)`` for a fresh
    round of `n_groups` prompts (group ids offset by ``round * n_groups``), at most `max_rounds` times.

    The kept groups are counted over all ranks, so every rank makes the same rounds; the batch keeps
    the first `n_groups` of them in global id order, renumbered ``0 .. K-1`` (K <= n_groups) on every
    rank alike. Stats: ``sampled_groups`` (all rounds), ``groups`` (K) and ``kept`` (K / sampled)."""
    parts = [batch.select(dynamic_sampling_keep(batch.scores, batch.rollout.group_ids))]

    def kept_ids() -> Tensor:  # global ids of the kept groups, identical on every rank
        flags = torch.zeros(len(parts) * n_groups)
        for part in parts:
            flags[part.rollout.group_ids.cpu()] = 1.0
        return dist.total(flags).nonzero().squeeze(1)

    kept = kept_ids()
    while len(kept) < n_groups and len(parts) <= max_rounds:
        fresh = draw(len(parts))
        parts.append(fresh.select(dynamic_sampling_keep(fresh.scores, fresh.rollout.group_ids)))
        kept = kept_ids()
    chosen = kept[:n_groups]
    new_id = torch.full((len(parts) * n_groups,), -1, dtype=torch.long)
    new_id[chosen] = torch.arange(len(chosen))
    batch = Batch.cat(parts)
    ids = new_id[batch.rollout.group_ids.cpu()].to(batch.rollout.group_ids.device)
    batch = batch.select((ids >= 0).nonzero().squeeze(1))
    r = batch.rollout
    batch = dataclasses.replace(
        batch, rollout=Rollout(r.tokens, r.valid, r.prompt_len, r.mask, r.finished, ids[ids >= 0])
    )
    sampled = len(parts) * n_groups
    return batch, {
        "sampled_groups": torch.tensor(float(sampled)),
        "groups": torch.tensor(float(len(chosen))),
        "kept": torch.tensor(len(chosen) / sampled),
    }
