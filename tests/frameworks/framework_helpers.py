"""What the framework tests share: skipping (or failing) without the framework, running a job
in its own processes, and checking what the job left and what its ranks read.

`DATASET_RT_REQUIRE_FRAMEWORKS=1` (`make test-frameworks`) turns a missing framework into a
failure instead of a skip.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
REQUIRED = os.environ.get("DATASET_RT_REQUIRE_FRAMEWORKS") == "1"
# Every process a job starts inherits this variable, with the job's own value.
MARKER = "DATASET_RT_FRAMEWORK_JOB"


def require(module: str) -> ModuleType:
    """`module`, or a skip of the calling test module when it is not installed; an ImportError
    (a failure) under DATASET_RT_REQUIRE_FRAMEWORKS=1."""
    if REQUIRED:
        return importlib.import_module(module)
    return pytest.importorskip(module)


def marked_processes(marker: str) -> list[int]:
    """Pids of live processes whose environment carries `marker` (zombies excluded)."""
    needle = f"{MARKER}={marker}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(entry))
        except (OSError, IndexError):
            continue
    return found


def _describe(pids: list[int]) -> list[str]:
    described = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode()
            described.append(f"{pid}: {cmdline[:200]}")
        except OSError:
            described.append(f"{pid}: (gone)")
    return described


class Job:
    """Runs job scripts of this directory with a marker in their environment; `leftovers()`
    says which of their processes are still alive, after a grace period, and kills them."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.marker = uuid.uuid4().hex
        self.env = {
            **os.environ,
            MARKER: self.marker,
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            "PYTHONUNBUFFERED": "1",
        }

    def run(self, command: list[str], timeout: float) -> str:
        """Runs `command` (its output is returned), failing the test with that output when it
        exits non-zero or outlives `timeout`."""
        process = subprocess.Popen(
            command,
            cwd=self.tmp_path,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output, _ = process.communicate()
            pytest.fail(f"{command} ran past {timeout} s:\n{output.decode()[-6000:]}")
        text = output.decode()
        if process.returncode != 0:
            pytest.fail(f"{command} exited with {process.returncode}:\n{text[-6000:]}")
        return text

    def python(self, script: str, *args: str, timeout: float = 120) -> str:
        return self.run([sys.executable, str(HERE / script), *args], timeout)

    def leftovers(self, grace: float = 10.0) -> list[str]:
        deadline = time.monotonic() + grace
        while (pids := marked_processes(self.marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        described = _describe(pids)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return described


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    """A `Job` whose processes must all be gone when the test ends (killed either way)."""
    runner = Job(tmp_path)
    yield runner
    left = runner.leftovers()
    assert left == [], f"processes left behind: {left}"


def records(out: Path, world_size: int = 2) -> list[dict[str, Any]]:
    """The records of ranks 0..world_size-1 in `out`."""
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def assert_no_segments(pids: list[int]) -> None:
    """No /dev/shm entry of the loaders these training processes owned is left."""
    left = [
        name
        for name in os.listdir("/dev/shm")
        for pid in pids
        if name.startswith(f"dataset-rt-{pid}-")
    ]
    assert left == [], f"/dev/shm entries left behind: {left}"


def assert_each_sample_once(steps_per_rank: list[list[list[int]]], samples: int, epochs: int):
    """Every epoch reads each of `samples` once across the ranks, plus the rank split's padding
    (fewer than one sample per rank, and only repeats), and no rank reads another's samples."""
    per_epoch = [len(steps) // epochs for steps in steps_per_rank]
    assert len(set(per_epoch)) == 1, f"ranks took different numbers of steps: {per_epoch}"
    n = per_epoch[0]
    for epoch in range(epochs):
        shares = [
            [i for batch in steps[epoch * n : (epoch + 1) * n] for i in batch]
            for steps in steps_per_rank
        ]
        read = [i for share in shares for i in share]
        padding = len(read) - samples
        assert sorted(set(read)) == list(range(samples)), f"epoch {epoch}: {shares}"
        assert 0 <= padding < len(shares), f"epoch {epoch}: {padding} samples of padding"
        if padding == 0:
            assert len(set(shares[0]) & set(shares[1])) == 0
