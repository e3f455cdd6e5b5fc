"""The documentation's examples (the README's ten-line example, the guide's "Use" snippet, the hidden-states page's
Hugging Face example) and examples/plain_pytorch.py, run as a user runs them."""

import copy
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pgloss

ROOT = Path(__file__).resolve().parent.parent


def readme_python(start: str, end: str | None = None, page: str = "README.md", language: str = "python") -> str:
    """The first `language` block of `page` (the README) after `start` (and before `end`)."""
    readme = (ROOT / page).read_text()
    part = readme[readme.index(start) : None if end is None else readme.index(end)]
    return re.search(rf"```{language}\n(.*?)```", part, re.S).group(1)


def run_as_written(code: str, tmp_path) -> str:
    """`code` run as a script in a fresh Python, its standard output."""
    script = tmp_path / "snippet.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_the_guides_use_snippet_runs_as_written(tmp_path):
    """The first Python block of the guide's "## Use" section (docs/guide.md: a whole optimizer step)."""
    lines = run_as_written(readme_python("\n## Use\n", page="docs/guide.md"), tmp_path).strip().splitlines()
    assert len(lines) == 2 and all("'pg_loss'" in line and "'ppo_kl'" in line for line in lines), lines


def test_the_readme_ten_line_example_runs_as_written(tmp_path):
    """The README's first-screen example: the block between its snippet markers (the site's home page includes
    the same block)."""
    out = run_as_written(readme_python("[start:example]", "[end:example]"), tmp_path)
    assert out == readme_python("[start:example]", "[end:example]", language="text")  # seeded: what it shows
    found = re.fullmatch(r"loss (-?\d+\.\d{4}), gradient norm (\d+\.\d{4})\n", out)
    assert found and float(found.group(2)) > 0, out


def test_the_hugging_face_example_of_the_hidden_states_page_prints_what_it_shows(tmp_path):
    """docs/api/vocabulary.md: hidden states from a transformers causal LM (output_hidden_states, the shift, the
    tied head's weight) give the loss and the head's gradient of the materialised logits."""
    pytest.importorskip("transformers", reason="the example builds a transformers model (the trl extra)")
    page = "docs/api/vocabulary.md"
    out = run_as_written(readme_python("## From a Hugging Face causal LM", page=page), tmp_path)
    assert out == readme_python("## From a Hugging Face causal LM", page=page, language="text"), out


def _example():
    spec = importlib.util.spec_from_file_location("plain_pytorch", ROOT / "examples" / "plain_pytorch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_plain_pytorch_example_trains():
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_pytorch.py"), "--steps", "3", "--every", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert [line.split()[:2] for line in lines] == [["step", str(k)] for k in range(3)]
    assert all("reward" in line and "grad_norm" in line for line in lines)


def test_the_plain_pytorch_example_learns_at_its_default():
    """Run with no argument, as its docstring says: the reward of the last printed steps is well above the
    first's (measured: 0.03 at step 0, 0.94 at step 119)."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "plain_pytorch.py"), "--every", "1"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rewards = [float(line.split()[3]) for line in done.stdout.strip().splitlines()]
    assert len(rewards) == 120
    assert sum(rewards[:10]) / 10 < 0.2 and sum(rewards[-10:]) / 10 > 0.6, rewards


def test_the_example_step_does_not_depend_on_its_micro_batches():
    """One optimizer step of the example: the same gradient whole or in 4 micro-batches of whole groups."""
    example = _example()
    torch.manual_seed(0)
    policy = example.TinyLM()
    batch = example.rollout(policy, copy.deepcopy(policy), 6, 4, torch.Generator().manual_seed(1))
    assert batch["mask"].sum(1).unique().numel() > 1  # responses of several lengths
    batch["advantages"] = torch.randn(len(batch["advantages"]), generator=torch.Generator().manual_seed(2))
    grads = []
    for micro_batches in (1, 4):
        model = copy.deepcopy(policy)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # keeps the gradient, moves nothing
        example.train_step(model, optimizer, pgloss.get("dapo"), batch, micro_batches, max_grad_norm=1e9)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
