"""What the lab's tests share: a tiny policy, a fixed batch (demonstrations and wrong answers of a few sum
problems), the `pgloss` command and its options for a tiny run."""

import random
import sys
from pathlib import Path

import pytest
import torch

from pgloss.advantages.group import group_advantages
from pgloss.lab.batch import Batch
from pgloss.lab.config import LabConfig
from pgloss.lab.sampling import Rollout, response_log_probs, teacher_forced
from pgloss.lab.tasks import SumTask, demonstration, reward
from pgloss.lab.tokenizer import Tokenizer
from pgloss.lab.trainer import build

TINY = dict(d_model=32, n_layer=1, n_head=2, max_new_tokens=20)

PGLOSS = str(Path(sys.executable).parent / "pgloss")
"""The `pgloss` command of this environment, run as a user runs it."""
CLI_TINY = (
    "--warm-steps 5 --d-model 16 --n-layer 1 --n-head 2 --prompts-per-step 4 --group-size 4 --eval-prompts 4 --samples 2"
).split()
"""The command's options for a run of seconds: a one-layer policy, four prompts of four samples a step."""


def same_run(a: dict, b: dict) -> bool:
    """Two `train` results are the same run: equal metrics and records, bit-equal final states."""
    sa, sb = a["state"], b["state"]
    return (
        {k: v for k, v in a.items() if k != "state"} == {k: v for k, v in b.items() if k != "state"}
        and sa.keys() == sb.keys()
        and all(torch.equal(sa[k], sb[k]) for k in sa)
    )


def tiny_policy(seed: int = 0):
    return build(LabConfig(seed=seed, **TINY))[2]


def fixed_batch(policy, reference=None, n_prompts: int = 6, group: int = 4, seed: int = 0) -> Batch:
    """Responses of varied length, half right and half wrong, as one group per prompt."""
    tok, task, rng = Tokenizer(), SumTask(), random.Random(seed)
    problems = [task.sample(rng) for _ in range(n_prompts)]
    prompts, responses, rewards = [], [], []
    for p in problems:
        for j in range(group):
            text = demonstration(p, rng.random() < 0.5)
            if j % 2:
                text = text[:-1] + str((int(text[-1]) + 1) % 10)
            prompts.append(tok.encode(p.prompt))
            responses.append(tok.encode(text))
            rewards.append(reward(text, p))
    r = teacher_forced(prompts, responses)
    group_ids = torch.arange(n_prompts).repeat_interleave(group)
    r = Rollout(r.tokens, r.valid, r.prompt_len, r.mask, r.finished, group_ids)
    with torch.no_grad():
        old, _ = response_log_probs(policy, r, temperature=1.0)
        ref = old if reference is None else response_log_probs(reference, r, temperature=1.0)[0]
    scores = torch.tensor(rewards)
    return Batch(r, old, ref, group_advantages(scores, group_ids), scores)


@pytest.fixture(autouse=True)
def warm_cache(tmp_path_factory, monkeypatch):
    """Every test of a module that imports this caches its warm starts in a folder of its own, never
    in the user's cache (subprocesses inherit the variable)."""
    path = tmp_path_factory.mktemp("xdg-cache")
    monkeypatch.setenv("XDG_CACHE_HOME", str(path))
    return path / "pgloss" / "warm"
