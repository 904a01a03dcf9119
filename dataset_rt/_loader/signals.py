"""Signal dispositions of the loader's child processes (the producer and the workers).

A child must not run the training script's signal handlers: a worker forked while, say,
Lightning's SIGTERM handler is installed would otherwise ignore the SIGTERM that ends it. The
loader never relies on signals to stop its children (it uses the stop flag in the control
segment, then SIGKILL), but a SIGTERM sent to a child must still end it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Defers the Python-level signal handlers of the training process (Ctrl-C's
    ``KeyboardInterrupt``, an alarm's) until the block is over, so that what it creates
    (segments, a child process) is recorded where ``close()`` finds it before a handler's
    exception can come between. A signal that arrives meanwhile is raised again as the block
    ends, and its own handler runs then. Not a signal mask: another thread of the process (the
    runtime's) would take the signal and Python would run the handler in the block anyway.
    Handlers run, and are set, in the main thread only: elsewhere nothing is deferred."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers = {}
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError):
            handler = signal.getsignal(sig)
            if callable(handler):
                handlers[sig] = handler
    arrived: list[int] = []
    swapped = {}
    try:
        for sig, handler in handlers.items():
            signal.signal(sig, lambda signum, _frame: arrived.append(signum))
            swapped[sig] = handler
        yield
    finally:
        # A handler put back can run at once and raise: every other one is still put back.
        raised: BaseException | None = None
        for sig, handler in swapped.items():
            while signal.getsignal(sig) is not handler:
                try:
                    signal.signal(sig, handler)
                except BaseException as error:
                    raised = raised or error
        if raised is not None:
            raise raised
        for number in arrived:
            signal.raise_signal(number)


def reset_inherited() -> None:
    """Called first in every child: the handlers of a fresh process instead of the parent's.

    - Every Python-level handler inherited by a fork goes back to the default action.
    - SIGTERM takes its default action (ends the process), also where the parent ignored or
      blocked it: both survive ``fork`` and ``exec``.
    - SIGINT is ignored: Ctrl-C reaches the whole process group, and the training process,
      which gets it too, decides; its loader then stops the children.
    - A wake-up fd (asyncio installs one) is dropped: it belongs to the parent.
    """
    signal.set_wakeup_fd(-1)
    for sig in signal.valid_signals():
        try:
            handler = signal.getsignal(sig)
        except (OSError, ValueError):
            continue
        if callable(handler) and sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
