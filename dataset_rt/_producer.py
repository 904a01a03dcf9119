"""The loader's producer process: ``python -m dataset_rt._producer OWNER_PID SPEC_PATH``.

Its loop is Rust (``_native.run_producer``) and runs without the GIL. It exits when its owner
(the training process) is gone: the kernel's parent-death signal is not used here, because the
producer, unlike a consumer, must live long enough to remove the owner's segments itself.
"""

from __future__ import annotations

import os
import sys

from dataset_rt import _native


def main(argv: list[str]) -> int:
    owner_pid, spec_path = int(argv[1]), argv[2]
    if os.getppid() != owner_pid:
        return 1
    try:
        _native.run_producer(spec_path)
    except _native.RingClosed:
        return 0
    except BaseException as error:  # the error is also in the control segment
        print(f"dataset-rt producer: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
