"""The runtime when it cannot run work: closed, or inherited by a forked child. Every entry point
raises a clear `RuntimeStateError` at once, creates nothing and never hangs."""

from __future__ import annotations

import os
import signal
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest

from dataset_rt import (
    CacheLoaded,
    CacheSourcesDatasetSuccess,
    DatasetRuntime,
    ReaderConfig,
    RuntimeStateError,
    WriterConfig,
)
from dataset_rt.testing import make_source

QUIET = WriterConfig(show_progress=False, prefetch_size=4)

# A hang here is the bug under test, with the GIL released inside Rust where pytest-timeout's
# default signal cannot reach: the thread method ends the run with every stack instead.
pytestmark = pytest.mark.timeout(120, method="thread")


def source(name: str, n: int = 40):  # type: ignore[no-untyped-def]
    return make_source(name, [(f"{name}:{i}".encode(), {"i": i}) for i in range(n)])


def listing(base: Path) -> list[str]:
    return sorted(p.name for p in base.iterdir()) if base.exists() else []


def test_closed_runtime_refuses_to_write_and_creates_nothing(tmp_path: Path) -> None:
    runtime = DatasetRuntime(num_workers=2)
    runtime.close()
    base = tmp_path / "base"
    src = source("fresh")

    with pytest.raises(RuntimeStateError, match="the DatasetRuntime is closed"):
        runtime.from_cache_sources(src, base, writer_config=QUIET)

    assert src.iterations == 0
    assert listing(base) == []  # no directory, lock file or temporary directory


def test_closed_runtime_refuses_to_load_instead_of_calling_the_cache_malformed(
    tmp_path: Path,
) -> None:
    with DatasetRuntime(num_workers=2) as runtime:
        written = runtime.from_cache_sources(source("kept"), tmp_path, writer_config=QUIET)
        assert isinstance(written, CacheSourcesDatasetSuccess)
    before = listing(tmp_path)

    with pytest.raises(RuntimeStateError, match="the DatasetRuntime is closed"):
        runtime.from_cache_sources(types.SimpleNamespace(name="kept"), tmp_path)

    assert listing(tmp_path) == before
    with DatasetRuntime(num_workers=1) as fresh:  # the cache itself is fine
        again = fresh.from_cache_sources(types.SimpleNamespace(name="kept"), tmp_path)
        assert again.results == [CacheLoaded("kept", tmp_path / "kept", 40)]


def test_closed_runtime_refuses_a_new_pass(tmp_path: Path) -> None:
    with DatasetRuntime(num_workers=2) as runtime:
        dataset = runtime.from_cache_sources(source("pass"), tmp_path, writer_config=QUIET).dataset
        assert len(list(dataset)) == 40
    with pytest.raises(RuntimeStateError, match="the DatasetRuntime is closed"):
        iter(dataset)


# ---- a forked child


def in_forked_child(action: Callable[[], object], timeout: float = 30) -> str:
    """Runs `action` in a child made by os.fork and returns what it raised, as
    "TypeName: message" ("no error" when it returned). The child reports through a pipe and
    leaves with os._exit; one that does not finish within `timeout` is killed and fails the
    test, so a deadlock shows as a failure, not a hung suite."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        # Python 3.12+ warns that forking a multi-threaded process may deadlock the child:
        # that is the very case under test.
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child
        code = 0
        try:
            os.close(read_end)
            try:
                action()
                report = "no error"
            except BaseException as error:
                report = f"{type(error).__name__}: {error}"
            os.write(write_end, report.encode())
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    try:
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the forked child hung for {timeout} s")
            time.sleep(0.01)
        assert os.waitstatus_to_exitcode(status) == 0
        chunks = []
        while chunk := os.read(read_end, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(read_end)


@pytest.fixture
def parent(tmp_path: Path):  # type: ignore[no-untyped-def]
    """A runtime with busy worker threads, a dataset over one cache and an iterator in the
    middle of a pass (its read-ahead in flight), as a training process has them at fork."""
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            source("forked", 400),
            tmp_path,
            reader_config=ReaderConfig(prefetch_size=64),
            writer_config=QUIET,
        )
        dataset = result.dataset
        assert len(list(dataset)) == 400  # the next pass's order is not cached: epoch 1
        dataset.set_epoch(0)  # ... and this one's is
        iterator = iter(dataset)
        next(iterator)
        yield types.SimpleNamespace(
            runtime=runtime, dataset=dataset, iterator=iterator, base=tmp_path
        )


FORKED = "RuntimeStateError: this DatasetRuntime was created in process"


def test_forked_child_gets_a_clear_error_from_a_running_iterator(parent) -> None:  # type: ignore[no-untyped-def]
    report = in_forked_child(lambda: next(parent.iterator))
    assert report.startswith(FORKED), report
    assert "forked process" in report
    assert "create a new DatasetRuntime in the child" in report
    assert next(parent.iterator) is not None  # the parent is unaffected


@pytest.mark.parametrize("epoch", [0, 5], ids=["cached_order", "new_order"])
def test_forked_child_gets_a_clear_error_from_a_new_pass(parent, epoch: int) -> None:  # type: ignore[no-untyped-def]
    def new_pass() -> None:
        parent.dataset.set_epoch(epoch)
        next(iter(parent.dataset))

    report = in_forked_child(new_pass)
    assert report.startswith(FORKED), report


def test_forked_child_gets_a_clear_error_when_loading(parent) -> None:  # type: ignore[no-untyped-def]
    report = in_forked_child(
        lambda: parent.runtime.from_cache_sources(
            types.SimpleNamespace(name="forked"), parent.base, writer_config=QUIET
        )
    )
    assert report.startswith(FORKED), report


def test_forked_child_gets_a_clear_error_when_writing(parent) -> None:  # type: ignore[no-untyped-def]
    report = in_forked_child(
        lambda: parent.runtime.from_cache_sources(
            source("written_in_child"), parent.base, writer_config=QUIET
        )
    )
    assert report.startswith(FORKED), report
    assert not any("written_in_child" in name for name in listing(parent.base))


def test_a_new_runtime_works_in_a_forked_child(parent) -> None:  # type: ignore[no-untyped-def]
    def fresh() -> None:
        with DatasetRuntime(num_workers=1) as runtime:
            result = runtime.from_cache_sources(
                source("child_cache", 5), parent.base, writer_config=QUIET
            )
            assert len(list(result.dataset)) == 5

    assert in_forked_child(fresh) == "no error"
