"""The RL loop: sample a group per prompt, score it, update with a pgloss loss, log diagnostics.

Read top to bottom:

1. ``build``: tokenizer, task and a seeded tiny transformer.
2. ``warm_start``: a short supervised phase on demonstrations (with and without scratchpad),
   so that RL starts above zero reward.
3. ``collect``: G completions per prompt at the sampling temperature; rewards; group
   advantages (scaled by the group std unless the name's `pgloss.recipe` says not to); old, reference and
   entropy values under no_grad. A simulated mismatched sampler (``sampler_temperature``,
   ``sampler_noise``) samples instead of the policy; its log-probs become ``rollout_log_prob``.
   DAPO's dynamic sampling then refills the batch (``refill``).
4. ``update``: ``epochs`` passes over the batch, each cut into ``minibatches`` optimizer steps
   of whole groups, each step made of ``micro_batches`` combined by one ``pgloss.Normalizer``
   (counted over the step's micro-batches and all ranks). Ratios move away from one after the
   first optimizer step, so clipping matters.
5. ``train``: the loop, yielding one dict of numbers per step (the diagnostics that "an article
   on the components of PG losses in verl's conventions" tells you to watch: reward, greedy
   accuracy, response length, entropy, KL to the reference, clip fraction with its high/low
   split, ppo_kl, gradient norm and the share of clipped gradients). Every diagnostic is a
   tensor until the single ``tolist`` of the step.

On-policy distillation (``opd``, ``iw_opd``) reads the teacher's log-probs of the sampled tokens: those
of ``train(..., teacher_state=...)``'s teacher (a lab policy's state dict, e.g. one trained by GRPO, of
the student's shape or of ``teacher_cfg``'s, a wider or deeper model), or of the reference, the
warm-start model, without one; the group advantages ride along, weighted by
``reward_coef`` (0: pure distillation).

PPO in the papers learns a critic and uses GAE; the lab has no critic and gives ``ppo`` and
``dual_clip_ppo`` the same group advantages as the GRPO family (one reward per response).
DAPO's dynamic sampling drops the groups whose rewards are all equal and refills the batch with
fresh prompts, up to ``max_refill_rounds`` extra rounds (``refill``; none by default); a response
that is cut off at ``max_new_tokens`` gets reward 0 for every algorithm.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
from dataclasses import dataclass

import torch
from torch import Tensor

import pgloss

from ..advantages.group import dynamic_sampling_keep, group_advantages
from ..core.metrics import Stat
from ..kl.estimators import kl_estimate
from . import checkpoint as checkpoints
from . import distributed as dist
from .config import LabConfig
from .model import ModelConfig, TinyGPT
from .sampling import Rollout, pad_responses, response_log_probs, sample, teacher_forced
from .spec import parse_rollout_correction, parse_spec
from .tasks import Problem, demonstration, make_task, reward, taught
from .tokenizer import Tokenizer

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
METRICS = (
    "reward",
    "accuracy",
    "length",
    "entropy",
    "kl_ref",
    "kl_teacher",
    "clip_frac",
    "clip_frac_high",
    "clip_frac_low",
    "ppo_kl",
    "grad_norm",
    "grad_clipped",
    "entropy_coef",
    "scratchpad",
    "reward_scratchpad",
    "reward_direct",
    "kept",
    "loss",
    "eval_reward",
    "sampled_groups",
    "groups",
    *ROLLOUT_METRICS,
)
"""Every metric a lab run records per step, in the order of the history file."""


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

        def padded(name: str) -> Tensor | None:
            return None if getattr(parts[0], name) is None else pad_responses([getattr(b, name) for b in parts])

        return Batch(
            Rollout.cat([b.rollout for b in parts]),
            padded("old_log_prob"),
            padded("ref_log_prob"),
            torch.cat([b.advantages for b in parts]),
            torch.cat([b.scores for b in parts]),
            padded("rollout_log_prob"),
            padded("teacher_log_prob"),
        )


def make_algorithm(cfg: LabConfig):
    """The pgloss algorithm of ``cfg.algorithm`` (a spec: ``dapo`` or ``dapo:clip_high=0.3``) with the
    rollout correction of ``cfg.rollout_correction`` and the entropy bonus ``cfg.entropy_coef`` (unless the
    spec sets its own); Dr.GRPO's constant divisor is the response budget unless the spec sets ``norm_constant``."""
    spec = parse_spec(cfg.algorithm)
    if cfg.entropy_coef is not None:
        spec = spec.with_args({"entropy_coef": cfg.entropy_coef})  # the spec's own setting wins
    return spec.build(cfg.max_new_tokens, parse_rollout_correction(cfg.rollout_correction))


