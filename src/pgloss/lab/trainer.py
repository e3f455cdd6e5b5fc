"""The RL loop: sample a group per prompt, score it, update with a pgloss loss, log diagnostics.

Read top to bottom:

1. ``build``: tokenizer, task and a seeded tiny transformer.
2. ``warm_start``: a short supervised phase on demonstrations (with and without scratchpad),
   so that RL starts above zero reward.
3. ``collect`` (``lab/batch.py``): G completions per prompt at the sampling temperature; rewards; group
   advantages; old, reference and entropy values under no_grad. A simulated mismatched sampler
   (``make_sampler``: ``sampler_temperature``, ``sampler_noise``) samples instead of the policy; its
   log-probs become ``rollout_log_prob``. DAPO's dynamic sampling then refills the batch (``refill``).
4. ``update`` (``lab/update.py``): ``epochs`` passes over the batch, each cut into ``minibatches``
   optimizer steps of whole groups, each step made of ``micro_batches`` combined by one ``pgloss.Normalizer``.
5. ``train``: the loop, yielding one dict of numbers per step (the diagnostics that "an article
   on the components of PG losses in verl's conventions" tells you to watch: reward, greedy
   accuracy, response length, entropy, KL to the reference, clip fraction with its high/low
   split, ppo_kl, gradient norm and the share of clipped gradients). Every diagnostic is a
   tensor until the single ``tolist`` of the step. After each step the run's checkpoint is saved
   (``lab/checkpoint.py``), from which it continues exactly.

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

import torch
from torch import Tensor

import pgloss

from . import checkpoint as checkpoints
from . import distributed as dist
from .batch import Batch, collect, refill, score
from .config import LabConfig
from .model import ModelConfig, TinyGPT
from .sampling import response_log_probs, sample, teacher_forced
from .spec import parse_rollout_correction, parse_spec
from .tasks import Problem, demonstration, make_task, taught
from .tokenizer import Tokenizer
from .update import ROLLOUT_METRICS, update

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
        for i, (p, a) in enumerate(zip(problems, answers, strict=True)):
            weights[i, : len(a) + 1] = torch.tensor(taught(p, a) + [True])  # the end token is always taught
        weights = weights.to(cfg.device)
        loss = -(log_prob * weights).sum() / weights.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if on_step is not None:
            on_step(step)
    return float(loss.detach())


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
        for p, t, done, r in zip(problems, texts, rollout.finished.tolist(), rewards.tolist(), strict=True)
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
    live = checkpoints.Live(
        policy, reference, optimizer, warmup, prompt_rng, refill_rng, generator, shuffle, entropy_control
    )
    samples: dict = {}
    metrics: list[dict] = []
    first = 0
    if saved is not None:  # continue after the checkpoint's step, every state as it was then
        live.restore(saved)
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

            def draw(round_: int, sampler=sampler) -> Batch:  # this step's sampler
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
            **{k: None if math.isnan(v) else v for k, v in zip(METRICS, values.tolist(), strict=True)},
        }
        metrics.append(record)
        if on_step is not None:
            on_step(record)
        if checkpoint is not None:
            checkpoints.save(checkpoint, live.state(cfg, step, metrics, samples))
    return {
        "metrics": metrics,
        "samples": samples,
        "state": {k: v.detach().cpu().clone() for k, v in policy.state_dict().items()},
    }
