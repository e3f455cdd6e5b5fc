"""`pgloss conformance`: every installed trainer's own loss functions against pgloss, case by case.

A trainer module of this package (`verl`, `trl`, `ms_swift`, `liger`, `openrlhf`; or any module
named with `--module`) exposes `TRAINER` (its name), `available() -> str | None` (None, or why it
cannot run here) and `cases() -> Iterator[Case]`. Each case is printed as agree, differs as
documented (with the documented reason) or DIFFERS; the command exits 1 when any case DIFFERS.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType

from .case import AGREE, DIFFERS, DOCUMENTED, Case

__all__ = ["MODULES", "cmd_conformance", "register", "run"]

MODULES = tuple(
    sorted(
        info.name
        for info in pkgutil.iter_modules([str(Path(__file__).parent)])
        if info.name not in ("case", "run", "sources")
    )
)
"""The trainer modules of pgloss.conformance (every module of the package beside `case`, `run` and
`sources`): `--trainer` takes only these, so a trainer without one is named as such."""


def _load(name: str, *, builtin: bool) -> ModuleType | None:
    """The module `pgloss.conformance.<name>` (builtin) or `name` (a user's), or None when absent."""
    path = f"{__package__}.{name}" if builtin else name
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as error:
        if builtin and error.name == path:
            return None
        raise


def _line(case: Case) -> str:
    numbers = f"loss {case.loss_error:.1e}, grad {case.grad_error:.1e} (tolerance {case.tolerance:.0e})"
    text = f"  {case.status:<22} {case.algorithm:<10} {case.setting}: {numbers}"
    return text + (f"\n{'':25}{case.reason}" if case.status == DOCUMENTED else "")


def run(modules: Iterable[tuple[str, bool]], *, show=print) -> Counter:
    """Run every case of `modules` ((name, builtin) pairs), printing each; the counts by status."""
    totals: Counter = Counter()
    for name, builtin in modules:
        module = _load(name, builtin=builtin)
        if module is None:
            continue
        why = module.available()
        if why is not None:
            show(f"{module.TRAINER}: not run ({why})")
            totals["not run"] += 1
            continue
        show(f"{module.TRAINER}:")
        counts: Counter = Counter()
        for case in module.cases():
            counts[case.status] += 1
            show(_line(case))
        show(f"  {module.TRAINER}: " + ", ".join(f"{counts[s]} {s}" for s in (AGREE, DOCUMENTED, DIFFERS)))
        totals.update(counts)
    return totals


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `conformance` subcommand to pgloss's command line."""
    parser = subparsers.add_parser(
        "conformance",
        help="check pgloss against the installed trainers' own losses",
        description=__doc__.splitlines()[0],
    )
    parser.add_argument(
        "--trainer",
        action="append",
        choices=MODULES,
        help="only this trainer's module (repeatable; default: every installed one)",
    )
    parser.add_argument(
        "--module",
        action="append",
        default=[],
        help="run an importable module with TRAINER, available() and cases() (repeatable); "
        "with --module, the built-in trainers run only when --trainer names them",
    )
    parser.set_defaults(func=cmd_conformance)


def cmd_conformance(args: argparse.Namespace) -> int:
    """Print every case and a summary; 1 when a case DIFFERS (or nothing could run), else 0."""
    builtin = args.trainer or ([] if args.module else MODULES)
    modules = [(name, True) for name in builtin] + [(name, False) for name in args.module]
    totals = run(modules)
    ran = sum(totals[s] for s in (AGREE, DOCUMENTED, DIFFERS))
    print(
        f"pgloss conformance: {totals[AGREE]} agree, {totals[DOCUMENTED]} differ as documented, "
        f"{totals[DIFFERS]} DIFFER"
    )
    if ran == 0:
        print(f"no trainer could be checked: install one beside pgloss ({', '.join(builtin) or 'the modules given'})")
        return 1
    return 1 if totals[DIFFERS] else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pgloss")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
