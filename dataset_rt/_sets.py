"""Cache sets: one dataset written as parts, and the worker processes that write the parts.

``CacheSet(name, parts)`` is a source for ``from_cache_sources``. The runtime (Rust) decides
everything about a set: whether it is published, which parts are missing, the part names, when
the set is published. When ``WriterConfig(processes=N)`` asks for more than one process, it
calls :func:`write_parts` here, which only runs the processes: it hands each missing part to a
worker, relays the workers' counts to the set's progress line and returns each part's result.
"""

from __future__ import annotations

import os
import pickle
import signal
import time
from collections import deque
from collections.abc import Iterator, Sequence
from multiprocessing import get_context
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from types import FrameType
from typing import Any, Protocol

from dataset_rt import _native
from dataset_rt._config import WriterConfig
from dataset_rt._results import CacheInput

__all__ = ["CacheSet", "PartSource"]

# How long stopped workers get to remove their temporary directories before they are killed.
_STOP_GRACE_S = 5.0
# How often the parent redraws the line and looks for dead workers while it waits.
_POLL_S = 0.1


class PartSource(Protocol):
    """One part of a set: iterable over ``CacheInput`` (and picklable, to be written by a worker
    process)."""

    def __iter__(self) -> Iterator[CacheInput]: ...


class CacheSet:
    """A source made of parts: the cache set ``name``, whose part ``i`` is written from
    ``parts[i]``. Accepted wherever a source is (``from_cache_sources``). The set is published
    at ``base_cache_dir / name`` once every part is; its content depends on the parts and their
    order, never on how many processes wrote them."""

    __slots__ = ("name", "parts")

    def __init__(self, name: str, parts: Sequence[PartSource]) -> None:
        # A sequence: the parts' order decides the set's content, which a set's or a dict's
        # iteration order does not keep, and a generator would be used up by the first build.
        if isinstance(parts, (str, bytes, bytearray)) or not isinstance(parts, Sequence):
            raise _native.ConfigError(
                f"CacheSet {name!r}: parts must be a sequence of sources (a list or a tuple: "
                f"their order decides the set's content), got {type(parts).__name__}"
            )
        self.name = name
        self.parts: tuple[PartSource, ...] = tuple(parts)
        if not self.parts:
            raise _native.ConfigError(f"CacheSet {name!r} needs at least one part")

    def __len__(self) -> int:
        return len(self.parts)

    def __repr__(self) -> str:
        return f"CacheSet({self.name!r}, {len(self.parts)} parts)"


_NO_MAIN_GUARD = (
    "a script that builds a cache set with WriterConfig(processes > 1) needs the "
    '`if __name__ == "__main__":` guard around its build: the worker processes start with '
    "spawn, which imports the main module, and there its build would wait forever for the set "
    "that the parent process is building"
)


_NEVER_STARTED = (
    " before it started: see its error on stderr (a script that builds a set with "
    'WriterConfig(processes > 1) needs the `if __name__ == "__main__":` guard)'
)


