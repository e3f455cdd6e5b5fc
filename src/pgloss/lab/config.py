"""The lab's configuration: one frozen dataclass, every field documented on the line below it.

The command line is generated from this class (``--field-name``, help from the field's
docstring), so a run's ``config.json`` is all it takes to reproduce it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import math
from dataclasses import dataclass

DEFAULT_ALGORITHMS = ("grpo", "dapo", "gspo", "dr_grpo", "sample_grpo")


@dataclass(frozen=True)
class LabConfig:
    """One RL run: task, model, sampling, optimisation and warm start."""

    algorithm: str = "grpo"
    """The pgloss algorithm whose loss trains the policy, with optional hyperparameters: dapo or dapo:clip_high=0.3."""
    task: str = "chain"
    """Synthetic task, a name registered in tasks.TASKS (docs/lab.md describes each)."""
    seed: int = 0
    """Seeds the model, the warm start, the prompts and the sampling."""
    steps: int = 50
    """RL steps; each samples a fresh batch and updates on it."""
    prompts_per_step: int = 32
    """Prompts sampled per RL step (split over data-parallel ranks)."""
    group_size: int = 8
    """Completions sampled per prompt (the G of GRPO)."""
    temperature: float = 1.0
    """Sampling temperature, also applied to the log-probabilities the loss sees."""
    sampler_temperature: float | None = None
    """Simulated mismatch: the rollouts are sampled at this temperature (none: --temperature), the loss keeps --temperature."""
    sampler_noise: float = 0.0
    """Simulated mismatch: the rollouts come from a copy of the policy whose weights carry relative Gaussian noise of this scale."""
    rollout_correction: str = "default"
    """Rollout correction of the loss (docs/lab.md): default (the loss's own truncated IS), none, or LEVEL[:KEY=VALUE,...] e.g. token:upper=2."""
    reward_coef: float = 1.0
    """Weight of the task's group advantages in the loss (0 with --algorithm opd: pure on-policy distillation, the teacher's advantage alone)."""
    max_refill_rounds: int = 0
    """DAPO's dynamic sampling: extra rounds of fresh prompts per step to refill the groups it drops (0: no refill; a round costs a sampling pass)."""
    max_new_tokens: int = 24
    """Longest response; a response that has not ended by then gets reward 0."""
    epochs: int = 2
    """Passes over each batch (the iterations of PPO, GRPO's mu)."""
    minibatches: int = 2
    """Optimizer steps per pass; the batch is cut into this many minibatches of whole groups."""
    micro_batches: int = 1
    """Micro-batches per optimizer step, combined through one pgloss.Normalizer."""
    lr: float = 2e-4
    """AdamW learning rate of the RL phase."""
    warmup: int = 20
    """Optimizer steps of linear learning-rate warmup at the start of RL (Adam's first steps are otherwise full-size)."""
    max_grad_norm: float = 1.0
    """Gradient-norm clip of each optimizer step."""
    entropy_coef: float | None = None
    """Entropy bonus (the loss's entropy_coef) given to every algorithm whose spec does not set one (none: each algorithm's own default); with --target-entropy, the controller's starting coefficient."""
    target_entropy: float | None = None
    """Steer the entropy bonus toward this entropy (nats per token) with pgloss.AdaptiveEntropy (Skywork-OR1's rule, TRL's use_adaptive_entropy) instead of a fixed coefficient (none: fixed)."""
    entropy_coef_delta: float = 0.005
    """With --target-entropy: the coefficient's change per optimizer step (up while the entropy is at or below the target, down above it)."""
    entropy_coef_max: float = 1.0
    """With --target-entropy: the largest coefficient the controller reaches."""
    warm_steps: int = 1500
    """Supervised steps on demonstrations before RL, so that RL starts above zero reward."""
    warm_batch: int = 64
    """Demonstrations per warm-start step."""
    warm_lr: float = 3e-3
    """AdamW learning rate of the warm start."""
    scratchpad_prob: float = 0.5
    """Share of warm-start demonstrations that show the scratchpad (the rest answer directly)."""
    d_model: int = 96
    """Width of the transformer."""
    n_layer: int = 2
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads."""
    device: str = "cpu"
    """cpu or cuda."""
    threads: int = 1
    """torch threads per run (runs of a comparison go to parallel processes instead)."""
    eval_prompts: int = 64
    """Fixed held-out prompts answered greedily every step for the accuracy metric."""
    samples: int = 8
    """Completions written to the samples file at the start and at the end."""

    def __post_init__(self) -> None:
        """Refuse impossible settings here, before any training, naming the flag."""
        for name, ok, rule in (
            ("seed", self.seed >= 0, ">= 0"),
            ("steps", self.steps >= 1, ">= 1"),
            ("prompts_per_step", self.prompts_per_step >= 1, ">= 1"),
            ("group_size", self.group_size >= 2, ">= 2 (group advantages compare completions of one prompt)"),
            ("temperature", self.temperature > 0, "> 0"),
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("sampler_temperature", self.sampler_temperature is None or self.sampler_temperature > 0, "> 0 or none"),
            ("sampler_noise", self.sampler_noise >= 0, ">= 0"),
            ("reward_coef", math.isfinite(self.reward_coef) and self.reward_coef >= 0, "a finite number >= 0"),
            ("max_refill_rounds", self.max_refill_rounds >= 0, ">= 0"),
            ("epochs", self.epochs >= 1, ">= 1"),
            (
                "minibatches",
                1 <= self.minibatches <= self.prompts_per_step,
                f"between 1 and --prompts-per-step ({self.prompts_per_step}): a minibatch holds whole groups",
            ),
            ("micro_batches", self.micro_batches >= 1, ">= 1"),
            ("lr", self.lr > 0, "> 0"),
            ("warmup", self.warmup >= 0, ">= 0"),
            ("max_grad_norm", self.max_grad_norm > 0, "> 0"),
            (
                "entropy_coef",
                self.entropy_coef is None
                or (isinstance(self.entropy_coef, (int, float)) and math.isfinite(self.entropy_coef)),
                "a finite number or none",
            ),
            (
                "target_entropy",
                self.target_entropy is None
                or (
                    isinstance(self.target_entropy, (int, float))
                    and math.isfinite(self.target_entropy)
                    and self.target_entropy > 0
                ),
                "a finite number > 0 or none",
            ),
            (
                "entropy_coef_delta",
                math.isfinite(self.entropy_coef_delta) and self.entropy_coef_delta >= 0,
                "a finite number >= 0",
            ),
            (
                "entropy_coef_max",
                math.isfinite(self.entropy_coef_max) and self.entropy_coef_max >= 0,
                "a finite number >= 0",
            ),
            ("warm_steps", self.warm_steps >= 0, ">= 0"),
            ("warm_batch", self.warm_batch >= 1, ">= 1"),
            ("warm_lr", self.warm_lr > 0, "> 0"),
            ("scratchpad_prob", 0 <= self.scratchpad_prob <= 1, "in [0, 1]"),
            ("n_layer", self.n_layer >= 1, ">= 1"),
            ("n_head", self.n_head >= 1, ">= 1"),
            (
                "d_model",
                self.d_model >= 1 and self.d_model % max(self.n_head, 1) == 0,
                f">= 1 and a multiple of --n-head ({self.n_head})",
            ),
            ("threads", self.threads >= 1, ">= 1"),
            ("eval_prompts", self.eval_prompts >= 1, ">= 1"),
            ("samples", 0 <= self.samples <= self.eval_prompts, f"between 0 and --eval-prompts ({self.eval_prompts})"),
        ):
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)!r}")
        from .tasks import TASKS

        if self.task not in TASKS:
            raise ValueError(f"--task: unknown task {self.task!r}; valid names: {', '.join(sorted(TASKS))}")
        longest = (
            TASKS[self.task]().max_response_chars + 1
        )  # the warm start's longest demonstration, end token included
        if self.max_new_tokens < longest:
            raise ValueError(
                f"--max-new-tokens must be >= {longest} for --task {self.task} (its longest "
                f"demonstration with the end token), got {self.max_new_tokens}"
            )
        check_device(self.device)
        from .spec import parse_rollout_correction

        parse_rollout_correction(self.rollout_correction)

    @property
    def mismatched(self) -> bool:
        """True when the sampler differs from the policy (a simulated sampler mismatch)."""
        return mismatched(dataclasses.asdict(self))


def mismatched(fields: dict) -> bool:
    """Whether a config (``config.json``'s ``base``) simulates a sampler that differs from the policy."""
    temperature = fields.get("sampler_temperature")
    return fields.get("sampler_noise", 0.0) > 0 or temperature not in (None, fields.get("temperature"))


def check_device(device: str) -> None:
    """``cpu``, or ``cuda``/``cuda:N`` on a machine where torch sees that GPU; ValueError otherwise."""
    kind, _, index = device.partition(":")
    if kind == "cpu" and not index:
        return
    if kind != "cuda" or (index and not index.isdigit()):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: torch {torch.__version__} sees no CUDA device on this machine")
    if index and int(index) >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def field_docs(cls=LabConfig) -> dict[str, str]:
    """Each field's docstring (the string literal on the line after it), by field name."""
    (node,) = ast.parse(inspect.getsource(cls)).body
    if not isinstance(node, ast.ClassDef):
        raise TypeError(f"field_docs: {cls!r} is not a class")
    docs = {}
    for field, doc in itertools.pairwise(node.body):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(doc, ast.Expr)
            and isinstance(doc.value, ast.Constant)
            and isinstance(doc.value.value, str)
        ):
            docs[field.target.id] = doc.value.value
    return docs


def add_config_arguments(parser, skip: tuple[str, ...] = ()) -> None:
    """Add ``--field-name`` options for every LabConfig field except `skip`."""
    docs = field_docs()
    for f in dataclasses.fields(LabConfig):
        if f.name in skip:
            continue
        kind = _optional_float if f.default is None else type(f.default)
        extra = ""
        if f.name == "task":
            from .tasks import TASKS

            extra = f"; one of {', '.join(TASKS)}"
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=kind,
            default=f.default,
            help=f"{docs.get(f.name, '')} (default: {f.default}{extra})",
        )


def _optional_float(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def config_from_args(args, **overrides) -> LabConfig:
    """A LabConfig from parsed arguments (fields missing from `args` keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(LabConfig) if hasattr(args, f.name)}
    values.update(overrides)
    return LabConfig(**values)
