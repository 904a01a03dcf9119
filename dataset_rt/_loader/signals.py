"""Signal dispositions of the loader's child processes (the producer and the workers).

A child must not run the training script's signal handlers: a worker forked while, say,
Lightning's SIGTERM handler is installed would otherwise ignore the SIGTERM that ends it. The
loader never relies on signals to stop its children (it uses the stop flag in the control
segment, then SIGKILL), but a SIGTERM sent to a child must still end it.
"""

from __future__ import annotations

import signal


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
