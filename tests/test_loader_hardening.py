"""The shared-memory loader against hostile or unlucky surroundings: what its producer
imports, loaders dropped mid-epoch, leftovers judged by their owner's lock, the errno of a full
/dev/shm, metadata keys of any length, and ring slots sized from verified records only."""

from __future__ import annotations

import errno
import gc
import json
import os
import re
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from loader_helpers import gone, load, load_lz4, no_leaks, own_segments  # noqa: F401

import dataset_rt
from dataset_rt import CorruptRecordError, DatasetRuntime, WriterConfig
from dataset_rt._loader import DataLoader
from dataset_rt._native import RuntimeStateError, reap_shm_leftovers
from dataset_rt.testing import corrupt_byte, make_source

N = 40

PLANTED = "open({marker!r} + '-' + str(__import__('os').getpid()), 'w').close()\n"
TRAINING = textwrap.dedent(
    """
    import sys
    # The PYTHONPATH entry with planted modules is the producer's to ignore; this process does
    # not use it (it would import them itself otherwise).
    sys.path.remove(sys.argv[2])
    import json, os
    import dataset_rt
    from dataset_rt.testing import make_source

    runtime = dataset_rt.DatasetRuntime(num_workers=1)
    source = make_source("c", [(bytes([i]) * 50, {"i": i}) for i in range(12)])
    result = runtime.from_cache_sources(
        source, sys.argv[1], writer_config=dataset_rt.WriterConfig(show_progress=False)
    )
    with dataset_rt.DataLoader(result.dataset, batch_size=1) as loader:
        it = iter(loader)
        first = next(it)  # the producer is blocked on the full ring: it lives on
        producer = it.pids["producer"]
        with open(f"/proc/{producer}/maps") as f:
            mapped = {line.split()[-1] for line in f if line.rstrip().endswith(".so")}
        got = [s.metadata["i"] for s in first] + [s.metadata["i"] for b in it for s in b]
    native = os.path.realpath(dataset_rt._native.__file__)
    report = {"producer": producer, "training": os.getpid(), "got": got}
    print(json.dumps({**report, "same_native": native in mapped}))
    """
)


def test_the_producer_imports_nothing_from_the_working_directory_or_pythonpath(tmp_path):
    """Modules planted in the training process's working directory and in a PYTHONPATH entry,
    under names the producer's start-up imports (or could), never run in the producer, which
    imports the very `dataset_rt` (and native module) the training process uses."""
    markers = tmp_path / "markers"
    markers.mkdir()
    cwd, on_path = tmp_path / "cwd", tmp_path / "on-path"
    # Names imported at every interpreter's start-up (encodings, site) are planted in the
    # working directory only: in a PYTHONPATH entry they would break the training process too.
    lazy = ("importlib", "json", "numpy", "dataset_rt")
    for directory, modules in ((cwd, (*lazy, "os", "encodings", "site")), (on_path, lazy)):
        directory.mkdir()
        for module in modules:
            code = PLANTED.format(marker=str(markers / f"{directory.name}-{module}"))
            (directory / f"{module}.py").write_text(code + "raise ImportError('planted')\n")
    script = tmp_path / "train.py"
    script.write_text(TRAINING)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(on_path), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    # This test's own `dataset_rt`, wherever it comes from (an installed package, a checkout).
    root = os.path.dirname(os.path.dirname(os.path.abspath(dataset_rt.__file__)))
    env["PYTHONPATH"] += os.pathsep + root
    run = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "base"), str(on_path)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(report["got"]) == list(range(12))
    assert report["same_native"], "the producer loaded another dataset_rt._native"
    # The training process itself may import a planted module of its PYTHONPATH at start-up
    # (its own environment, as the user set it); no other process may import any.
    training = f"-{report['training']}"
    ran = sorted(p.name for p in markers.iterdir() if not p.name.endswith(training))
    assert ran == [], f"planted modules ran: {ran} (producer pid {report['producer']})"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("hardening-cache")
    load(path, N)
    return path


@pytest.fixture
def dataset(base):
    return load(base, N)


