"""Atomic publication: a killed writer leaves no cache and the next run recovers; concurrent
writers of one cache both succeed with one published, valid cache."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

import dataset_rt
from dataset_rt import (
    CacheInput,
    CacheLoaded,
    CacheWritten,
    DatasetRuntime,
    ReaderConfig,
    WriterConfig,
)
from dataset_rt.testing import assert_cache_equal, make_source

REPO_ROOT = Path(dataset_rt.__file__).resolve().parents[1]

# A writer process. Its source sleeps per sample so the parent can act while it writes; it
# touches `started` once it has yielded 20 samples, and with `go` set it first announces `ready`
# and waits for `go` to exist, so two writers can be released at the same moment.
WRITER = r"""
import json, sys, time
from pathlib import Path
from dataset_rt import CacheInput, DatasetRuntime, ReaderConfig, WriterConfig

args = json.loads(sys.argv[1])

def payload(i):
    return i.to_bytes(4, "little") * 64

class Slow:
    name = args["name"]

    def __iter__(self):
        for i in range(args["count"]):
            if i == 20 and args.get("started"):
                Path(args["started"]).touch()
            time.sleep(args["delay"])
            yield CacheInput(payload(i), {"i": i})

if args.get("go"):
    Path(args["ready"]).touch()
    deadline = time.monotonic() + 60
    while not Path(args["go"]).exists():
        if time.monotonic() > deadline:
            sys.exit("never released")
        time.sleep(0.005)

with DatasetRuntime(num_workers=2) as runtime:
    result = runtime.from_cache_sources(
        Slow(),
        args["base"],
        reader_config=ReaderConfig(shuffle=False),
        writer_config=WriterConfig(show_progress=False, prefetch_size=8, shard_size_bytes=4096),
    )
    outcome = result.results[0]
    read = [bytes(s.data) == payload(s.metadata["i"]) for s in result.dataset]
    print(json.dumps({"kind": type(outcome).__name__, "samples": len(read), "ok": all(read)}))
"""


# Loads the cache `ro` from `base` under the directory argv[1] with no write permission there:
# as root it drops to the `nobody` user, after importing everything it needs and after entering
# the directory (its parents, made by pytest, are private).
READ_ONLY_LOADER = r"""
import json, mmap, os, sys, types
from dataset_rt import DatasetRuntime, ReaderConfig, WriterConfig

os.chdir(sys.argv[1])
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
with DatasetRuntime(num_workers=1) as runtime:
    result = runtime.from_cache_sources(
        types.SimpleNamespace(name="ro"),
        "base",
        reader_config=ReaderConfig(shuffle=False, validate_cache=True),
        writer_config=WriterConfig(show_progress=False),
    )
    outcome = result.results[0]
    data = [bytes(s.data).decode() for s in result.dataset] if hasattr(result, "dataset") else []
    print(json.dumps({"kind": type(outcome).__name__, "detail": str(outcome), "data": data}))
"""


# Runs one from_cache_sources call on `base` under the directory argv[1] as a user without the
# root's powers (as root it drops to `nobody` after importing, like READ_ONLY_LOADER), and
# prints the outcome, or the exception it raised with its errno.
UNPRIVILEGED_CALL = r"""
import json, os, sys, types
from dataset_rt import CacheInput, DatasetRuntime, ReaderConfig, WriterConfig

os.chdir(sys.argv[1])
name, samples = sys.argv[2], int(sys.argv[3])
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)

class Source:
    def __init__(self):
        self.name = name

    def __iter__(self):
        return (CacheInput(f"{name}:{i}".encode(), {"i": i}) for i in range(samples))

with DatasetRuntime(num_workers=1) as runtime:
    try:
        result = runtime.from_cache_sources(
            Source() if samples else types.SimpleNamespace(name=name),
            "base",
            reader_config=ReaderConfig(shuffle=False),
            writer_config=WriterConfig(show_progress=False),
        )
    except Exception as error:
        report = {"raised": type(error).__name__, "errno": getattr(error, "errno", None),
                  "detail": str(error)}
    else:
        outcome = result.results[0]
        dataset = getattr(result, "dataset", [])
        data = [bytes(s.data).decode() for s in dataset]
        report = {"kind": type(outcome).__name__, "detail": str(outcome), "data": data}