def make_entropy_control(cfg: LabConfig, algorithm) -> pgloss.AdaptiveEntropy | None:
    """The run's entropy controller: with ``cfg.target_entropy``, a `pgloss.AdaptiveEntropy` that starts
    from `algorithm`'s entropy coefficient and moves it by ``entropy_coef_delta`` per optimizer step
    toward keeping the entropy at the target (applied only while the entropy is at or below it); None
    (the algorithm's fixed coefficient) without one."""
    if cfg.target_entropy is None:
        return None
    return pgloss.AdaptiveEntropy(
        coef=min(algorithm.entropy_coef, cfg.entropy_coef_max),
        target=cfg.target_entropy,
        delta=cfg.entropy_coef_delta,
        coef_max=cfg.entropy_coef_max,
    )


def make_sampler(policy, cfg: LabConfig, step: int):
    """The model that samples step `step`'s rollouts: the policy itself, or (``sampler_noise`` > 0) a
    copy whose every weight w becomes w (1 + sampler_noise ε), ε ~ N(0, 1), drawn from a generator
    seeded by (seed, step), so every rank perturbs alike."""
    if cfg.sampler_noise == 0:
        return policy
    sampler = copy.deepcopy(policy).requires_grad_(False)
    generator = torch.Generator().manual_seed(cfg.seed * 100_003 + step)
    with torch.no_grad():
        for p in sampler.parameters():
            p.mul_(1 + cfg.sampler_noise * torch.randn(p.shape, generator=generator).to(p.device))
    return sampler


def build(cfg: LabConfig):
    """Tokenizer, task and a freshly initialised policy (seeded by ``cfg.seed``)."""
    tokenizer, task = Tokenizer(), make_task(cfg.task)
    torch.manual_seed(cfg.seed)
    longest_prompt = 2 * max(getattr(task, "max_terms", 2), 2) + 1
    model_cfg = ModelConfig(
        tokenizer.vocab_size,
        block_size=longest_prompt + 1 + cfg.max_new_tokens,
        d_model=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
    )
    return tokenizer, task, TinyGPT(model_cfg).to(cfg.device)


def warm_start(model: TinyGPT, task, tokenizer: Tokenizer, cfg: LabConfig, on_step=None) -> float:
    """Supervised steps on demonstrations (scratchpad with probability ``scratchpad_prob``);
    returns the last loss, the mean negative log-likelihood of the tokens each demonstration teaches
    (`tasks.taught`, and its end token). Deterministic given ``cfg.seed``; ``on_step(step)`` is called
    after each step (``lab/warm.py`` caches the result)."""
    rng = random.Random(f"warm-{cfg.seed}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.warm_lr)
    loss = torch.tensor(float("nan"))
    for step in range(cfg.warm_steps):
        problems = [task.sample(rng) for _ in range(cfg.warm_batch)]
        answers = [demonstration(p, rng.random() < cfg.scratchpad_prob) for p in problems]
        batch = teacher_forced(
            [tokenizer.encode(p.prompt) for p in problems], [tokenizer.encode(a) for a in answers], cfg.device
        )
        for group in optimizer.param_groups:  # cosine decay to zero
            group["lr"] = cfg.warm_lr * 0.5 * (1 + math.cos(math.pi * step / cfg.warm_steps))
        log_prob, _ = response_log_probs(model, batch, temperature=1.0)
        weights = torch.zeros(batch.mask.shape, dtype=torch.bool)
        for i, (p, a) in enumerate(zip(problems, answers)):
            weights[i, : len(a) + 1] = torch.tensor(taught(p, a) + [True])  # the end token is always taught
        weights = weights.to(cfg.device)
        loss = -(log_prob * weights).sum() / weights.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step)
    return float(loss.detach())