def epoch_ids(dataset, epoch: int) -> list[int]:
    dataset.set_epoch(epoch)
    return [s.metadata["i"] for s in dataset]


@pytest.fixture
def no_cycle_collector():
    """Runs the test with the cycle collector off: only reference counting frees objects."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.collect()  # whatever a failed test left in a cycle is closed here


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dropping_a_loader_mid_epoch_ends_its_pass_at_once(
    dataset, num_workers, no_cycle_collector
):
    loader = DataLoader(dataset, batch_size=2, num_workers=num_workers)
    for batch in loader:  # noqa: B007 (the batch is used after the loop)
        break
    pids = loader._iterator.pids
    processes = [pids["producer"], *pids["workers"]]
    assert len(processes) == 1 + num_workers
    del loader
    # No cycle holds the pass: its processes were stopped and waited for, its names removed.
    assert [p for p in processes if not gone(p)] == []
    assert own_segments() == []
    assert len(batch) == 2


@pytest.mark.parametrize("num_workers", [0, 2])
def test_an_iterator_outlives_its_loader(dataset, num_workers, no_cycle_collector):
    expected = epoch_ids(dataset, 0)
    it = iter(DataLoader(dataset, batch_size=4, num_workers=num_workers))
    got = [s.metadata["i"] for s in next(it)]
    pids = it.pids
    got += [s.metadata["i"] for b in it for s in b]
    assert got == expected
    del it
    assert [p for p in [pids["producer"], *pids["workers"]] if not gone(p)] == []


@pytest.mark.parametrize(("num_workers", "persistent"), [(0, False), (2, False), (2, True)])
def test_iterating_a_loader_inside_its_own_loop_raises_rather_than_cutting_the_epoch(
    dataset, num_workers, persistent
):
    with DataLoader(
        dataset, batch_size=4, num_workers=num_workers, persistent_workers=persistent
    ) as loader:
        seen = 0
        with pytest.raises(
            RuntimeStateError, match=r"closed after 2 of its \d+ batches by a later"
        ):
            for step, batch in enumerate(loader):
                seen += len(batch)
                if step == 1:
                    next(iter(loader))  # an example batch, as a logging hook would take
        assert seen == 8  # the loop did not end quietly, short of its epoch
        # An iterator replaced before its first batch raises too: zip(loader, loader).
        with pytest.raises(RuntimeStateError):
            list(zip(loader, loader, strict=False))
        # A pass received to its end is not replaced: it ends as usual.
        it = iter(loader)
        batches = len(it)
        for _ in range(batches):
            next(it)
        later = iter(loader)
        with pytest.raises(StopIteration):
            next(it)
        assert len(next(later)) == 4


CLOSED_IN_PASS = r"closed \(DataLoader\.close\(\)\) during this pass, after the loop received"


@pytest.mark.parametrize(
    ("num_workers", "persistent"), [(0, False), (1, False), (2, False), (1, True), (2, True)]
)
def test_closing_a_loader_inside_its_own_loop_raises_rather_than_cutting_the_epoch(
    dataset, num_workers, persistent
):
    with DataLoader(
        dataset, batch_size=4, num_workers=num_workers, persistent_workers=persistent
    ) as loader:
        seen = 0
        with pytest.raises(RuntimeStateError, match=CLOSED_IN_PASS + r" 2 of its 10 batches"):
            for step, batch in enumerate(loader):
                seen += len(batch)
                if step == 1:
                    loader.close()
        assert seen == 8  # the loop did not end quietly, short of its epoch
        # A loop that ended as usual, then close(): nothing changes.
        it = iter(loader)
        assert sum(len(b) for b in it) == N
        loader.close()
        with pytest.raises(StopIteration):
            next(it)
        # The loader starts a fresh pass after either close.
        assert sum(len(b) for b in loader) == N


def _slow(sample):
    time.sleep(0.01)
    return sample.metadata["i"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_closing_a_loader_from_another_thread_raises_in_the_iterating_thread(dataset, num_workers):
    loader = DataLoader(dataset, batch_size=2, num_workers=num_workers, transform=_slow)
    started = threading.Event()
    caught: list[BaseException] = []
    received: list[int] = []

    def iterate() -> None:
        try:
            for batch in loader:
                received.append(len(batch))
                if len(received) == 2:
                    started.set()
        except BaseException as error:
            caught.append(error)
        finally:
            started.set()

    thread = threading.Thread(target=iterate, daemon=True)
    try:
        thread.start()
        assert started.wait(30)
        loader.close()
        thread.join(30)
        assert not thread.is_alive(), "the iterating thread hangs"
    finally:
        loader.close()
        thread.join(30)
    assert len(caught) == 1, f"the loop ended quietly after {len(received)} of 20 batches"
    assert isinstance(caught[0], RuntimeStateError), repr(caught[0])
    assert re.search(CLOSED_IN_PASS + rf" {len(received)} of its 20 batches", str(caught[0]))
    assert 2 <= len(received) < 20


HOLDER = textwrap.dedent(
    """
    import fcntl, os, sys
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH if sys.argv[2] == "shared" else fcntl.LOCK_EX)
    print("locked", flush=True)
    sys.stdin.read()  # holds the lock until its stdin closes
    """
)


def dead_pid() -> int:
    exited = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(exited.stdout)


class LockHolder:
    """Another process that opens (or creates) `path` and holds a flock on it until
    `release()`."""

    def __init__(self, path: str, mode: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", HOLDER, path, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.process.stdout is not None
        assert self.process.stdout.readline() == "locked\n"

    def release(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait(10)

    def __enter__(self) -> LockHolder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()


def test_shm_leftovers_are_judged_by_their_owners_lock_not_their_pid():
    dead = dead_pid()
    stem = f"/dev/shm/dataset-rt-{dead}-{os.getpid():x}feed"
    held, free = f"{stem}a-ctl", f"{stem}b-ctl"
    # Unlocked, but its pid runs here (an older DatasetRT holds no lock): kept.
    unowned = f"/dev/shm/dataset-rt-{os.getpid()}-{os.getpid():x}feedc-ring"
    try:
        # The owner lives (in another PID namespace, say): its pid number means nothing here.
        with LockHolder(held, "shared") as owner:
            for path in (free, unowned):
                with open(path, "wb") as f:
                    f.write(b"x")
            removed = reap_shm_leftovers()
            assert os.path.exists(held), "a live owner's segment was reaped"
            assert os.path.basename(held) not in removed
            assert os.path.basename(free) in removed and not os.path.exists(free)
            assert os.path.exists(unowned) and os.path.basename(unowned) not in removed
            owner.release()
            # Its lock went with it: now the segment is a leftover.
            assert os.path.basename(held) in reap_shm_leftovers()
            assert not os.path.exists(held)
    finally:
        for path in (held, free, unowned):
            if os.path.exists(path):
                os.unlink(path)


def test_loading_reaps_writer_leftovers_only_once_no_writer_holds_the_lock(tmp_path):
    """The writer's temporary directories: a live writer (holding `.NAME.lock`) keeps every
    directory of its name, whatever pids they carry; without one they are all leftovers."""
    runtime = DatasetRuntime(num_workers=1)
    config = WriterConfig(show_progress=False)
    try:
        runtime.from_cache_sources(
            make_source("kept", [(b"k", {})]), tmp_path, writer_config=config
        )
        dead = dead_pid()

        def leftover(pid: int, nanos: int):
            path = tmp_path / f".kept.tmp-{pid}-{nanos}"
            (path / "shards").mkdir(parents=True)
            return path

        dirs = [leftover(dead, 1), leftover(1, 2), leftover(os.getpid(), 3)]
        other_name = tmp_path / f".kept2.tmp-{dead}-4"
        other_name.mkdir()
        # A writer of "kept" in another process (or PID namespace) holds the lock.
        with LockHolder(str(tmp_path / ".kept.lock"), "exclusive"):
            loaded = runtime.from_cache_sources(
                make_source("kept", [(b"other", {})]), tmp_path, writer_config=config
            )
            assert loaded.dataset is not None
            assert all(d.exists() for d in dirs), "a live writer's directory was reaped"
        runtime.from_cache_sources(
            make_source("kept", [(b"other", {})]), tmp_path, writer_config=config
        )
        assert not any(d.exists() for d in dirs)
        assert other_name.exists()
    finally:
        runtime.close()


def test_a_full_dev_shm_raises_its_errno(dataset):
    loader = DataLoader(dataset, batch_size=2, slot_size_bytes=1 << 40)
    with loader, pytest.raises(OSError) as caught:
        iter(loader)
    assert caught.value.errno == errno.ENOSPC
    assert "allocate" in str(caught.value) and "/dev/shm/dataset-rt-" in str(caught.value)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_metadata_keys_longer_than_64_kib_arrive_whole(tmp_path, num_workers):
    # 65,541 bytes: a u16 length would read 5 ("abcde") and take the rest for the value.
    long_key = "abcde\x01" + "A" * 65_535
    rows = [(bytes([i]) * 10, {long_key: i, "k" * 70_000: f"v{i}"}) for i in range(4)]
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.from_cache_sources(
            make_source("long", rows), tmp_path, writer_config=WriterConfig(show_progress=False)
        )
        assert result.dataset is not None
        with DataLoader(result.dataset, batch_size=2, num_workers=num_workers) as loader:
            got = sorted((s.metadata for b in loader for s in b), key=lambda m: m[long_key])
    assert got == [{long_key: i, "k" * 70_000: f"v{i}"} for i in range(4)]


def damage_largest_record(cache) -> None:
    """Flips a byte of the stored payload of sample 11, the largest of `load`/`load_lz4`."""
    index = (cache / "index.bin").read_bytes()
    offset, shard = struct.unpack_from("<QI", index, 16 + 40 * 11)  # format v3
    shard_path = cache / "shards" / f"{shard:06d}.bin"
    meta_len = struct.unpack_from("<I", shard_path.read_bytes(), offset + 20)[0]
    os.chmod(shard_path, 0o644)
    corrupt_byte(shard_path, offset + ((40 + meta_len + 15) // 16) * 16 + 5)


def test_the_largest_record_is_verified_before_the_ring_is_sized(tmp_path):
    """Slots are sized from the largest record that travels in a slot (decompressed LZ4), whose
    length only its record can prove: a damaged one is reported by `iter(loader)`, before any
    segment exists."""
    dataset = load_lz4(tmp_path, 12, size=10_000)  # sample i has 10,000 + i bytes
    damage_largest_record(tmp_path / "loader")
    with DataLoader(dataset, batch_size=4) as loader:
        with pytest.raises(CorruptRecordError, match="sample 11"):
            iter(loader)
        assert own_segments() == []


def test_a_damaged_raw_record_sizes_nothing_and_is_refused_when_read(tmp_path):
    """Raw records travel as references, so none sizes the ring; the damaged one is reported
    when the producer reads it."""
    dataset = load(tmp_path, 12, size=10_000)
    damage_largest_record(tmp_path / "loader")
    with DataLoader(dataset, batch_size=4) as loader:
        it = iter(loader)
        assert it.slot_size == 64 * 1024
        with pytest.raises(CorruptRecordError, match="sample 11"):
            list(it)
    assert own_segments() == []


def test_the_producer_imports_only_the_native_module_of_the_package():
    """A lean cold start: the producer's entry runs no part of the facade (its `__init__`,
    polars, numpy...), only `_loader.producer`, `_loader.signals` and `_native` (the
    `dataset_rt` and `dataset_rt._loader` packages are bare: their `__init__` does not run)."""
    from dataset_rt._loader import producer

    spec = "/nonexistent/dataset-rt-spec.json"
    command = producer.command(os.getpid(), spec)
    run = subprocess.run(
        [*command[:3], "-X", "importtime", *command[3:]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and spec in run.stderr, run.stderr
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in run.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    ours = sorted(m for m in imported if m.split(".")[0] == "dataset_rt")
    assert ours == [
        "dataset_rt._loader.producer",
        "dataset_rt._loader.signals",
        "dataset_rt._native",
    ]
    assert not {"numpy", "polars", "pyarrow", "json"} & imported
