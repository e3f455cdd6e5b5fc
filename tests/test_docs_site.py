"""The documentation site builds with `mkdocs build --strict` (no broken link or anchor, no docstring griffe
cannot read, no missing reference), and its API reference covers every name `import pgloss` exports."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pgloss

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api"


def documented() -> set[str]:
    """The objects the API pages render (`::: pgloss.NAME` lines)."""
    return {name for page in API.glob("*.md") for name in re.findall(r"^::: ([\w.]+)$", page.read_text(), re.M)}


def test_the_api_reference_covers_every_public_name_and_the_adapters():
    missing = sorted(f"pgloss.{name}" for name in pgloss.__all__) + [
        "pgloss.integrations.trl",
        "pgloss.integrations.verl",
    ]
    missing = [name for name in missing if name not in documented()]
    assert not missing, f"add to a page of docs/api/: {missing}"


def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    for page in ("index.html", "api/algorithms/index.html", "api/integrations/index.html", "lab/index.html"):
        assert (tmp_path / "site" / page).is_file(), page
    algorithms = (tmp_path / "site" / "api" / "algorithms" / "index.html").read_text()
    assert 'id="pgloss.get"' in algorithms and 'id="pgloss.Algorithm.__call__"' in algorithms


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_readmes_links_reach_their_files_and_headings():
    """README.md is not part of the site (its links are relative to the repository): each of them is checked
    here, a file that exists and, after '#', a heading of it."""
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert len(links) > 10
    for link in links:
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.exists(), link
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {github_anchor(h) for h in headings}, link
