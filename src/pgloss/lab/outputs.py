"""Where a command writes, chosen so that a run never deletes another.

One rule for every command that writes (``train``, ``compare``, ``experiment``, ``grads``):

- an ``--out`` that does not exist, or is an empty directory, is used;
- an ``--out`` given on the command line that holds files is refused with a message, before any
  work (``experiment`` resumes its own runs instead, when the settings are the same);
- the default ``--out`` (``runs/compare``, ...), when taken, becomes the first free name beside
  it: ``runs/compare-2``, ``runs/compare-3``, ...;
- ``--overwrite`` replaces, and still deletes nothing: the command's earlier files in ``--out`` are
  moved into ``--out``'s first free ``replaced``, ``replaced-2``, ... folder (an earlier file given
  as ``--out`` becomes ``<name>.replaced<suffix>``, ``<name>.replaced-2<suffix>``, ...); other files stay.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def taken(path: Path) -> bool:
    """True when `path` is a file, or a directory that holds anything."""
    return path.is_file() or (path.is_dir() and any(path.iterdir()))


def beside(path: Path) -> Path:
    """`path`, or the first of ``<stem>-2<suffix>``, ``<stem>-3<suffix>``, ... that is not taken."""
    k = 1
    candidate = path
    while taken(candidate):
        k += 1
        candidate = path.with_name(f"{path.stem}-{k}{path.suffix}")
    return candidate


def refusal(path: Path) -> str:
    """The message that refuses an ``--out`` that is taken."""
    if path.is_file():
        held = "already exists"
    else:
        names = sorted(p.name for p in path.iterdir())
        held = "already holds " + ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return f"--out {path} {held}: a run never replaces another; give a new --out, or add --overwrite to replace it"


def set_aside(folder: Path, names, why: str = "--overwrite") -> Path | None:
    """Move the entries of `folder` named in `names` that exist into its first free ``replaced``
    folder, say where on stderr (after `why`, the command that replaces them) and return it (None
    when none of them is there)."""
    present = [folder / name for name in names if (folder / name).exists()]
    if not present:
        return None
    kept = beside(folder / "replaced")
    kept.mkdir(parents=True)
    for entry in present:
        entry.rename(kept / entry.name)
    print(f"{why}: the earlier {', '.join(e.name for e in present)} kept in {kept}", file=sys.stderr)
    return kept


def claim_directory(out: str | None, default: str, overwrite: bool, own: list[str]) -> Path:
    """The directory a run writes into, created, by the rule of the module docstring; `own` are the
    names of the files the command writes (set aside under `overwrite`). ValueError when it cannot
    be used."""
    path = Path(default if out is None else out)
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path}: is a file, not a directory")
    if taken(path):
        if overwrite:
            set_aside(path, own)
        elif out is None:
            path = beside(path)
        else:
            raise ValueError(refusal(path))
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {path}: cannot create the directory ({err.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"--out {path}: the directory is not writable")
    return path


def claim_file(out: str | None, default: str, overwrite: bool) -> Path:
    """The file a command writes, by the same rule; its directory is created."""
    path = Path(default if out is None else out)
    if path.is_dir():
        raise ValueError(f"--out {path}: is a directory, not a file")
    if path.exists() and overwrite:
        kept = beside(path.with_name(f"{path.stem}.replaced{path.suffix}"))
        path.rename(kept)
        print(f"--overwrite: the earlier {path.name} kept as {kept}", file=sys.stderr)
    elif path.exists():
        if out is not None:
            raise ValueError(refusal(path))
        path = beside(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {path}: cannot create its directory ({err.strerror})") from None
    return path
