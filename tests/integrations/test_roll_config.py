"""ROLL's dual clip against pgloss's `dual_clip_ppo`. ROLL (alibaba/ROLL) is not on the package index: its source
is read from a checkout under $PGLOSS_ROLL_SRC (alibaba/ROLL commit 8eb27cc2d, main of 2026-08-19), the test
skipped without it. ROLL's `roll/pipeline/rlvr/actor_worker.py` (`ActorWorker.loss_func`) dual-clips negative
advantages at c = 1 + 2·pg_clip (1.4 at its default pg_clip 0.2, `roll/configs/base_config.py` PPOConfig),
derived from the clip; pgloss takes c as its own field, `dual_clip` (3.0, verl's `clip_ratio_c`). ROLL's loss is
`dual_clip_ppo` with `dual_clip=1 + 2·pg_clip` (docs/integrations.md, "Defaults that moved")."""

from __future__ import annotations

import ast
import os
import textwrap
import types
from pathlib import Path

import pytest
import torch
from conftest import make_batch

import pgloss

WORKER = "roll/pipeline/rlvr/actor_worker.py"
CONFIG = "roll/configs/base_config.py"
FIRST = "pg_clip_low = self.pipeline_config.pg_clip_low"
LAST = "loss = torch.where(advantages < 0, dual_clip_loss, loss)"


def _file(relative: str) -> Path:
    root = os.environ.get("PGLOSS_ROLL_SRC")
    if not root:
        pytest.skip("PGLOSS_ROLL_SRC is not set (the root of an alibaba/ROLL checkout)")
    path = Path(root) / relative
    if not path.is_file():
        pytest.skip(f"PGLOSS_ROLL_SRC={root} holds no {relative}")
    return path


def ppo_defaults() -> dict:
    """The `field(default=...)` values of ROLL's PPOConfig, read without importing it."""
    tree = ast.parse(_file(CONFIG).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PPOConfig")
    out = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) and isinstance(item.value, ast.Call):
            for keyword in item.value.keywords:
                if keyword.arg == "default":
                    out[item.target.id] = ast.literal_eval(keyword.value)
    return out


def roll_loss(ratio, advantages, **pipeline_config):
    """ROLL's own lines, from the clip bounds to the dual clip, executed on `ratio` and `advantages`."""
    lines = _file(WORKER).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith(FIRST))
    end = next(i for i, line in enumerate(lines) if line.strip() == LAST)
    code = textwrap.dedent("\n".join(lines[start : end + 1]))
    assert "(1 + self.pipeline_config.pg_clip * 2) * advantages" in code
    namespace = {
        "torch": torch,
        "ratio": ratio,
        "advantages": advantages,
        "self": types.SimpleNamespace(pipeline_config=types.SimpleNamespace(**pipeline_config)),
    }
    exec(compile(code, str(_file(WORKER)), "exec"), namespace)
    return namespace["loss"]


def test_roll_defaults():
    got = ppo_defaults()
    assert (got["pg_clip"], got["dual_clip_loss"], got["loss_agg_mode"]) == (0.2, False, "seq-mean-token-mean")
    assert pgloss.get("dual_clip_ppo").dual_clip == 3.0 != 1 + 2 * got["pg_clip"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("pg_clip", "low", "high"), [(0.2, None, None), (0.3, 0.2, 0.28)])
def test_roll_dual_clip_is_dual_clip_ppo_at_one_plus_twice_the_clip(seed, pg_clip, low, high):
    data = make_batch(batch=6, length=9, seed=seed, spread=1.0, per_token_adv=True)
    old, mask = data["old_log_prob"], data["mask"]
    config = dict(pg_clip=pg_clip, use_pg_clip_range=low is not None, pg_clip_low=low, pg_clip_high=high)
    leaf = data["log_prob"].clone().requires_grad_(True)
    theirs = roll_loss((leaf - old).exp(), data["advantages"], dual_clip_loss=True, **config)
    (want,) = torch.autograd.grad(torch.where(mask, theirs, 0.0).sum(), leaf)

    algorithm = pgloss.get(
        "dual_clip_ppo", clip_low=low or pg_clip, clip_high=high or pg_clip, dual_clip=1 + 2 * pg_clip
    )
    leaf2 = data["log_prob"].clone().requires_grad_(True)
    out = algorithm(leaf2, old, data["advantages"], mask)
    (grad,) = torch.autograd.grad(torch.where(mask, out.per_token, 0.0).sum(), leaf2)
    torch.testing.assert_close(
        torch.where(mask, out.per_token, 0.0), torch.where(mask, theirs, 0.0).detach(), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(grad, want, rtol=0, atol=1e-12)

    # pgloss's default c = 3 is another loss wherever -Â·r passes 1.4·|Â| for Â < 0
    default = pgloss.get("dual_clip_ppo", clip_low=low or pg_clip, clip_high=high or pg_clip)
    ratio = (data["log_prob"] - old).exp()
    assert bool((mask & (data["advantages"] < 0) & (ratio > 1 + 2 * pg_clip)).any())
    other = default(data["log_prob"], old, data["advantages"], mask).per_token
    assert not torch.allclose(torch.where(mask, other, 0.0), torch.where(mask, theirs, 0.0).detach())
