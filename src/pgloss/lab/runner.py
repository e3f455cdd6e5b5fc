"""How the lab's commands run their jobs: in this process or in a pool of spawned processes,
with every step reported to the main process as it is made, and one way to stop.

Ctrl-C and SIGTERM (``timeout``, ``docker stop``, a scheduler) end a command alike: `interruptible`
turns SIGTERM into the KeyboardInterrupt that Ctrl-C raises, so the command stops its workers,
writes what finished and records its status. Workers ignore SIGINT (the main process handles
it) and die on SIGTERM; the main process stops them by killing them (`Runner`). Once the training is over (finished or
stopped), `Held` takes both signals: they are noted, not raised, until the report and plots of
what finished are written, so no signal costs a finished run its report.

Items a job reports (``emit``): ``{"started": [label, seed]}``, ``{"warm": steps, "seconds": s}``
(warm-start steps made) and ``{"record": {...}, "seconds": s}`` (an RL step's metrics).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multiprocessing import Queue
    from multiprocessing.process import BaseProcess

WARM, RL = "warm start", "RL"  # the phases of the progress bar
_EMIT = None  # where a job's items go: the main process's sink, or a queue's put in a worker


def _worker(jobs, items) -> None:
    """A worker process: run each ``(i, fn, args)`` of `jobs` until None, sending ``{"job": i, "result": ...}``
    (or ``"error"``) and every item the job emits on `items`, the one queue the main process reads."""
    global _EMIT
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _EMIT = items.put
    while (job := jobs.get()) is not None:
        i, fn, args = job
        try:
            items.put({"job": i, "result": fn(*args)})
        except Exception as err:
            import traceback

            items.put({"job": i, "error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()})


def emit(item: dict) -> None:
    """Report `item` to the main process (nothing when no runner is running the job)."""
    if _EMIT is not None:
        _EMIT(item)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interruptible():
    """Within the block, SIGTERM raises KeyboardInterrupt as Ctrl-C does (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class Held:
    """From `hold()` on (or within ``with``), SIGINT and SIGTERM are noted in `received` instead of
    raising: the work that remains (a finished run's return, its report and plots) completes. `release()`
    puts the earlier handlers back. Outside the main thread it holds nothing (signals go to the main thread)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._previous: dict | None = None

    def hold(self) -> None:
        if self._previous is not None or threading.current_thread() is not threading.main_thread():
            return
        self._previous = {s: signal.signal(s, self._note) for s in (signal.SIGINT, signal.SIGTERM)}

    def _note(self, signum, frame) -> None:
        self.received.append(signum)

    def release(self) -> None:
        if self._previous is not None:
            for s, handler in self._previous.items():
                signal.signal(s, handler)
            self._previous = None

    def __enter__(self) -> Held:
        self.hold()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def require_extras() -> None:
    """Import what the reports, plots and progress bar need, so that a missing package fails before
    any work (and Ctrl-C cannot land inside an import). ValueError naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot
        import safetensors.torch  # noqa: F401 (the trained policy's file)
        import tqdm  # noqa: F401
    except ImportError as err:
        raise ValueError(
            f"this command needs matplotlib, tqdm and safetensors ({err}); install them with "
            "pip install -e '.[lab]' in a clone of pgloss"
        ) from None


class Runner:
    """Runs jobs in this process (one worker) or in `workers` spawned processes; every item a job
    emits goes to ``sink(item)`` in this process as it comes.

    The processes are the lab's own, not a ``multiprocessing.Pool``: a signal to the whole process
    group kills idle workers too, and a pool whose idle worker died waiting for a job (holding the
    task queue's lock) never stops. Here the main process only writes the job queue and only reads
    the item queue, so it waits on no lock a worker holds, and it stops the workers by killing them."""

    def __init__(self, workers: int, sink: Callable[[dict], None]) -> None:
        self.sink = sink
        self.processes: list[BaseProcess] = []
        self.queues: tuple[Queue, Queue] | None = None
        """The job queue (this process writes it) and the item queue (it reads it); None: jobs run here."""
        if workers > 1:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.queues = ctx.Queue(), ctx.Queue()
            self.processes = [ctx.Process(target=_worker, args=self.queues, daemon=True) for _ in range(workers)]
            for process in self.processes:
                process.start()

    def map(self, fn, jobs: list[tuple], done: dict, on_done=None) -> None:
        """``done[i] = fn(*jobs[i])`` as each job finishes, then ``on_done(done[i])``: after a
        KeyboardInterrupt, `done` holds the jobs that finished. An exception of a job is raised here
        (RuntimeError with its traceback, from a worker); RuntimeError when a worker died."""
        global _EMIT
        if self.queues is None:
            _EMIT = self.sink
            try:
                for i, job in enumerate(jobs):
                    done[i] = fn(*job)
                    if on_done is not None:
                        on_done(done[i])
            finally:
                _EMIT = None
            return
        import queue as queue_module

        job_queue, items = self.queues
        for i, job in enumerate(jobs):
            job_queue.put((i, fn, job))
        pending = set(range(len(jobs)))
        while pending:
            try:
                item = items.get(timeout=0.2)
            except queue_module.Empty:
                if any(p.exitcode is not None for p in self.processes):  # a worker exits only when closed
                    raise RuntimeError(
                        f"a worker process died with {len(pending)} jobs left (exit codes "
                        f"{[p.exitcode for p in self.processes]})"
                    ) from None
                continue
            if "job" not in item:
                self.sink(item)
            elif "error" in item:
                raise RuntimeError(f"{item['error']} in a worker process:\n{item['traceback']}")
            else:
                pending.discard(item["job"])
                done[item["job"]] = item["result"]
                if on_done is not None:
                    on_done(item["result"])

    def close(self, terminate: bool = False) -> None:
        """Let the workers finish (or, after an interruption, kill them) and release the queues."""
        if self.queues is None:
            return
        for _ in self.processes if not terminate else ():
            self.queues[0].put(None)
        for process in self.processes:
            if terminate:
                process.kill()
            process.join()
        for queue in self.queues:
            queue.cancel_join_thread()
            queue.close()


def timed_steps(on_record):
    """An ``on_step`` for ``trainer.train`` that passes each record with the seconds since the last."""
    last = [time.perf_counter()]

    def on_step(record: dict) -> None:
        now = time.perf_counter()
        on_record({"record": record, "seconds": now - last[0]})
        last[0] = now

    return on_step


def _clean(value):
    return None if isinstance(value, float) and math.isnan(value) else value


class Sink:
    """Where the runs' items go (``runner``'s protocol): ``metrics.jsonl`` (one line per step,
    written as the runs go; none when `path` is None), the `trackers` of ``--report-to`` and the progress
    bar. `kept` (a resumed run's records up to its checkpoints) replaces what the file held before more
    records are appended."""

    def __init__(self, path: Path | None, progress=None, kept: list[dict] | None = None, trackers=None) -> None:
        self.progress, self.trackers = progress, trackers
        self.written: set[tuple[str, int, int]] = set()  # (algorithm, seed, step) of every record written
        self.started: set[tuple[str, int]] = set()  # (algorithm, seed) of the runs that started
        self.records: dict[tuple, list[dict]] = {}  # (algorithm, seed) -> its records, in the order written
        self.file = None
        if path is not None and kept is not None:  # whole or not at all: the checkpoints still hold these records
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps({k: _clean(v) for k, v in r.items()}) + "\n" for r in kept))
            tmp.replace(path)
        for record in kept or ():  # counted as written (the file is not open yet)
            self.write(record)
        if path is not None:
            self.file = open(path, "a" if kept is not None else "w")

    def __call__(self, item: dict) -> None:
        if "started" in item:
            self.started.add(tuple(item["started"]))
        elif "warm" in item:
            self._advance(WARM, item["warm"], item["seconds"])
        elif "record" in item:
            self.write(item["record"])
            self._advance(RL, 1, item["seconds"])

    def _advance(self, phase: str, steps: int, seconds: float) -> None:
        if self.progress is not None:
            self.progress.advance(phase, steps, seconds)

    def write(self, record: dict) -> None:
        key = (record["algorithm"], record["seed"], record["step"])
        if key not in self.written:  # a run's result repeats the records its worker streamed
            self.written.add(key)
            self.records.setdefault(key[:2], []).append(record)
            if self.file is not None:
                self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
                self.file.flush()
            if self.trackers is not None:  # --report-to: the same records
                self.trackers.log(record)

    def result(self, result) -> None:
        """A finished job's result: its records, in case some of its items are still on the way."""
        for record in result.get("metrics", []) if isinstance(result, dict) else []:
            self.write(record)

    def steps_done(self, algorithm: str, seed: int) -> int:
        return sum(1 for a, s, _ in self.written if (a, s) == (algorithm, seed))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.trackers is not None:
            self.trackers.close()
        if self.progress is not None:
            self.progress.close()
