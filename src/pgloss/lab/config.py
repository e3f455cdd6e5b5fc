"""The lab's configuration: one frozen dataclass, every field documented on the line below it.

The command line is generated from this class (``--field-name``, help from the field's
docstring), so a run's ``config.json`` is all it takes to reproduce it.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass

DEFAULT_ALGORITHMS = ("grpo", "dapo", "gspo", "dr_grpo", "sample_grpo")


@dataclass(frozen=True)
class LabConfig:
    """One RL run: task, model, sampling, optimisation and warm start."""

    algorithm: str = "grpo"
    """Name of the pgloss algorithm whose loss trains the policy."""
    task: str = "chain"
    """Synthetic task: sum (add 2-6 digits), chain (+ and * left to right, mod 10) or mul (digit times digit)."""
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


def field_docs(cls=LabConfig) -> dict[str, str]:
    """Each field's docstring (the string literal on the line after it), by field name."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = nxt.value.value
    return docs


def add_config_arguments(parser, skip: tuple[str, ...] = ()) -> None:
    """Add ``--field-name`` options for every LabConfig field except `skip`."""
    docs = field_docs()
    for f in dataclasses.fields(LabConfig):
        if f.name in skip:
            continue
        kind = type(f.default)
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=f.default,
                            help=f"{docs.get(f.name, '')} (default: {f.default})")


def config_from_args(args, **overrides) -> LabConfig:
    """A LabConfig from parsed arguments (fields missing from `args` keep their defaults)."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(LabConfig) if hasattr(args, f.name)}
    values.update(overrides)
    return LabConfig(**values)