def score(rollout: Rollout, problems: list[Problem], tokenizer: Tokenizer, group_size: int) -> tuple[Tensor, list[str]]:
    """Rewards ``[N]`` (0 for a response cut off before its end token) and the response texts."""
    texts = [tokenizer.decode(row) for row in rollout.responses.tolist()]
    rewards = [
        reward(t, problems[i // group_size]) if done else 0.0
        for i, (t, done) in enumerate(zip(texts, rollout.finished.tolist()))
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


def eval_problems(task, cfg: LabConfig) -> list[Problem]:
    """The run's fixed held-out prompts (``eval_prompts`` of them, seeded by ``cfg.seed``)."""
    rng = random.Random(f"eval-{cfg.seed}")
    return [task.sample(rng) for _ in range(cfg.eval_prompts)]


@torch.no_grad()
def greedy_accuracy(policy, problems: list[Problem], tokenizer: Tokenizer, cfg: LabConfig) -> Tensor:
    """Share of `problems` answered right by greedy decoding."""
    rollout = sample(
        policy,
        [tokenizer.encode(p.prompt) for p in problems],
        group_size=1,
        max_new_tokens=cfg.max_new_tokens,
        temperature=0.0,
    )
    return score(rollout, problems, tokenizer, 1)[0].mean()


@torch.no_grad()
def sampled_reward(policy, problems: list[Problem], tokenizer: Tokenizer, cfg: LabConfig) -> Tensor:
    """Mean reward of ``group_size`` sampled completions of each of `problems`, drawn with a
    fixed generator, so that the start and the end of a run are measured alike."""
    rollout = sample(
        policy,
        [tokenizer.encode(p.prompt) for p in problems],
        group_size=cfg.group_size,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        generator=torch.Generator(cfg.device).manual_seed(cfg.seed + 1),
    )
    return score(rollout, problems, tokenizer, cfg.group_size)[0].mean()


@torch.no_grad()
def show(policy, problems: list[Problem], tokenizer: Tokenizer, cfg: LabConfig) -> list[tuple[str, str, float]]:
    """One sampled completion per problem, with a fixed generator: (prompt, response, reward)."""
    rollout = sample(
        policy,
        [tokenizer.encode(p.prompt) for p in problems],
        group_size=1,
        max_new_tokens=cfg.max_new_tokens,
        temperature=cfg.temperature,
        generator=torch.Generator(cfg.device).manual_seed(cfg.seed),
    )
    rewards, texts = score(rollout, problems, tokenizer, 1)
    return [
        (p.prompt, t + ("" if done else " ..."), r)
        for p, t, done, r in zip(problems, texts, rollout.finished.tolist(), rewards.tolist())
    ]


def teacher_model(cfg: LabConfig, teacher_cfg: LabConfig, state: dict) -> TinyGPT:
    """The teacher of a run of `cfg`: a model of `teacher_cfg`'s width, depth and heads (on `cfg`'s task and
    positions) holding `state`, frozen, built without moving the run's random numbers."""
    shape = dataclasses.replace(
        cfg, d_model=teacher_cfg.d_model, n_layer=teacher_cfg.n_layer, n_head=teacher_cfg.n_head
    )
    with torch.random.fork_rng():
        teacher = build(shape)[2]
    try:
        teacher.load_state_dict(state)
    except RuntimeError as error:  # another width, depth or vocabulary
        raise ValueError(
            f"teacher_state does not fit the teacher's model ({shape.d_model} wide, {shape.n_layer} "
            f"layers; pass teacher_cfg for another shape): {str(error).splitlines()[0]}"
        ) from None
    return teacher.requires_grad_(False)


def train(
    cfg: LabConfig,
    warm_state: dict | None = None,
    on_step=None,
    on_rollout=None,
    teacher_state: dict | None = None,
    teacher_cfg: LabConfig | None = None,
    checkpoint=None,
) -> dict:
    """Run ``cfg.steps`` RL steps; returns {"metrics": [per-step dicts], "samples": {...}, "state": the
    final policy's state dict (a teacher for another run, `teacher_state`)}.

    Step k's record holds the rollout of the policy before update k and that update's
    diagnostics; the record of step ``cfg.steps`` measures the final policy (no update, so its
    update diagnostics are None, as are those of a step whose every group DAPO dropped).

    `warm_state` is a warm-started policy's state dict (computed here when None); `teacher_state` a
    lab policy's state dict whose log-probs the loss reads as its teacher's (on-policy distillation;
    None: the reference is the teacher), of `teacher_cfg`'s model shape (d_model, n_layer, n_head;
    None: the student's); `on_step`
    is called after each step. Under torchrun every rank takes every world-size-th prompt.
    `on_rollout(step, problems, texts)`, if given, sees each step's sampled responses (this rank's
    problems and the decoded texts, ``group_size`` per problem, before any dynamic sampling; DAPO's
    refill rounds are not shown).

    `checkpoint` (a path; ``lab/checkpoint.py``) is saved after every step's ``on_step``; when it exists, the run
    continues after its step (`warm_state` is then not read; ``on_step`` sees the new steps only) and returns
    what an uninterrupted run returns. Single process only (under torchrun each rank has its own generator).
    """
    torch.set_num_threads(cfg.threads)
    rank, world = dist.rank(), dist.world_size()
    tokenizer, task, policy = build(cfg)
    saved = None if checkpoint is None else checkpoints.load(checkpoint, cfg)
    if saved is not None:
        policy.load_state_dict(saved["reference"])
    elif warm_state is None:
        warm_start(policy, task, tokenizer, cfg)
    else:
        policy.load_state_dict(warm_state)
    dist.broadcast_parameters(policy)
    reference = copy.deepcopy(policy).requires_grad_(False)
    teacher = None if teacher_state is None else teacher_model(cfg, teacher_cfg or cfg, teacher_state)
    algorithm = make_algorithm(cfg)
    entropy_control = make_entropy_control(cfg, algorithm)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, weight_decay=0.0)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: min(1.0, (k + 1) / max(1, cfg.warmup)))
    prompt_rng = random.Random(f"prompts-{cfg.seed}")
    eval_set = eval_problems(task, cfg)
    generator = torch.Generator(cfg.device).manual_seed(cfg.seed * 1009 + rank)
    shuffle = torch.Generator().manual_seed(cfg.seed)
    refill_rng = random.Random(f"refill-{cfg.seed}")  # refill prompts leave the step prompts of other algorithms alike
    samples, metrics, first = {}, [], 0
    if saved is not None:  # continue after the checkpoint's step, every state as it was then
        policy.load_state_dict(saved["policy"])
        optimizer.load_state_dict(saved["optimizer"])
        warmup.load_state_dict(saved["scheduler"])
        prompt_rng.setstate(saved["prompt_rng"])
        refill_rng.setstate(saved["refill_rng"])
        generator.set_state(saved["generator"])
        shuffle.set_state(saved["shuffle"])
        torch.set_rng_state(saved["torch_rng"])
        if entropy_control is not None:
            entropy_control.load_state_dict(saved["entropy_control"])
        samples, metrics, first = saved["samples"], saved["metrics"], saved["step"] + 1
    for step in range(first, cfg.steps + 1):  # the last pass only measures the final policy
        problems = [task.sample(prompt_rng) for _ in range(cfg.prompts_per_step)]
        mine = problems[rank::world]
        sampler = make_sampler(policy, cfg, step)
        batch, stats, texts = collect(
            policy, reference, algorithm, mine, tokenizer, cfg, generator, rank, world, sampler, teacher=teacher
        )
        if on_rollout is not None:
            on_rollout(step, mine, texts)
        n_groups = cfg.prompts_per_step
        stats |= {
            "sampled_groups": torch.tensor(float(n_groups)),
            "groups": torch.tensor(float(n_groups)),
            "kept": torch.tensor(1.0),
        }
        if pgloss.recipe(algorithm.name).dynamic_sampling:

            def draw(round_: int) -> Batch:
                fresh = [task.sample(refill_rng) for _ in range(cfg.prompts_per_step)][rank::world]
                return collect(
                    policy,
                    reference,
                    algorithm,
                    fresh,
                    tokenizer,
                    cfg,
                    generator,
                    rank,
                    world,
                    sampler,
                    offset=round_ * cfg.prompts_per_step,
                    teacher=teacher,
                )[0]

            batch, counts = refill(batch, draw, cfg.prompts_per_step, cfg.max_refill_rounds)
            stats.update(counts)
            n_groups = int(counts["groups"])
        stats["accuracy"] = greedy_accuracy(policy, eval_set, tokenizer, cfg)
        if step in (0, cfg.steps):
            samples["start" if step == 0 else "end"] = show(policy, eval_set[: cfg.samples], tokenizer, cfg)
            stats["eval_reward"] = sampled_reward(policy, eval_set, tokenizer, cfg)
        if step < cfg.steps:
            stats.update(update(policy, optimizer, algorithm, batch, cfg, n_groups, shuffle, warmup, entropy_control))
        values = dist.mean(torch.stack([stats.get(k, torch.tensor(float("nan"))).float().cpu() for k in METRICS]))
        record = {
            "algorithm": cfg.algorithm,
            "seed": cfg.seed,
            "step": step,
            **{k: None if math.isnan(v) else v for k, v in zip(METRICS, values.tolist())},
        }
        metrics.append(record)
        if on_step is not None:
            on_step(record)
        if checkpoint is not None:
            checkpoints.save(
                checkpoint,
                {
                    "config": dataclasses.asdict(cfg),
                    "step": step,
                    "metrics": metrics,
                    "samples": samples,
                    "policy": policy.state_dict(),
                    "reference": reference.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": warmup.state_dict(),
                    "prompt_rng": prompt_rng.getstate(),
                    "refill_rng": refill_rng.getstate(),
                    "generator": generator.get_state(),
                    "shuffle": shuffle.get_state(),
                    "torch_rng": torch.get_rng_state(),
                    "entropy_control": None if entropy_control is None else entropy_control.state_dict(),
                },
            )
    return {
        "metrics": metrics,
        "samples": samples,
        "state": {k: v.detach().cpu().clone() for k, v in policy.state_dict().items()},
    }