def refuse_in_bootstrap() -> None:
    """Raises ``RuntimeError`` in a process that is itself starting (spawn imports the main
    module of a script without the ``__main__`` guard), where the native build of a set in
    worker processes calls it first: the build would wait for the lock of the set its parent
    is building."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(_NO_MAIN_GUARD)


class _Worker:
    """One worker process, its end of the pipe, and the part it is writing."""

    __slots__ = ("conn", "gone", "heard", "process", "stopped", "task")

    def __init__(self, process: BaseProcess, conn: Connection) -> None:
        self.process = process
        self.conn = conn
        self.task: int | None = None
        self.stopped = False  # told that there is no more work
        self.gone = False  # exited, or its pipe closed
        self.heard = False  # it sent something: it started


# Set in a worker process when the parent stops it (SIGTERM): the KeyboardInterrupt that unwinds
# the write is then the parent's, not the source's.
_stopped = False


def _worker_main(
    conn: Connection, parent_pid: int, threads: int, staging: str, writer: WriterConfig
) -> None:
    """A worker process: writes the parts the parent sends until it sends ``None``."""
    # Ctrl-C reaches the whole process group: the parent decides, and stops workers with
    # SIGTERM, which unwinds the write (its temporary directory is removed) and exits.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def stop(signum: int, frame: FrameType | None) -> None:
        global _stopped
        _stopped = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        if not _native.bind_to_parent(parent_pid):
            return
        runtime = _native.Runtime(threads)
        try:
            while True:
                try:
                    task = conn.recv()
                except EOFError:
                    return
                if task is None:
                    return
                index, name, payload = task
                result = _write_one(runtime, conn, index, name, payload, staging, writer)
                conn.send(("done", index, *result))
        finally:
            runtime.close()
    except KeyboardInterrupt:
        return


def _write_one(
    runtime: _native.Runtime,
    conn: Connection,
    index: int,
    name: str,
    payload: bytes,
    staging: str,
    writer: WriterConfig,
) -> tuple[str, str | None, int, int]:
    def report(samples: int, nbytes: int) -> None:
        conn.send(("progress", index, samples, nbytes))

    try:
        source = pickle.loads(payload)
    except Exception as error:
        return (
            "write_error",
            f"part {index} ({name}) could not be unpickled in the worker process: "
            f"{type(error).__name__}: {error}",
            0,
            0,
        )
    try:
        return _native.write_part(runtime, source, staging, name, writer, report)
    except Exception as error:
        return ("write_error", f"part {index} ({name}): {type(error).__name__}: {error}", 0, 0)
    except BaseException as error:
        if _stopped:  # the parent's SIGTERM: the worker exits
            raise
        # The source's own SystemExit or KeyboardInterrupt (SIGINT is ignored here): in this
        # process it would have ended the build; in a worker it fails its part, with its cause.
        return (
            "write_error",
            f"part {index} ({name}): the source raised {error!r} in the worker process",
            0,
            0,
        )


def _describe_exit(process: BaseProcess) -> str:
    code = process.exitcode
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stop(workers: Sequence[_Worker]) -> None:
    """Stops every worker: SIGTERM (the write unwinds and removes its temporary directory),
    then SIGKILL for any still running after the grace period; all are joined."""
    for w in workers:
        if w.process.is_alive():
            w.process.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for w in workers:
        w.process.join(max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()


def write_parts(
    parts: Sequence[Any],
    indexes: Sequence[int],
    names: Sequence[str],
    staging: str | os.PathLike[str],
    writer: WriterConfig,
    processes: int,
    threads: int,
    progress: _native.SetProgress | None,
) -> list[tuple[int, str, str | None, int, int]]:
    """Writes parts ``indexes`` (named ``names``) into ``staging`` in ``processes`` worker
    processes of ``threads`` Rust threads each; returns ``(index, kind, message, samples,
    raw_bytes)`` for each, kind ``"written"``, ``"loaded"`` or ``"write_error"``. A part whose
    worker dies is reported failed and a new worker takes the next part. Any exception here
    (KeyboardInterrupt) stops every worker before it propagates."""
    context = get_context("spawn")
    staging = os.fspath(staging)
    pending = deque(zip(indexes, names, strict=True))
    results: dict[int, tuple[int, str, str | None, int, int]] = {}
    running: dict[int, tuple[int, int]] = {}  # part -> counts reported so far
    finished = [0, 0]  # samples, bytes of the parts done
    workers: list[_Worker] = []

    def start() -> None:
        parent_end, child_end = context.Pipe()
        process = context.Process(
            target=_worker_main,
            args=(child_end, os.getpid(), threads, staging, writer),
            name="dataset-rt-part-writer",
            # Not a daemon, so that a part may start processes of its own (a decoding pool);
            # the worker dies with this process all the same (bind_to_parent, and _stop).
            daemon=False,
        )
        process.start()
        child_end.close()
        workers.append(_Worker(process, parent_end))

    def fail(index: int, message: str) -> None:
        results[index] = (index, "write_error", message, 0, 0)

    def dispatch(worker: _Worker) -> None:
        """Gives the worker the next part that pickles, or tells it that there is none."""
        while pending:
            index, name = pending.popleft()
            try:
                payload = pickle.dumps(parts[index], protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as error:
                fail(
                    index,
                    f"part {index} ({type(parts[index]).__name__}) cannot be pickled for a "
                    f"worker process: {type(error).__name__}: {error}; with "
                    "WriterConfig(processes > 1) parts must be picklable (instances of "
                    "module-level classes)",
                )
                continue
            try:
                worker.conn.send((index, name, payload))
            except OSError:  # the worker is gone: the part goes to another
                pending.appendleft((index, name))
                worker.gone = True
                return
            worker.task = index
            running[index] = (0, 0)
            return
        worker.stopped = True
        try:
            worker.conn.send(None)
        except OSError:
            worker.gone = True

    def receive(worker: _Worker) -> None:
        """Reads everything the worker sent; marks it gone once its pipe is closed."""
        try:
            while worker.conn.poll():
                message = worker.conn.recv()
                worker.heard = True
                if message[0] == "progress":
                    _, index, samples, nbytes = message
                    running[index] = (samples, nbytes)
                    continue
                _, index, kind, text, samples, nbytes = message
                results[index] = (index, kind, text, samples, nbytes)
                running.pop(index, None)
                finished[0] += samples
                finished[1] += nbytes
                worker.task = None
        except (EOFError, OSError):
            worker.gone = True
        if not worker.process.is_alive():
            worker.gone = True

    try:
        for _ in range(min(processes, len(pending))):
            start()
        while pending or any(w.task is not None for w in workers):
            for worker in workers:
                if worker.task is None and not (worker.stopped or worker.gone):
                    dispatch(worker)
            busy = [w for w in workers if w.task is not None and not w.gone]
            if busy:
                wait([w.conn for w in busy] + [w.process.sentinel for w in busy], _POLL_S)
            for worker in busy:
                receive(worker)
                if worker.gone and worker.task is not None:
                    # The worker died in the middle of a part: that part failed.
                    worker.process.join()
                    index, worker.task = worker.task, None
                    running.pop(index, None)
                    # One that never started says why on its stderr: most often spawn's
                    # import of a main module without the guard.
                    hint = "" if worker.heard else _NEVER_STARTED
                    fail(
                        index,
                        f"the worker process (pid {worker.process.pid}) writing part {index} "
                        f"{_describe_exit(worker.process)}{hint}; the part was not published",
                    )
            working = sum(1 for w in workers if not (w.gone or w.stopped))
            for _ in range(min(processes - working, len(pending))):
                start()
            if progress is not None:
                samples = finished[0] + sum(s for s, _ in running.values())
                nbytes = finished[1] + sum(b for _, b in running.values())
                progress.update(samples, nbytes, len(results))
        for worker in workers:
            if not (worker.stopped or worker.gone):
                dispatch(worker)
        deadline = time.monotonic() + _STOP_GRACE_S
        for worker in workers:
            worker.process.join(max(0.0, deadline - time.monotonic()))
    finally:
        _stop(workers)
    return [results[i] for i in indexes]
