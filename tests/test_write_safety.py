"""The write path under interruption and planted or unusual inputs: Ctrl-C stops a write cleanly
wherever it waits, published files are read-only, a planted lock link is refused, and names,
base directories and NumPy metadata get clear answers."""

from __future__ import annotations

import fcntl
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from dataset_rt import (
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWriteError,
    CacheWritten,
    ConfigError,
    ReaderConfig,
    WriterConfig,
)
from dataset_rt.testing import make_source

REPO = Path(__file__).resolve().parents[1]


def write(runtime, sources, base):
    return runtime.from_cache_sources(
        sources,
        base,
        reader_config=ReaderConfig(shuffle=False),
        writer_config=WriterConfig(show_progress=False),
    )


def wait_until(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def has_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        links = [os.readlink(fd) for fd in fds.iterdir()]
    except (FileNotFoundError, ProcessLookupError):  # a descriptor closed meanwhile
        return False
    return str(path) in links


def entries(base: Path) -> list[str]:
    return sorted(p.name for p in base.iterdir())


# --- Ctrl-C

WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dataset_rt import CacheInput, DatasetRuntime, WriterConfig

    class Slow:
        name = "c"
        def __iter__(self):
            for i in range(10**6):
                if i == 3:
                    print("writing", flush=True)
                time.sleep(0.01)
                yield CacheInput(b"x" * 1000, {"i": i})

    class Once:
        name = "c"
        def __iter__(self):
            print("writing", flush=True)
            yield CacheInput(b"x", {"i": 0})

    source = Slow() if sys.argv[2] == "slow" else Once()
    with DatasetRuntime(num_workers=2) as rt:
        print("ready", flush=True)
        try:
            rt.from_cache_sources(source, Path(sys.argv[1]),
                                  writer_config=WriterConfig(show_progress=False))
        except KeyboardInterrupt:
            print("KeyboardInterrupt", flush=True)
            sys.exit(3)
    print("returned", flush=True)
    """
)


def start_writer(tmp_path: Path, base: Path, kind: str) -> subprocess.Popen[str]:
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, str(script), str(base), kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )


def interrupt_and_wait(child: subprocess.Popen[str]) -> str:
    child.send_signal(signal.SIGINT)
    try:
        out, _ = child.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        child.kill()
        out, _ = child.communicate()
        pytest.fail(f"the write ignored Ctrl-C for 20 s; output: {out}")
    return out


def assert_next_write_works(runtime, base: Path) -> None:
    result = write(runtime, make_source("c", [(b"again", {"i": 0})]), base)
    assert isinstance(result.results[0], CacheWritten), result
    assert entries(base) == [".c.lock", "c"]


@pytest.mark.timeout(60)
def test_ctrl_c_stops_a_write_waiting_for_the_lock(runtime, tmp_path):
    """The lock is held by another writer (here: the test): the wait for it happens without the
    GIL, and must still give way to KeyboardInterrupt."""
    base = tmp_path / "base"
    base.mkdir()
    holder = os.open(base / ".c.lock", os.O_RDWR | os.O_CREAT, 0o644)
    child = None
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        child = start_writer(tmp_path, base, "once")
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        # Inside from_cache_sources, waiting for the lock: the writer opened the lock file and
        # polls it (a Ctrl-C before that would test nothing of the wait).
        lock = base / ".c.lock"
        assert wait_until(lambda: has_open(child.pid, lock), 60), "never reached the lock"
        out = interrupt_and_wait(child)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
            child.wait()
        os.close(holder)
    assert child.returncode == 3, out
    assert "KeyboardInterrupt" in out
    assert entries(base) == [".c.lock"]
    assert_next_write_works(runtime, base)


@pytest.mark.timeout(60)
def test_ctrl_c_stops_a_write_mid_source_and_leaves_nothing(runtime, tmp_path):
    base = tmp_path / "base"
    child = start_writer(tmp_path, base, "slow")
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        assert child.stdout.readline().strip() == "writing"
        time.sleep(0.3)
        out = interrupt_and_wait(child)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 3, out
    assert entries(base) == [".c.lock"]  # no temporary directory, nothing published
    assert_next_write_works(runtime, base)


# --- published files


def test_published_files_are_read_only(runtime, tmp_path):
    write(runtime, make_source("c", [(b"x" * 100, {"i": i}) for i in range(5)]), tmp_path)
    cache = tmp_path / "c"
    files = [p for p in cache.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"manifest.json", "index.bin", "metadata.arrow"}
    for path in files:
        assert stat.S_IMODE(path.stat().st_mode) == 0o444, path


# --- the lock file


def test_a_symlink_planted_as_the_lock_file_is_refused(runtime, tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "planted-target"
    (base / ".c.lock").symlink_to(target)

    result = write(runtime, make_source("c", [(b"x", {})]), base)

    assert isinstance(result, CacheSourcesDatasetError)
    [failed] = result.results
    assert isinstance(failed, CacheWriteError)
    assert "symbolic link" in failed.message
    assert str(base / ".c.lock") in failed.message
    assert not target.exists()
    assert entries(outside) == []
    assert entries(base) == [".c.lock"]


# --- names and base directories


def test_a_source_name_that_is_not_utf8_gets_a_clear_error(runtime, tmp_path):
    name = os.fsdecode(b"caf\xe9")  # how Python shows a Latin-1 file name: a lone surrogate
    with pytest.raises(ConfigError, match="is not valid UTF-8") as info:
        write(runtime, make_source(name, [(b"x", {})]), tmp_path / "base")
    assert "no str attribute" not in str(info.value)
    assert not (tmp_path / "base").exists()


def test_names_too_long_for_the_temporary_directory_are_refused_up_front(runtime, tmp_path):
    with pytest.raises(ConfigError, match="at most 218 bytes"):
        write(runtime, make_source("n" * 219, [(b"x", {})]), tmp_path / "base")
    assert not (tmp_path / "base").exists()
    # The limit itself writes: the temporary directory's name still fits 255 bytes.
    result = write(runtime, make_source("n" * 218, [(b"x", {})]), tmp_path / "base")
    assert isinstance(result.results[0], CacheWritten), result


@pytest.mark.parametrize("below", [False, True], ids=["the_file", "below_the_file"])
def test_a_base_directory_that_is_a_file_gets_a_clear_error(runtime, tmp_path, below):
    file = tmp_path / "file"
    file.write_bytes(b"x")
    base = file / "below" if below else file
    with pytest.raises(ConfigError, match="is not a directory") as info:
        write(runtime, make_source("c", [(b"x", {})]), base)
    assert str(file) in str(info.value)
    assert "File exists" not in str(info.value)


# --- NumPy metadata


def test_numpy_scalars_in_metadata_are_stored_as_their_python_values(runtime, tmp_path):
    metadata = {
        "flag": np.bool_(True),
        "count": np.int64(-5),
        "small": np.uint8(200),
        "half": np.float32(1.5),
        "score": np.float64(0.25),
        "text": np.str_("abc"),
    }
    result = write(runtime, make_source("c", [(b"x", metadata)]), tmp_path)
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    [sample] = list(result.dataset)
    assert sample.metadata["flag"] is True
    for key, expected in [("count", -5), ("small", 200), ("half", 1.5), ("score", 0.25)]:
        value = sample.metadata[key]
        assert value == expected and type(value) is type(expected), (key, value)
    assert sample.metadata["text"] == "abc"


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        (np.datetime64("2024-01-01"), "numpy.datetime64 whose value is a date"),
        (np.uint64(2**63), "does not fit a 64-bit signed integer"),
        (np.complex64(1j), "numpy.complex64 whose value is a complex"),
    ],
    ids=["datetime64", "uint64_too_big", "complex64"],
)
def test_numpy_scalars_of_other_types_are_refused_clearly(runtime, tmp_path, value, needle):
    result = write(runtime, make_source("c", [(b"x", {"k": value})]), tmp_path)
    assert isinstance(result, CacheSourcesDatasetError)
    assert needle in result.results[0].message
