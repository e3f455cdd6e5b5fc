"""The wheel a user installs: built from the source tree, installed into a fresh virtual environment, and used
there as a user uses it (the `pgloss` command, an import), with the files a source checkout has and a wheel can
forget: py.typed (the package's annotations are for type checkers) and the shipped warm starts."""

import json
import os
import re
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent

# Run by the installed package's own Python: what a user's environment sees of pgloss.
INSTALLED = """
import hashlib, json
from importlib.resources import files

import pgloss
from pgloss.lab import warm
from pgloss.lab.config import LabConfig

shipped = {}
for seed in warm.SHIPPED_SEEDS:
    file = warm.shipped(LabConfig(seed=seed))
    shipped[seed] = None if file is None else hashlib.sha256(file.read_bytes()).hexdigest()
state = warm.state(LabConfig(seed=0), None)
print(json.dumps({"file": pgloss.__file__, "version": pgloss.__version__, "typed": files("pgloss").joinpath("py.typed").is_file(),
                  "shipped": shipped, "manifest": warm.manifest()["seeds"], "tensors": len(state)}))
"""


def test_the_wheel_installs_and_carries_its_data(tmp_path):
    source = tmp_path / "source"  # a copy: the build writes build/ and *.egg-info beside the sources it reads
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    run = dict(
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(source),
        ],
        **run,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("pgloss-*.whl")

    env = tmp_path / "env"
    venv.create(env, with_pip=False)  # pip runs from this interpreter into it (--python): no pip to install
    python = env / "bin" / "python"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet", "--no-deps", str(wheel)], **run
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # torch and the lab's extras from this environment, added after the install so that pip saw none of them
    # (nor this environment's own pgloss): a path, not a site directory, so its .pth files are not read.
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], **run
        ).stdout.strip()
    )
    (site / "_test_dependencies.pth").write_text(str(Path(torch.__file__).parent.parent) + "\n")

    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    done = subprocess.run([str(env / "bin" / "pgloss"), "--version"], **run)
    assert done.returncode == 0 and done.stdout == f"pgloss {version}\n", done.stdout + done.stderr
    done = subprocess.run([str(env / "bin" / "pgloss"), "--help"], **run)
    assert done.returncode == 0 and done.stdout.startswith("usage: pgloss") and "conformance" in done.stdout

    done = subprocess.run([str(python), "-c", INSTALLED], **run)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    assert Path(found["file"]).is_relative_to(site), found["file"]  # the wheel's pgloss, not the checkout's
    assert found["version"] == version and found["typed"] is True
    assert found["shipped"] == {seed: entry["sha256"] for seed, entry in found["manifest"].items()}
    assert found["tensors"] > 0
