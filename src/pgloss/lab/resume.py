"""``--resume`` of ``pgloss train`` and ``pgloss compare``: the interrupted run in ``--out`` that a command
continues, refused when its settings are not this command's (each named with its flag and both values),
and the records its checkpoints keep (``lab/checkpoint.py``).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from .config import LabConfig


def _settings(config: dict) -> dict:
    """What makes a run itself, as config.json holds it: every LabConfig field, the algorithms and seeds."""
    return json.loads(json.dumps({**config["base"], "algorithms": config["algorithms"], "seeds": config["seeds"]}))


def resume_folder(args, command: str, config: dict) -> dict:
    """``--resume``: the config.json of the run in ``--out`` that `config` (this command's) continues,
    marked as resumed by this command line. ValueError when there is no --out, no unfinished run of
    `command` there, or one of other settings (each named with its flag and both values)."""
    from .checkpoint import differences

    if args.out is None:
        raise ValueError(f"--resume: give --out, the folder of the interrupted pgloss {command} run to continue")
    if args.overwrite:
        raise ValueError("--resume continues the run in --out and --overwrite replaces it: give one of them")
    out = Path(args.out)
    try:
        saved = json.loads((out / "config.json").read_text())
        _settings(saved)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"--resume: {out} holds no pgloss {command} run to continue ({err})") from None
    if not saved.get("command", "").startswith(f"pgloss {command}"):
        raise ValueError(f"--resume: {out} holds a run of {saved.get('command')!r}, not of pgloss {command}")
    if saved.get("status") == "finished":
        raise ValueError(
            f"--resume: the run in {out} is finished, nothing to continue (pgloss report {out} writes its report again)"
        )
    differ = differences(_settings(saved), _settings(config), name=lambda k: "--" + k.replace("_", "-"))
    if differ:
        raise ValueError(
            f"--resume: the run in {out} has other settings ({'; '.join(differ)}); give the same "
            "settings, or a new --out"
        )
    return {
        **saved,
        "status": "running",
        "versions": config["versions"],
        "resumed": [*saved.get("resumed", []), config["command"]],
        **({"workers": config["workers"]} if "workers" in config else {}),
    }


def kept_records(out: Path, runs: list[LabConfig]) -> tuple[list[dict], set[tuple[str, int]]]:
    """The records of each run's checkpoint in `out` (those a resumed run keeps) and the (algorithm, seed)
    of the runs that have one. ValueError when a checkpoint belongs to other settings."""
    from . import checkpoint

    kept: list[dict] = []
    resumable: set[tuple[str, int]] = set()
    for cfg in runs:
        saved = checkpoint.load(checkpoint.path(out, cfg.algorithm, cfg.seed), cfg)
        if saved is not None:
            kept += saved["metrics"]
            resumable.add((cfg.algorithm, cfg.seed))
    return kept, resumable


def resume_command(config: dict, out: Path) -> str | None:
    """The command line that continues the interrupted run in `out`: its own (config.json's `command`, the same
    settings, which ``--resume`` requires) with ``--out OUT --resume``, without ``--overwrite``. None for a run
    under torchrun, which keeps no checkpoint."""
    if config.get("world_size", 1) > 1:
        return None
    words, kept = shlex.split(config["command"]), []
    skip = False
    for word in words:
        if skip or word in ("--overwrite", "--resume") or word.startswith("--out="):
            skip = False
            continue
        if word == "--out":
            skip = True
            continue
        kept.append(word)
    return shlex.join([*kept, "--out", str(out), "--resume"])
