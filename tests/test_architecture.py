"""The layers of pgloss import only downward, and no modules import each other in a circle.

Every module of src/pgloss sits on a floor (`FLOORS`, by its dotted path, the longest prefix
wins); an import, at module level or inside a function, may reach its own floor or one below,
never one above. docs/architecture.md draws the same floors."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pgloss

ROOT = Path(pgloss.__file__).parent

FLOORS = {
    "pgloss.core": 0,
    "pgloss.advantages": 1,
    "pgloss.correction": 2,
    "pgloss.kl": 3,
    "pgloss.terms": 4,  # the terms an objective declares beside its policy term (KL penalty, entropy bonus, ...)
    "pgloss.vocab": 4,
    "pgloss.vocab.divergence": 4,  # the student-teacher divergences (distillation), beside full_kl on its loop
    "pgloss.base": 5,
    "pgloss.algorithm_fields": 5,  # the fields every Algorithm shares and what they imply (base.py adds the call)
    "pgloss.from_hidden": 5,  # the loss from hidden states: drives vocab/'s loop for the Algorithm beside it
    "pgloss.losses": 6,
    "pgloss.step": 6,  # one optimizer step of any Algorithm (counted once, its calls, their metrics): the adapters'
    "pgloss.algorithms": 7,
    "pgloss.controllers": 7,
    "pgloss.trainer_options": 7,  # the trainers' options as an Algorithm: read by pgloss.from_trl / from_verl
    "pgloss.diagnostics": 7,  # inspect: the per-token gradient of any Algorithm
    "pgloss": 8,  # the package's public names (__init__)
    "pgloss.integrations": 9,
    "pgloss.conformance": 9,
    "pgloss.lab": 9,
    "pgloss.experiments": 10,
    "pgloss.cli": 11,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def floor(module: str) -> int:
    key = max((k for k in FLOORS if module == k or module.startswith(k + ".")), key=len, default=None)
    if key is None:
        raise AssertionError(f"{module} has no floor: add it to FLOORS (and to docs/architecture.md)")
    return FLOORS[key]


def imports(path: Path) -> set[str]:
    """The pgloss modules `path` imports, anywhere in the file, resolved to existing modules."""
    module = module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            if target == "pgloss" or target.startswith("pgloss."):
                found.add(target)
    return {t for t in found if t in MODULES} - {module}


MODULES = {module_name(p) for p in ROOT.rglob("*.py")}
GRAPH = {module_name(p): imports(p) for p in ROOT.rglob("*.py")}


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_every_import_goes_down_or_stays_on_its_floor(module):
    upward = sorted(t for t in GRAPH[module] if floor(t) > floor(module) and not module.startswith(t + "."))
    assert not upward, f"{module} (floor {floor(module)}) imports {[(t, floor(t)) for t in upward]} from above"


def test_no_import_circle():
    """Tarjan's strongly connected components: every one is a single module. A package's __init__
    importing its own submodules is not a circle (the submodule does not import the package back)."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not circles, f"import circles: {circles}"


def test_the_floors_hold_every_module():
    assert {floor(m) for m in MODULES} == set(FLOORS.values())


def test_a_folder_sits_on_one_floor():
    """Every module of a package shares the package's floor: a folder is one floor, with no per-file exception
    (the trainers' option translators have their own folder, `trainer_options`, below the adapters)."""
    split = sorted(m for m in MODULES if m.count(".") > 1 and floor(m) != floor(".".join(m.split(".")[:2])))
    assert not split, f"modules off their folder's floor: {[(m, floor(m)) for m in split]}"


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("pgloss.integrations.trl_config", "pgloss.trainer_options.trl"),
        ("pgloss.integrations.verl_config", "pgloss.trainer_options.verl"),
    ],
)
def test_a_moved_module_keeps_its_old_name(old, new):
    """The translators' former paths are the modules themselves (one object: a patch through either name holds)."""
    import importlib

    assert importlib.import_module(old) is importlib.import_module(new)
