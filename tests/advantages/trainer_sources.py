"""The trainers' own advantage and loss functions, read from their source files without importing their
packages (which pull in ray, vLLM, verifiers, ...): each named top-level function or class is cut out
of the file (decorators dropped) and executed in a namespace that holds what it refers to.

The sources are found through environment variables, each the root of an unpacked release or checkout:

    PGLOSS_TRINITY_SRC   holds trinity/algorithm/                       (trinity-rft 0.6.0 wheel)
    PGLOSS_TINKER_SRC    holds tinker_cookbook/distillation/            (tinker-cookbook 0.6.1 wheel)
    PGLOSS_TORCHRL_SRC   holds torchrl/objectives/llm/distillation.py   (torchrl 0.14.1 wheel)
    PGLOSS_SKYRL_SRC     holds skyrl/backends/skyrl_train/utils/ppo_utils.py  (skyrl 0.4.0 wheel)
    PGLOSS_PRIME_RL_SRC  holds src/prime_rl/orchestrator/algo/, src/prime_rl/trainer/rl/loss.py  (prime-rl checkout)
    PGLOSS_DELTA_L_SRC   holds verl/trainer/ppo/core_algos.py           (Delta-L-Normalization checkout)
    PGLOSS_NEMO_RL_SRC   holds nemo_rl/algorithms/                      (NeMo-RL checkout)

`make test` unpacks the four wheels and sets their variables; the checkouts are read when their variable is set.
A test that needs one absent source is skipped with the variable's name."""

from __future__ import annotations

import asyncio
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from pgloss.conformance import sources


def source_file(variable: str, *relative: str) -> Path:
    """The first of `relative` under $`variable`; skip the test when the variable or the file is absent."""
    root = os.environ.get(variable)
    if not root:
        pytest.skip(f"{variable} is not set (the root of the trainer's source)")
    for rel in relative:
        path = Path(root) / rel
        if path.is_file():
            return path
    pytest.skip(f"{variable}={root} holds none of {relative}")


def load(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
    """Execute the top-level definitions `names` of `path` (without their decorators) in `namespace`
    (`pgloss.conformance.sources.load`); skip the test when the file lacks one."""
    try:
        return sources.load(path, names, namespace)
    except LookupError as error:
        pytest.skip(str(error))


def prime_rl(*names: tuple[str, str]) -> dict:
    """prime-rl's algorithm classes, each a (class, file) pair under src/prime_rl/orchestrator/algo/, with the
    functions their scoring calls (base.py, routing.py, trajectories.py) and a base class that stores the pool."""
    algo = "src/prime_rl/orchestrator/algo/"
    namespace = {"torch": torch, "asyncio": asyncio, "defaultdict": defaultdict}
    load(source_file("PGLOSS_PRIME_RL_SRC", algo + "base.py"), ("iter_trainable_traces",), namespace)
    load(
        source_file("PGLOSS_PRIME_RL_SRC", algo + "routing.py"),
        ("assign_advantages", "assign_reference_logprobs"),
        namespace,
    )
    load(
        source_file("PGLOSS_PRIME_RL_SRC", "src/prime_rl/orchestrator/trajectories.py"),
        ("iter_trainable_branches",),
        namespace,
    )

    class Algorithm:  # the base class's constructor only stores the pool
        def __init__(self, config, policy_pool):
            self.policy_pool = policy_pool

    namespace["Algorithm"] = Algorithm
    for name, file in names:
        load(source_file("PGLOSS_PRIME_RL_SRC", algo + file), (name,), namespace)
    return namespace
