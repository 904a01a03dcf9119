"""Shared pieces of the shared-memory loader tests (tests/test_loader*.py)."""

from __future__ import annotations

import gc
import os
import random
import time
from pathlib import Path

import pytest

from dataset_rt import DatasetRuntime, ReaderConfig, ShardCompression, WriterConfig
from dataset_rt.testing import make_source

SEED = 7


def payload(i: int, size: int | None = None) -> bytes:
    """Sample `i`'s payload: 1 to 200 bytes, or `size + i` bytes when `size` is given."""
    if size is not None:
        return random.Random(i).randbytes(size + i)
    return bytes((i * 7 + j) % 251 for j in range(1 + (i * 37) % 200))


def payload_lz4(i: int, size: int) -> bytes:
    """Sample `i`'s payload in an LZ4 cache (`load_lz4`): `size + i` bytes that LZ4 shrinks, so
    the loader carries it decompressed in its ring slot, not as a reference to its shard."""
    return i.to_bytes(8, "little") + bytes([i % 251]) * (size + i - 8)


def load_lz4(base: Path, n: int, size: int, **reader):
    """As `load`, an LZ4 cache of `n` samples of `payload_lz4(i, size)`."""
    reader.setdefault("seed", SEED)
    if not _runtime:
        _runtime.append(DatasetRuntime(num_workers=2))
    result = _runtime[0].from_cache_sources(
        make_source("loader", [(payload_lz4(i, size), {"i": i}) for i in range(n)]),
        base,
        reader_config=ReaderConfig(**reader),
        writer_config=WriterConfig(
            show_progress=False, shard_compression=ShardCompression(algo="lz4", ratio=0.5)
        ),
    )
    assert result.dataset is not None
    return result.dataset


def source(n: int, size: int | None = None):
    return make_source("loader", [(payload(i, size), {"i": i, "tag": f"s{i}"}) for i in range(n)])


_runtime: list[DatasetRuntime] = []


def load(base: Path, n: int, size: int | None = None, **reader):
    """A dataset of `n` samples under `base` (written on first use), on one shared runtime;
    `size`: see `payload`."""
    reader.setdefault("seed", SEED)
    if not _runtime:
        _runtime.append(DatasetRuntime(num_workers=2))
    result = _runtime[0].from_cache_sources(
        source(n, size),
        base,
        reader_config=ReaderConfig(**reader),
        writer_config=WriterConfig(show_progress=False),
    )
    assert result.dataset is not None
    return result.dataset


def own_segments(pid: int | None = None) -> list[str]:
    prefix = f"dataset-rt-{os.getpid() if pid is None else pid}-"
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefix))


def children(pid: int | None = None) -> list[int]:
    """Pids whose parent is `pid` (this process by default), zombies included."""
    parent = os.getpid() if pid is None else pid
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and not _python_helper(int(entry)):
            found.append(int(entry))
    return found


def _python_helper(pid: int) -> bool:
    """multiprocessing's resource tracker and fork server: started once by the spawn and
    forkserver contexts, live as long as this process, and are not the loader's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return False
    return b"resource_tracker" in cmdline or b"forkserver" in cmdline


def gone(pid: int) -> bool:
    """No process runs under `pid` (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


RESULT_MEMORY = "/memfd:dataset-rt-results"


def result_fds() -> list[str]:
    """This process's open descriptors of loader result memory (memfds, never in /dev/shm)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(RESULT_MEMORY):
            found.append(f"{fd} -> {target}")
    return found


def result_mappings(pid: int | str = "self") -> list[tuple[int, int]]:
    """The address ranges where a process (this one by default) maps loader result memory."""
    found = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if RESULT_MEMORY in line:
                start, end = line.split()[0].split("-")
                found.append((int(start, 16), int(end, 16)))
    return found


def in_result_memory(address: int, nbytes: int = 1) -> bool:
    return any(s <= address and address + nbytes <= e for s, e in result_mappings())


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture(autouse=True)
def no_leaks():
    """Every loader test leaves no child process, nothing of this process in /dev/shm, and no
    descriptor of result memory open."""
    yield
    assert wait_until(lambda: not children(), 5), f"child processes left: {children()}"
    assert own_segments() == [], f"segments left in /dev/shm: {own_segments()}"
    gc.collect()  # a test's caught exception may hold its frame, and the batches in it
    assert result_fds() == [], f"result memory left open: {result_fds()}"


def views_a_shard_map(view: memoryview) -> bool:
    """Whether ``view`` is a zero-copy view of a read-only shard map that DatasetRT owns (a
    numpy array over the map, whose base keeps it alive; no descriptor, no copy)."""
    import numpy as np

    from dataset_rt import _native

    array = view.obj
    return (
        isinstance(array, np.ndarray)
        and not array.flags.writeable
        and isinstance(array.base, _native.ShardMap)
    )
