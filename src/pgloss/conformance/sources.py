"""A trainer's own loss code read from its source files, for the trainers whose package import pulls in a
whole training stack (ms-swift's `swift` imports transformers, trl, peft and its templates; OpenRLHF's
`openrlhf.models` imports deepspeed and flash-attn): the named top-level functions, classes, assignments,
or methods of one class, are cut out of the file (decorators dropped) and executed in a namespace that
holds what they refer to. The code that runs is the trainer's, unchanged.

A file is found under `$<variable>` (the root of an unpacked release or a checkout: `make test` unpacks the
released wheels and sets the variables) or else in the installed distribution, without importing it.
"""

from __future__ import annotations
import __future__

import ast
import os
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

__all__ = ["locate", "locate_all", "load"]


def locate(dist: str, relative: str, variable: str, install: str) -> Path | str:
    """The file `relative` of the trainer: under $`variable` when it is set, else in the installed
    distribution `dist`; or, as a str, why it cannot be found (naming `install`, what to install)."""
    root = os.environ.get(variable)
    if root:
        path = Path(root) / relative
        return path if path.is_file() else f"${variable}={root} holds no {relative}"
    try:
        found = distribution(dist)
    except PackageNotFoundError:
        return f"{dist} is not installed ({install}; or set {variable} to the root of its source)"
    path = Path(str(found.locate_file(relative)))
    return path if path.is_file() else f"{dist} {found.version} has no {relative}"


def locate_all(dist: str, relatives: tuple[str, ...], variable: str, install: str) -> tuple[Path, ...] | str:
    """The files `relatives` of the trainer (`locate`, in order), or why the first missing one cannot be found."""
    found = [locate(dist, relative, variable, install) for relative in relatives]
    why = [f for f in found if isinstance(f, str)]
    return why[0] if why else tuple(f for f in found if isinstance(f, Path))


def load(path: Path, names: tuple[str, ...], namespace: dict, *, within: str | None = None) -> dict:
    """Execute the definitions `names` of `path` in `namespace` (and return it): top-level functions,
    classes and assignments, or the methods of class `within` (then bound to nothing: call them with a
    stand-in `self`). Annotations are not evaluated (the trainer's types need not be importable).
    A name the file does not define raises LookupError."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    body = ast.parse(text).body
    if within is not None:
        classes = [node for node in body if isinstance(node, ast.ClassDef) and node.name == within]
        if not classes:
            raise LookupError(f"{path} defines no class {within}")
        body = classes[0].body
    found: dict[str, str] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        if name in names:
            source = lines[node.lineno - 1 : node.end_lineno]  # from the `def`: decorators sit above it
            pad = " " * node.col_offset  # a method's indentation inside its class
            found[name] = "".join(line.removeprefix(pad) for line in source)
    missing = [name for name in names if name not in found]
    if missing:
        raise LookupError(f"{path} defines none of {missing}" + (f" in class {within}" if within else ""))
    flags = __future__.annotations.compiler_flag
    for name in names:
        exec(compile(found[name], str(path), "exec", flags=flags, dont_inherit=True), namespace)
    return namespace
