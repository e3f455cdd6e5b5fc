"""A stand-in for the Python of benchmarks/gpu_session.sh that checks each command instead of running it.

The session script runs on a GPU machine lent for minutes: a misspelt option, variant, shape or test file there
costs the session. Given as its BENCH_PYTHON (through a two-line shell wrapper), this takes each command the script
would run and checks it here, without a GPU:

- `python benchmarks/NAME.py ARGS`: NAME's own `parse_args(ARGS)` accepts them (argparse's choices and each
  script's own checks), and `--variants` / `--shapes` name what the script defines;
- `python -m pytest ... FILES`: every test file named exists;
- `python -` (the install step on standard input): runs with `peers.install_missing` replaced, so nothing is
  installed, and prints what it would have;
- `python -c CODE`: runs CODE.

Each check prints one line starting `checked:`; a command that fails its check exits with status 1.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def check_script(path: str, argv: list[str]) -> str:
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(Path(path).stem, ROOT / path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = module.parse_args(argv)  # exits with status 2 and argparse's message on a bad option
    for name, known in (("variants", "VARIANTS"), ("shapes", "SHAPES")):
        chosen = getattr(args, name, None)
        if chosen and hasattr(module, known):
            unknown = set(chosen.split(",")) - set(getattr(module, known))
            if unknown:
                raise SystemExit(f"{path}: --{name} names {sorted(unknown)}, which it does not define")
    return f"{path} {' '.join(argv)}"


def check_pytest(argv: list[str]) -> str:
    files = [arg.split("::")[0] for arg in argv if arg.endswith(".py") or ".py::" in arg]
    missing = [name for name in files if not (ROOT / name).is_file()]
    if missing or not files:
        raise SystemExit(f"pytest would not find {missing or 'any test file'}")
    return f"pytest {' '.join(files)}"


def check_stdin() -> str:
    sys.path.insert(0, str(BENCHMARKS))
    import peers

    def install_missing(wheels, wanted):
        return {
            name: f"would install {peer.distribution} from {wheels}"
            for name, peer in wanted.items()
            if not peers.installed(peer.module)
        }

    peers.install_missing = install_missing
    exec(compile(sys.stdin.read(), "<stdin>", "exec"), {"__name__": "__main__"})
    return "the install step"


def main(argv: list[str]) -> None:
    if argv[:1] == ["-c"]:
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        return
    if argv[:2] == ["-m", "pytest"]:
        print("checked:", check_pytest(argv[2:]))
    elif argv[:1] == ["-"]:
        print("checked:", check_stdin())
    elif argv and argv[0].endswith(".py"):
        print("checked:", check_script(argv[0], argv[1:]))
    else:
        raise SystemExit(f"not a command the session script runs: {argv}")


if __name__ == "__main__":
    main(sys.argv[1:])
