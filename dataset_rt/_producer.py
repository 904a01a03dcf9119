"""The loader's producer process: ``python -c LAUNCHER PACKAGE_ROOT OWNER_PID SPEC_PATH``
(:func:`command` builds it).

Its loop is Rust (``_native.run_producer``) and runs without the GIL. It exits when its owner
(the training process) is gone: the kernel's parent-death signal is not used here, because the
producer, unlike a consumer, must live long enough to remove the owner's segments itself.
"""

from __future__ import annotations

import os
import sys

from dataset_rt import _native

# Makes the producer import the same `dataset_rt` as the training process, found under
# PACKAGE_ROOT (argv[1]), without shadowing anything: the working directory ('' under -c) is
# dropped, and PACKAGE_ROOT goes first only when the default path does not already find that
# very package. An installed package's root is site-packages, which must never move in front of
# the standard library; a source checkout (or another copy found first) needs it.
PATH_SETUP = """\
import importlib.util, os, sys
if sys.path and sys.path[0] == "":
    del sys.path[0]
_root = os.path.realpath(sys.argv[1])
_found = importlib.util.find_spec("dataset_rt")
_where = [os.path.realpath(p) for p in (_found.submodule_search_locations or [])] if _found else []
if os.path.join(_root, "dataset_rt") not in _where:
    sys.path.insert(0, _root)
"""

LAUNCHER = PATH_SETUP + "from dataset_rt._producer import main\nsys.exit(main(sys.argv[2:]))\n"


def command(owner_pid: int, spec_path: str) -> list[str]:
    """The producer's command line: a fresh interpreter, whatever the multiprocessing context."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return [sys.executable, "-c", LAUNCHER, root, str(owner_pid), spec_path]


def main(argv: list[str]) -> int:
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
