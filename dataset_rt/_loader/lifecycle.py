"""How the loader's processes end: bounded waits, then SIGKILL (:func:`stop_children`), the
interpreter's exit hook that closes every open pass first (:func:`close_open_passes`), and what a
forked child of the training process may do with the parent's loaders (:func:`check_owner`,
:func:`forget_in_child`).

Children never depend on the training script's signal handlers: they reset them at start
(:mod:`.signals`), and a pass stops them with the control segment's stop flag and a futex
wake-up, waits a bounded time, then SIGKILLs what is left. Which segments exist, who unlinks
them and when, and the reaping of leftovers are Rust's rules (reached through ``_native``).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.process
import multiprocessing.util  # registers multiprocessing's exit hook before ours: see the end
import os
import subprocess
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dataset_rt._native import RuntimeStateError

if TYPE_CHECKING:
    from dataset_rt._loader.passes import LoaderIterator

# How long close() lets children exit on their own before killing them: a stopped child that
# is waiting on the ring exits within milliseconds; one inside a long transform is killed.
EXIT_GRACE_S = 2.0
# The same at interpreter exit, where nothing waits for a result any more.
AT_EXIT_GRACE_S = 0.5
# How long a SIGKILLed child may take to be reaped (it cannot refuse; this only bounds the join).
KILL_WAIT_S = 2.0


def describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def stop_children(
    workers: Sequence[multiprocessing.process.BaseProcess],
    producer: subprocess.Popen[bytes] | None,
    grace: float,
) -> None:
    """Waits up to ``grace`` seconds in all for children already told to stop, then SIGKILLs
    and reaps the rest. No wait is unbounded."""
    deadline = time.monotonic() + grace
    for process in workers:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in workers:
        if process.is_alive():
            process.kill()
            process.join(KILL_WAIT_S)
    if producer is not None:
        try:
            producer.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            producer.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                producer.wait(KILL_WAIT_S)


# The passes of this process that are not closed yet.
open_passes: weakref.WeakSet[LoaderIterator] = weakref.WeakSet()
# The worker processes this process started (multiprocessing keeps its own record of them).
started_workers: weakref.WeakSet[multiprocessing.process.BaseProcess] = weakref.WeakSet()


def forked_error(owner: int, what: str) -> RuntimeStateError:
    """The error for using, in a forked child of process ``owner``, a loader or pass that
    process owns: its producer, workers, ring and pipes are the owner's, and a child that used
    them would take the owner's batches. Worded as the runtime's own fork check."""
    return RuntimeStateError(
        f"this {what} was created in process {owner} and its producer and workers belong to "
        f"that process, not to forked process {os.getpid()}; create a new DataLoader in the "
        "child"
    )


def forget_in_child() -> None:
    """``os.fork`` child hook: the child forgets the loader's worker processes and passes.

    A forked child inherits ``multiprocessing``'s record of the parent's daemonic children
    (the loader's workers, whatever their start method): without this, the child's exit hook
    would SIGTERM them, ending the parent's pass. The passes are marked as not owned here, so
    that nothing of the child (``close()``, ``__del__``, the exit hook) acts on the parent's
    processes, ring or pipes. Runs in every forked child, the loader's own fork-started
    workers included: Python state only, no system call."""
    children: set[multiprocessing.process.BaseProcess] = getattr(
        multiprocessing.process, "_children", set()
    )
    for process in list(started_workers):
        children.discard(process)
    started_workers.clear()
    for loader_pass in list(open_passes):
        loader_pass._disown()
    open_passes.clear()


def close_open_passes() -> None:
    """Closes every open pass at interpreter exit. ``atexit`` runs hooks last registered
    first, and ``multiprocessing.util`` (imported above) registered its own before this one: so
    the workers are stopped here, within a bound, before multiprocessing SIGTERMs its daemonic
    children and joins them with no timeout (forever, when a worker inherited a SIGTERM handler
    that ignores the signal)."""
    for loader_pass in list(open_passes):
        with contextlib.suppress(Exception):
            loader_pass.shutdown(AT_EXIT_GRACE_S)


atexit.register(close_open_passes)
os.register_at_fork(after_in_child=forget_in_child)
