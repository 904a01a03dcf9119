"""The loader's producer process: ``python -I -S -c LAUNCHER PACKAGE_ROOT OWNER_PID SPEC_PATH``
(:func:`command` builds it).

Its loop is Rust (``_native.run_producer``) and runs without the GIL. It exits when its owner
(the training process) is gone: the kernel's parent-death signal is not used here, because the
producer, unlike a consumer, must live long enough to remove the owner's segments itself. It
starts with SIGTERM at its default action and SIGINT ignored, whatever the training process set
(see :mod:`dataset_rt._loader.signals`); the training process stops it through the control segment.
"""

from __future__ import annotations

import os
import sys

from dataset_rt import _native
from dataset_rt._loader import signals

# The producer runs `python -I -S -c LAUNCHER`: isolated (no working directory, no PYTHONPATH or
# other PYTHON* variables, no user site) and without `site` (no site-packages, no .pth files).
# Its `sys.path` is the standard library alone and stays so. The launcher registers bare
# `dataset_rt` and `dataset_rt._loader` packages whose only paths are PACKAGE_ROOT/dataset_rt
# (the directory the training process imported `dataset_rt` from) and its `_loader`: the same
# package's modules, and nothing else of PACKAGE_ROOT, can be found. Neither `__init__` runs:
# the producer imports this module, `signals` and the native module, and nothing of the facade
# or of the rest of the loader (`sys` is built in).
LAUNCHER = (
    "import sys\n"
    "root = sys.argv[1] + '/dataset_rt'\n"
    "for name, path in (('dataset_rt', root), ('dataset_rt._loader', root + '/_loader')):\n"
    "    package = type(sys)(name)\n"
    "    package.__path__ = [path]\n"
    "    sys.modules[name] = package\n"
    "from dataset_rt._loader.producer import main\n"
    "sys.exit(main(sys.argv[2:]))\n"
)


def package_root() -> str:
    """The directory the running `dataset_rt` was imported from."""
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def command(owner_pid: int, spec_path: str) -> list[str]:
    """The producer's command line: a fresh interpreter, whatever the multiprocessing context."""
    return [sys.executable, "-I", "-S", "-c", LAUNCHER, package_root(), str(owner_pid), spec_path]


def main(argv: list[str]) -> int:
    # An ignored or blocked SIGTERM survives `exec`: the producer must still end on one.
    signals.reset_inherited()
    owner_pid, spec_path = int(argv[0]), argv[1]
    try:
        # Also when the owner is already gone: the names it could not remove are removed then.
        _native.run_producer(spec_path, owner_pid)
    except _native.RingClosed:
        return 0
    except BaseException as error:  # the error is also in the control segment
        print(f"dataset-rt producer: {error}", file=sys.stderr)
        return 1
    return 0
