"""How the lab's commands run their jobs: in this process or in a pool of spawned processes,
with every step reported to the main process as it is made, and one way to stop.

Ctrl-C and SIGTERM (``timeout``, ``docker stop``, a scheduler) end a command alike: `interruptible`
turns SIGTERM into the KeyboardInterrupt that Ctrl-C raises, so the command stops its workers,
writes what finished and records its status. Workers ignore SIGINT (the main process handles
it) and die on SIGTERM, which is how the pool is stopped.

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
from pathlib import Path

WARM, RL = "warm start", "RL"  # the phases of the progress bar
_EMIT = None  # where a job's items go: the main process's sink, or a queue's put in a worker


def _init_worker(queue) -> None:
    global _EMIT
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    _EMIT = queue.put


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


def require_extras() -> None:
    """Import what the reports, plots and progress bar need, so that a missing package fails before
    any work (and Ctrl-C cannot land inside an import). ValueError naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
        import tqdm  # noqa: F401
    except ImportError as err:
        raise ValueError(f"this command needs matplotlib and tqdm ({err}); install them with "
                         "pip install 'pgloss[lab]'") from None


class Runner:
    """Runs jobs in this process (one worker) or in a pool of `workers` spawned processes; every
    item a job emits goes to ``sink(item)`` in this process as it comes."""

    def __init__(self, workers: int, sink) -> None:
        self.sink, self.pool, self.queue = sink, None, None
        if workers > 1:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")
            self.queue = ctx.Queue()
            self.pool = ctx.Pool(workers, initializer=_init_worker, initargs=(self.queue,))

    def map(self, fn, jobs: list[tuple], done: dict, on_done=None) -> None:
        """``done[i] = fn(*jobs[i])`` as each job finishes, then ``on_done(done[i])``: after a
        KeyboardInterrupt, `done` holds the jobs that finished."""
        global _EMIT
        if self.pool is None:
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

        pending = {i: self.pool.apply_async(fn, job) for i, job in enumerate(jobs)}
        while pending:
            try:
                self.sink(self.queue.get(timeout=0.2))
            except queue_module.Empty:
                pass
            for i in [i for i, p in pending.items() if p.ready()]:
                done[i] = pending.pop(i).get()
                if on_done is not None:
                    on_done(done[i])
        while True:  # the items emitted just before the last job returned
            try:
                self.sink(self.queue.get_nowait())
            except queue_module.Empty:
                break

    def close(self, terminate: bool = False) -> None:
        """Let the workers finish (or, after an interruption, stop them) and release the pool."""
        if self.pool is not None:
            self.pool.terminate() if terminate else self.pool.close()
            self.pool.join()
        if self.queue is not None:
            self.queue.close()
            self.queue.join_thread()


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
    written as the runs go; none when `path` is None) and the progress bar."""

    def __init__(self, path: Path | None, progress=None) -> None:
        self.file = None if path is None else open(path, "w")
        self.progress, self.written, self.started = progress, set(), set()

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
            if self.file is not None:
                self.file.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")
                self.file.flush()

    def result(self, result) -> None:
        """A finished job's result: its records, in case some of its items are still on the way."""
        for record in result.get("metrics", []) if isinstance(result, dict) else []:
            self.write(record)

    def steps_done(self, algorithm: str, seed: int) -> int:
        return sum(1 for a, s, _ in self.written if (a, s) == (algorithm, seed))

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.progress is not None:
            self.progress.close()
