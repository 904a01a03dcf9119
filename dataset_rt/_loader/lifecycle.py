"""How the loader's processes end: bounded waits, then SIGKILL (:func:`stop_children`), and the
interpreter's exit hook that closes every open pass first (:func:`close_open_passes`).

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
import subprocess
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

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
