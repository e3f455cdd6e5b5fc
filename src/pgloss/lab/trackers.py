"""``--report-to``: the per-step metrics where users look, as TRL's ``report_to`` sends them.

``tensorboard`` writes each run's records with torch's ``SummaryWriter`` to ``OUT/tensorboard/<run>``
(``tensorboard --logdir OUT/tensorboard`` shows the runs side by side), ``wandb`` logs each run as a
wandb run, offline unless ``WANDB_MODE`` says otherwise (``wandb sync`` uploads it later), in
``OUT/wandb``. Both get every number of ``metrics.jsonl`` at its step (a null metric is left out)
and the run's settings as hyperparameters (every LabConfig field, the run's algorithm and seed).
They log what ``metrics.jsonl`` receives, in the main process: a resumed run logs its records again
from step 0, and TensorBoard hides the earlier copies (``purge_step=0``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

CHOICES = ("tensorboard", "wandb", "none")
INSTALL = {
    "tensorboard": "pip install tensorboard (torch's SummaryWriter writes its files with it)",
    "wandb": "pip install wandb",
}


def check(names: list[str] | None) -> list[str]:
    """The trackers of ``--report-to`` (``none`` drops out), each importable; ValueError naming the one
    that is missing and how to install it, or an unknown name."""
    chosen = []
    for name in names or ():
        if name not in CHOICES:
            raise ValueError(f"--report-to: unknown {name!r}; choose from {', '.join(CHOICES)}")
        if name == "none" or name in chosen:
            continue
        try:
            if name == "tensorboard":
                import tensorboard  # noqa: F401
                from torch.utils.tensorboard import SummaryWriter  # noqa: F401
            else:
                import wandb  # noqa: F401
        except ImportError as err:
            raise ValueError(f"--report-to {name}: {err}; install it with {INSTALL[name]}") from None
        chosen.append(name)
    return chosen


def hparams(base: dict, algorithm: str, seed: int) -> dict:
    """A run's settings as hyperparameters: numbers, booleans and strings (None as ``"none"``)."""
    values = {**base, "algorithm": algorithm, "seed": seed}
    return {
        k: "none" if v is None else v if isinstance(v, (bool, int, float, str)) else json.dumps(v)
        for k, v in values.items()
    }


def _numbers(record: dict) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in record.items()
        if k not in ("algorithm", "seed", "step") and isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
    }


class Trackers:
    """One writer per run per tracker, made at the run's first record; `log` sends a record, `close` ends them."""

    def __init__(self, names: list[str], out: Path, base: dict, resumed: bool = False) -> None:
        self.names, self.out, self.base, self.resumed = names, Path(out), base, resumed
        self.writers: dict[tuple, dict] = {}

    def _open(self, algorithm: str, seed: int) -> dict:
        from .checkpoint import run_name

        name, settings, writers = run_name(algorithm, seed), hparams(self.base, algorithm, seed), {}
        if "tensorboard" in self.names:
            from torch.utils.tensorboard import SummaryWriter
            from torch.utils.tensorboard.summary import hparams as hparams_summary

            writer = SummaryWriter(str(self.out / "tensorboard" / name), purge_step=0 if self.resumed else None)
            events = writer._get_file_writer()  # torch's own accessor of the run's event file (add_hparams uses it)
            for summary in hparams_summary(settings, {}):
                events.add_summary(summary)
            writer.add_text("config", "```\n" + json.dumps(settings, indent=2) + "\n```")
            writers["tensorboard"] = writer
        if "wandb" in self.names:
            import wandb

            (self.out / "wandb").mkdir(parents=True, exist_ok=True)
            writers["wandb"] = wandb.init(
                project=os.environ.get("WANDB_PROJECT", "pgloss"),
                name=name,
                group=self.out.name,
                dir=str(self.out),
                config=settings,
                mode=os.environ.get("WANDB_MODE", "offline"),
                reinit="create_new",
            )
        return writers

    def log(self, record: dict) -> None:
        key = (record["algorithm"], record["seed"])
        if key not in self.writers:
            self.writers[key] = self._open(*key)
        writers, values = self.writers[key], _numbers(record)
        if "tensorboard" in writers:
            for metric, value in values.items():
                writers["tensorboard"].add_scalar(metric, value, record["step"])
            writers["tensorboard"].flush()
        if "wandb" in writers:
            writers["wandb"].log(values, step=record["step"])

    def close(self) -> None:
        for writers in self.writers.values():
            if "tensorboard" in writers:
                writers["tensorboard"].close()
            if "wandb" in writers:
                writers["wandb"].finish()
        self.writers = {}
