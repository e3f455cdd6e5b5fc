"""The README as a user reads it first: one screen (what it is, install with PyTorch's CPU build, the example, the
commands, what is in the box, links into the docs), its claims true for every name or with their exceptions, the
supported range the matrix tests; and the hidden-states page, which defines the types of its signatures."""

import re
from pathlib import Path

import pgloss

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_states_the_range_the_matrix_tests():
    makefile = (ROOT / "Makefile").read_text()
    floor, newest = (
        re.search(rf"^{name} := (\S+)$", makefile, re.M).group(1) for name in ("MATRIX_FLOOR", "MATRIX_NEWEST")
    )
    short = ".".join(newest.split(".")[:2])
    assert f"PyTorch {floor} to {short}" in " ".join((ROOT / "README.md").read_text().split())  # the site's too


def test_the_hidden_states_page_defines_the_types_of_its_signatures():
    """docs/api/vocabulary.md renders FusedAlgorithm (the type of loss_from_hidden's `algorithm`) and links the rest;
    mkdocs links each type in a signature to its page (signature_crossrefs)."""
    page = (ROOT / "docs" / "api" / "vocabulary.md").read_text()
    assert "::: pgloss.from_hidden.FusedAlgorithm" in page and "::: pgloss.HeadOptions" in page
    assert all(f"[`pgloss.{name}`][]" in page for name in ("Normalizer", "LossOutput", "Algorithm"))
    assert "signature_crossrefs: true" in (ROOT / "mkdocs.yml").read_text()


def test_the_readme_names_the_row_coupled_exceptions_to_split_invariance():
    """The README's split-invariance claim names exactly the losses whose rows are coupled within a call."""
    intro = (ROOT / "README.md").read_text().split("[end:intro]")[0]
    named = set(re.findall(r"`(\w+)`", intro.split("row-coupled names")[1].split(")")[0]))
    coupled = {n for n in pgloss.names() if type(pgloss.get(n, norm_constant=9.0)).couples_rows}
    assert named == coupled


def test_the_readme_is_a_page_scanned_in_two_minutes():
    """What it is, install (with the CPU wheel), the example, the two commands, what is in the box, the links."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 110
    assert "--index-url https://download.pytorch.org/whl/cpu" in readme
    headings = re.findall(r"^## (.+)$", readme, re.M)
    assert headings[:5] == ["Install", "In ten lines", "Two commands", "What is in the box", "Documentation"]