print(json.dumps(report))
"""


def unprivileged_call(tmp_path: Path, name: str, samples: int) -> dict:
    tmp_path.chmod(0o711)  # the child enters it; pytest's parents stay private
    try:
        done = subprocess.run(
            [sys.executable, "-c", UNPRIVILEGED_CALL, str(tmp_path), name, str(samples)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )
    finally:
        tmp_path.chmod(0o700)
    assert done.returncode == 0, done.stderr
    report: dict = json.loads(done.stdout.strip().splitlines()[-1])
    return report


def payload(i: int) -> bytes:
    return i.to_bytes(4, "little") * 64


def expected(name: str, count: int):
    return make_source(name, [(payload(i), {"i": i}) for i in range(count)])


def child_env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def spawn(**args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", WRITER, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


@pytest.fixture
def processes():
    """Started writer processes; any still alive at the end are killed and reaped."""
    started: list[subprocess.Popen] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


def wait_for(condition, what: str, procs=(), timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                pytest.fail(f"writer exited with {proc.returncode} before {what}: {out}{err}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


def tmp_dirs(base: Path, name: str) -> list[Path]:
    return sorted(base.glob(f".{name}.tmp-*"))


def test_sigkill_mid_write_leaves_no_cache_and_the_next_run_recovers(runtime, tmp_path, processes):
    base, name = tmp_path / "base", "killed"
    started = tmp_path / "started"
    proc = spawn(base=str(base), name=name, count=100_000, delay=0.002, started=str(started))
    processes.append(proc)

    wait_for(lambda: started.exists() and tmp_dirs(base, name), "the write to start", [proc])
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)

    assert proc.returncode == -signal.SIGKILL
    assert not (base / name).exists()
    (leftover,) = tmp_dirs(base, name)  # the dead writer's half-written directory

    source = expected(name, 50)
    result = runtime.from_cache_sources(
        source,
        base,
        reader_config=ReaderConfig(shuffle=False, validate_cache=True),
        writer_config=WriterConfig(show_progress=False),
    )

    assert result.results == [CacheWritten(name, base / name, 50)]
    assert not leftover.exists()
    assert tmp_dirs(base, name) == []
    assert_cache_equal(result.dataset, source)


def test_two_processes_writing_one_cache_both_succeed(runtime, tmp_path, processes):
    base, name, count = tmp_path / "base", "contended", 300
    go = tmp_path / "go"
    for k in range(2):
        processes.append(
            spawn(
                base=str(base),
                name=name,
                count=count,
                delay=0.001,
                ready=str(tmp_path / f"ready{k}"),
                go=str(go),
            )
        )
    wait_for(
        lambda: all((tmp_path / f"ready{k}").exists() for k in range(2)), "both writers", processes
    )
    go.touch()

    reports = []
    for proc in processes:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        reports.append(json.loads(out.strip().splitlines()[-1]))

    assert sorted(r["kind"] for r in reports) == ["CacheLoaded", "CacheWritten"]
    assert all(r["samples"] == count and r["ok"] for r in reports), reports
    assert tmp_dirs(base, name) == []
    result = runtime.from_cache_sources(
        expected(name, count),
        base,
        reader_config=ReaderConfig(shuffle=False, validate_cache=True),
        writer_config=WriterConfig(show_progress=False),
    )
    assert result.results == [CacheLoaded(name, base / name, count)]
    assert_cache_equal(result.dataset, expected(name, count))


def test_two_threads_writing_one_cache_both_succeed(tmp_path):
    name, count = "threads", 200
    barrier = threading.Barrier(2)
    results: list = [None, None]

    class Slow:
        def __init__(self):
            self.name = name

        def __iter__(self):
            for i in range(count):
                time.sleep(0.0005)
                yield CacheInput(payload(i), {"i": i})

    def write(k: int) -> None:
        with DatasetRuntime(num_workers=1) as rt:
            barrier.wait()
            result = rt.from_cache_sources(
                Slow(),
                tmp_path,
                reader_config=ReaderConfig(shuffle=False),
                writer_config=WriterConfig(show_progress=False),
            )
            results[k] = (result.results[0], [bytes(s.data) for s in result.dataset])

    threads = [threading.Thread(target=write, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)

    kinds = sorted(type(r[0]).__name__ for r in results)
    assert kinds == ["CacheLoaded", "CacheWritten"]
    for _, data in results:
        assert data == [payload(i) for i in range(count)]


def test_leftover_of_a_dead_writer_is_removed_by_the_next_write(runtime, tmp_path):
    # A writer that died before publishing leaves its temporary sibling directory behind.
    leftover = tmp_path / ".stale.tmp-999999-1"
    (leftover / "shards").mkdir(parents=True)
    (leftover / "shards" / "000000.bin").write_bytes(b"half a shard")
    other = tmp_path / ".stale2.tmp-999999-1"  # another cache's leftover is not this writer's
    other.mkdir()

    result = runtime.from_cache_sources(
        make_source("stale", [(b"fresh", {})]),
        tmp_path,
        writer_config=WriterConfig(show_progress=False),
    )

    assert result.results == [CacheWritten("stale", tmp_path / "stale", 1)]
    assert not leftover.exists()
    assert other.exists()


def test_published_cache_is_never_rewritten(runtime, tmp_path):
    first = make_source("fixed", [(b"original", {"v": 1})])
    runtime.from_cache_sources(first, tmp_path, writer_config=WriterConfig(show_progress=False))
    manifest = tmp_path / "fixed" / "manifest.json"
    before = {p: p.read_bytes() for p in (tmp_path / "fixed").rglob("*") if p.is_file()}
    mtime = manifest.stat().st_mtime_ns

    again = make_source("fixed", [(b"replacement", {"v": 2})])
    result = runtime.from_cache_sources(
        again,
        tmp_path,
        reader_config=ReaderConfig(validate_cache=True),
        writer_config=WriterConfig(show_progress=False, validate_cache=True),
    )

    assert result.results == [CacheLoaded("fixed", tmp_path / "fixed", 1)]
    assert again.iterations == 0
    assert {p: p.read_bytes() for p in (tmp_path / "fixed").rglob("*") if p.is_file()} == before
    assert manifest.stat().st_mtime_ns == mtime


def test_existing_cache_loads_from_read_only_storage(runtime, tmp_path):
    """Shared datasets often live where readers cannot write (a read-only mount, another user's
    directory): loading a published cache must not need to create or lock anything there."""
    base = tmp_path / "base"
    runtime.from_cache_sources(
        make_source("ro", [(b"read", {}), (b"only", {})]),
        base,
        writer_config=WriterConfig(show_progress=False),
    )
    (base / ".ro.lock").unlink()  # as if another machine had written it
    base.chmod(0o555)
    tmp_path.chmod(0o711)  # the loader enters it; pytest's parents stay private
    try:
        done = subprocess.run(
            [sys.executable, "-c", READ_ONLY_LOADER, str(tmp_path)],
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=120,
        )
    finally:
        base.chmod(0o755)
        tmp_path.chmod(0o700)

    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kind"] == "CacheLoaded", report["detail"]
    assert report["data"] == ["read", "only"]
    assert sorted(p.name for p in base.iterdir()) == ["ro"]


def test_a_cache_that_cannot_be_read_raises_its_os_error_instead_of_being_malformed(
    runtime, tmp_path
):
    """Permission denied is a fact about the reader, not the cache: calling the cache malformed
    would tell the user to delete a good one."""
    base = tmp_path / "base"
    runtime.from_cache_sources(
        make_source("locked", [(b"x", {})]), base, writer_config=WriterConfig(show_progress=False)
    )
    index = base / "locked" / "index.bin"
    index.chmod(0o000)
    try:
        report = unprivileged_call(tmp_path, "locked", samples=0)
    finally:
        index.chmod(0o644)

    assert report.get("raised") == "PermissionError", report
    assert report["errno"] == errno.EACCES
    assert "index.bin" in report["detail"]
    # Readable again, the very same cache loads.
    again = runtime.from_cache_sources(SimpleNamespace(name="locked"), base)
    assert again.results == [CacheLoaded("locked", base / "locked", 1)]


def test_a_write_into_an_unlistable_base_directory_is_reported_written(tmp_path):
    """A base directory the writer may enter and write but not list or open (mode 0333, a drop
    box): leftovers cannot be looked for and the rename cannot be synced, yet the cache is
    published, so the outcome is CacheWritten."""
    base = tmp_path / "base"
    base.mkdir()
    base.chmod(0o333)
    try:
        report = unprivileged_call(tmp_path, "dropped", samples=3)
    finally:
        base.chmod(0o755)

    assert report.get("kind") == "CacheWritten", report
    assert report["data"] == ["dropped:0", "dropped:1", "dropped:2"]
    assert sorted(p.name for p in base.iterdir()) == [".dropped.lock", "dropped"]
