"""Reading caches in place on object storage: ``open_caches`` on a URL, over ``file://`` and
moto's S3 server (the fixtures of ``test_remote_publish``). A published cache must read exactly
as its local copy (fingerprint, shuffled epochs, rank splits, batches, checkpoints both ways),
through a local cache directory that a second pass reads without the store; damage on the server
is an error naming the object, never bytes served.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import itertools
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import polars as pl
import pytest
from test_remote_publish import (  # noqa: F401 (fixtures, used by name)
    QUICK_SECONDS,
    Source,
    Store,
    free_port,
    moto_auth,
    s3_endpoint,
    s3_env,
    s3_store,
    store,
    write_cache,
)

from dataset_rt import (
    CacheLoaded,
    CacheMissing,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWritten,
    ConfigError,
    CorruptRecordError,
    DatasetRuntime,
    ReaderConfig,
    RemoteConfig,
    ShardCompression,
    WriterConfig,
    _native,
)
from dataset_rt.cli import EXIT_FAILED, EXIT_OK, main
from dataset_rt.torch import DataLoader


@pytest.fixture(scope="module")
def runtime() -> Iterator[DatasetRuntime]:
    with DatasetRuntime(num_workers=2) as runtime:
        yield runtime


def open_dataset(
    runtime: DatasetRuntime, base: str | Path, tmp_path: Path, remote: bool, **reader: Any
) -> CacheSourcesDatasetSuccess:
    config = ReaderConfig(seed=11, **reader)
    if remote:
        node = RemoteConfig(local_dir=tmp_path / "node")
        result = runtime.open_caches("train", str(base), reader_config=config, remote=node)
    else:
        result = runtime.open_caches("train", base, reader_config=config)
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return result


def read_epochs(result: CacheSourcesDatasetSuccess, epochs: int = 2) -> list[list[Any]]:
    dataset = result.dataset
    out = []
    for epoch in range(epochs):
        dataset.set_epoch(epoch)
        out.append([(bytes(s.data), s.metadata) for s in dataset])
    return out


def damage_the_second_shard(store: Store) -> int:  # noqa: F811
    """Flips one byte in the middle of shard 1 on the server (inside one of its records) and
    returns that byte's offset in the shard."""
    [shard] = [k for k in store.objects() if k.endswith("shards/000001.bin")]
    data = bytearray(store.read(shard))
    flipped = len(data) // 2
    data[flipped] ^= 0xFF
    store.write(shard, bytes(data))
    return flipped


@pytest.fixture
def published(store: Store, tmp_path: Path) -> tuple[Path, str]:  # noqa: F811
    """A small cache of several shards, written locally and pushed: (local base, remote base)."""
    original = write_cache(tmp_path / "src", n=40)
    _native.push_cache(original, store.url("train"), RemoteConfig())
    return original.parent, store.url("train")[: -len("/train")]


@pytest.mark.parametrize("split", [(None, None), (0, 2), (1, 2)])
def test_a_published_cache_reads_exactly_as_its_local_copy(
    runtime: DatasetRuntime,
    published: tuple[Path, str],
    tmp_path: Path,
    split: tuple[int | None, int | None],
) -> None:
    local_base, url = published
    rank, world_size = split
    local = open_dataset(runtime, local_base, tmp_path, False, rank=rank, world_size=world_size)
    remote = open_dataset(runtime, url, tmp_path, True, rank=rank, world_size=world_size)
    assert [type(r) for r in remote.results] == [CacheLoaded]
    assert remote.results[0].num_samples == 40
    assert remote.dataset.fingerprint == local.dataset.fingerprint
    assert remote.dataset.num_samples == local.dataset.num_samples
    local_epochs, remote_epochs = read_epochs(local), read_epochs(remote)
    assert remote_epochs == local_epochs
    assert local_epochs[0] != local_epochs[1]  # shuffled anew: the comparison means something

    local.dataset.set_epoch(3)
    remote.dataset.set_epoch(3)
    batches = [
        [bytes(b) for batch in r.dataset.iter_batches(7) for b in batch.data]
        for r in (local, remote)
    ]
    assert batches[0] == batches[1]


def test_a_checkpoint_resumes_across_local_and_remote(
    runtime: DatasetRuntime, published: tuple[Path, str], tmp_path: Path
) -> None:
    local_base, url = published
    for first, second in ((False, True), (True, False)):
        a = open_dataset(runtime, url if first else local_base, tmp_path, first)
        b = open_dataset(runtime, url if second else local_base, tmp_path, second)
        a.dataset.set_epoch(1)
        it = iter(a.dataset)
        head = [bytes(next(it).data) for _ in range(13)]
        state = a.dataset.state_dict()
        rest_a = [bytes(s.data) for s in it]
        b.dataset.load_state_dict(state)
        rest_b = [bytes(s.data) for s in b.dataset]
        assert rest_b == rest_a and len(head) + len(rest_b) == 40


def test_a_second_pass_reads_from_the_local_cache_without_the_store(
    runtime: DatasetRuntime,
    published: tuple[Path, str],
    store: Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    local_base, url = published
    local = read_epochs(open_dataset(runtime, local_base, tmp_path, False), epochs=1)
    remote = open_dataset(runtime, url, tmp_path, True)
    assert read_epochs(remote, epochs=1) == local
    assert any((tmp_path / "node").rglob("ranges/*/*"))
    # Every shard object gone: what the first pass fetched is served from the node's cache.
    for key in store.objects():
        if "/shards/" in key:
            store.delete(key)
    assert read_epochs(remote, epochs=1) == local
    # A new process-level open finds the same build, index and records locally.
    assert read_epochs(open_dataset(runtime, url, tmp_path, True), epochs=1) == local


def test_a_record_damaged_on_the_server_is_an_error_naming_the_object(
    runtime: DatasetRuntime,
    published: tuple[Path, str],
    store: Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    _, url = published
    flipped = damage_the_second_shard(store)
    remote = open_dataset(runtime, url, tmp_path, True, shuffle=False)
    with pytest.raises(CorruptRecordError) as caught:
        for _ in remote.dataset:
            pass
    message = str(caught.value)
    assert "000001.bin" in message and "checksum" in message
    # Nothing damaged was kept: no range of that shard in the node's cache covers the byte,
    # and a second pass fails again instead of serving it.
    for kept in (tmp_path / "node").rglob("ranges/shards/000001.bin/*"):
        start, end = map(int, kept.name.split("-"))
        assert not start <= flipped < end, kept
    with pytest.raises(CorruptRecordError):
        for _ in remote.dataset:
            pass


@pytest.mark.parametrize("damage", ["deleted", "cut short", "cut to its header"])
def test_a_shard_object_missing_or_cut_short_on_the_server_is_a_corrupt_record(
    runtime: DatasetRuntime,
    published: tuple[Path, str],
    store: Store,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    damage: str,
) -> None:
    _, url = published
    [shard] = [k for k in store.objects() if k.endswith("shards/000001.bin")]
    data = store.read(shard)
    if damage == "deleted":
        store.delete(shard)
    else:
        store.write(shard, data[: len(data) // 2 if damage == "cut short" else 16])
    why = "does not exist" if damage == "deleted" else "shorter than the manifest says"
    remote = open_dataset(runtime, url, tmp_path, True, shuffle=False)
    with pytest.raises(CorruptRecordError, match=why) as caught:
        for _ in remote.dataset:
            pass
    assert "000001.bin" in str(caught.value) and "sample" in str(caught.value)
    for workers in (0, 2):
        loader = DataLoader(remote.dataset, batch_size=4, num_workers=workers, collate_fn=list)
        with pytest.raises(CorruptRecordError, match=why):
            for _ in loader:
                pass
    assert main(["verify", f"{url}/train"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "FAILED" in err and "000001.bin" in err and why in err


def test_a_missing_cache_and_a_bad_remote_argument(
    runtime: DatasetRuntime, published: tuple[Path, str], tmp_path: Path
) -> None:
    local_base, url = published
    node = RemoteConfig(local_dir=tmp_path / "node")
    result = runtime.open_caches(["train", "absent"], url, remote=node)
    assert isinstance(result, CacheSourcesDatasetSuccess)
    assert [type(r) for r in result.results] == [CacheLoaded, CacheMissing]
    # Each result names its cache by its URL, intact (a `Path` would fold `s3://` to `s3:/`).
    assert [r.path for r in result.results] == [f"{url}/train", f"{url}/absent"]
    alone = runtime.open_caches("absent", url, remote=node)
    assert isinstance(alone, CacheSourcesDatasetError)
    with pytest.raises(ConfigError, match="not a URL"):
        runtime.open_caches("train", local_base, remote=node)
    with pytest.raises(ConfigError, match="RemoteConfig"):
        runtime.open_caches("train", url, remote={"local_dir": "x"})  # type: ignore[arg-type]


def record(sample: Any) -> tuple[bytes, Any]:
    """The loader's transform (module level, so that ``spawn`` workers can import it)."""
    return bytes(sample.data), sample.metadata


@pytest.mark.parametrize(
    ("workers", "start"), [(0, None), (2, "fork"), (2, "spawn")], ids=["w0", "fork", "spawn"]
)
def test_the_shared_memory_loader_reads_a_remote_dataset_as_a_local_one(
    runtime: DatasetRuntime,
    published: tuple[Path, str],
    tmp_path: Path,
    workers: int,
    start: str | None,
) -> None:
    local_base, url = published
    expected = read_epochs(open_dataset(runtime, local_base, tmp_path, False))
    remote = open_dataset(runtime, url, tmp_path, True)
    loader = DataLoader(
        remote.dataset,
        batch_size=6,
        num_workers=workers,
        transform=record,
        collate_fn=list,
        multiprocessing_context=start,
        persistent_workers=workers > 0,
    )
    with loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            assert [x for batch in loader for x in batch] == expected[epoch]


@pytest.mark.parametrize("algo", ["none", "lz4"])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_sizes_its_slots_from_a_remote_cache(
    runtime: DatasetRuntime,
    store: Store,  # noqa: F811
    tmp_path: Path,
    workers: int,
    algo: Literal["none", "lz4"],
) -> None:
    """A cache read in place has no shard files to reference: every record travels in the
    slots (an LZ4 one decompressed), which are sized from the largest one, read and verified
    first through the record source. Batches of 6 samples of 20 KB exceed the smallest slot."""
    compression = ShardCompression(algo=algo)
    original = write_cache(tmp_path / "src", n=40, salt="x" * 20_000, compression=compression)
    _native.push_cache(original, store.url("train"), RemoteConfig())
    url = store.url("train")[: -len("/train")]
    expected = read_epochs(open_dataset(runtime, original.parent, tmp_path, False))
    remote = open_dataset(runtime, url, tmp_path, True)
    loader = DataLoader(
        remote.dataset, batch_size=6, num_workers=workers, transform=record, collate_fn=list
    )
    with loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            assert [x for batch in loader for x in batch] == expected[epoch]


def test_inspect_and_verify_take_a_url(
    published: tuple[Path, str],
    store: Store,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    local_base, url = published
    monkeypatch.setenv("DATASET_RT_REMOTE_DIR", str(tmp_path / "node"))
    assert main(["inspect", "--json", f"{url}/train"]) == EXIT_OK
    manifest = (local_base / "train" / "manifest.json").read_text()
    assert capsys.readouterr().out.strip() == manifest.strip()
    assert main(["inspect", f"{url}/train"]) == EXIT_OK
    assert "cache:" in capsys.readouterr().out
    assert main(["verify", f"{url}/train"]) == EXIT_OK
    assert "OK: 40 samples" in capsys.readouterr().out
    # One byte flipped inside a record on the server: verify names the object and fails.
    damage_the_second_shard(store)
    monkeypatch.setenv("DATASET_RT_REMOTE_DIR", str(tmp_path / "other-node"))
    assert main(["verify", f"{url}/train"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "FAILED" in err and "000001.bin" in err


def test_from_cache_sources_on_a_url_writes_publishes_and_reads_in_place(
    runtime: DatasetRuntime,
    store: Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    node = RemoteConfig(local_dir=tmp_path / "node")
    base = store.url("train")[: -len("/train")]
    local = open_dataset(runtime, write_cache(tmp_path / "src", n=40).parent, tmp_path, False)
    writer = WriterConfig(show_progress=False, shard_size_bytes=512)  # as write_cache's
    first = runtime.from_cache_sources(
        Source("train", 40),
        base,
        reader_config=ReaderConfig(seed=11),
        writer_config=writer,
        remote=node,
    )
    assert isinstance(first, CacheSourcesDatasetSuccess), first
    assert [type(r) for r in first.results] == [CacheWritten]
    assert first.results[0].num_samples == 40
    assert "train/manifest.json" in store.objects()
    assert first.dataset.fingerprint == local.dataset.fingerprint
    # Nothing is left of the staging copy; the second call loads what is published.
    assert not any((tmp_path / "node" / ".publish").iterdir())
    again = runtime.from_cache_sources(
        Source("train", 40),
        base,
        reader_config=ReaderConfig(seed=11),
        writer_config=writer,
        remote=node,
    )
    assert isinstance(again, CacheSourcesDatasetSuccess)
    assert [type(r) for r in again.results] == [CacheLoaded]
    dataset = again.dataset
    dataset.set_epoch(0)
    local.dataset.set_epoch(0)
    assert [bytes(s.data) for s in dataset] == [bytes(s.data) for s in local.dataset]


RACING_WRITER = """
import sys, time
from pathlib import Path
from dataset_rt import CacheInput, DatasetRuntime, RemoteConfig, WriterConfig
base, node, marks, seed = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
class Source:
    name = "x"
    def __iter__(self):
        (marks / f"iterated-{seed}").touch()
        for i in range(30):
            time.sleep(0.02)
            yield CacheInput(bytes([seed, i]) * 100)
(marks / f"ready-{seed}").touch()
while len(list(marks.glob("ready-*"))) < 2:
    time.sleep(0.01)
with DatasetRuntime(num_workers=1) as runtime:
    result = runtime.from_cache_sources(
        Source(), base, writer_config=WriterConfig(show_progress=False),
        remote=RemoteConfig(local_dir=node),
    )
    print(type(result.results[0]).__name__, result.dataset.fingerprint)
"""


@pytest.mark.parametrize("nodes", ["one node", "two nodes"])
def test_writers_racing_for_one_url_publish_one_cache_and_say_who_wrote_it(
    tmp_path: Path, nodes: str
) -> None:
    """Two processes write the same missing cache of one URL at once. On one node (one local
    directory) the second waits and then loads what the first published, never running its
    source; on two, both may write, one publishes, and the other says it loaded that one."""
    base = (tmp_path / "remote").as_uri()
    marks = tmp_path / "marks"
    marks.mkdir()
    writers = [
        subprocess.Popen(
            [
                sys.executable,
                "-c",
                RACING_WRITER,
                base,
                str(tmp_path / ("node" if nodes == "one node" else f"node{seed}")),
                str(marks),
                str(seed),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (1, 2)
    ]
    try:
        outs = [w.communicate(timeout=120) for w in writers]
    finally:
        for w in writers:
            w.kill()
            w.wait()
    assert all(w.returncode == 0 for w in writers), [err for _, err in outs]
    results = sorted(out.split()[0] for out, _ in outs)
    assert results == ["CacheLoaded", "CacheWritten"], outs
    assert len({out.split()[1] for out, _ in outs}) == 1, outs  # the same cache
    iterated = sorted(p.name for p in marks.glob("iterated-*"))
    if nodes == "one node":
        assert len(iterated) == 1, iterated


def test_weighted_epochs_are_the_local_ones(
    runtime: DatasetRuntime, published: tuple[Path, str], tmp_path: Path
) -> None:
    local_base, url = published
    datasets = [
        open_dataset(runtime, local_base, tmp_path, False),
        open_dataset(runtime, url, tmp_path, True),
    ]
    for result in datasets:
        table = result.dataset.samples_metadata()
        weights = [float(1 + i % 4) for i in range(table.height)]
        result.dataset.set_samples_metadata(table.with_columns(weight=pl.Series(weights)))
    assert read_epochs(datasets[1]) == read_epochs(datasets[0])


def test_refused_credentials_and_an_unreachable_endpoint_are_quick_clear_errors(
    runtime: DatasetRuntime,
    s3_env: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = s3_store(s3_env)
    original = write_cache(tmp_path / "src")
    _native.push_cache(original, bucket.url("train"), RemoteConfig())
    base = bucket.url("train")[: -len("/train")]
    node = RemoteConfig(local_dir=tmp_path / "node")
    moto_auth(s3_env, "0")  # the dummy key is in no account of the server: every request fails
    try:
        started = time.monotonic()
        with pytest.raises(PermissionError, match="AWS_ACCESS_KEY_ID"):
            runtime.open_caches("train", base, remote=node)
        assert time.monotonic() - started < QUICK_SECONDS
    finally:
        moto_auth(s3_env, "inf")
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.raises(ConnectionRefusedError, match="check the endpoint"):
        runtime.open_caches("train", base, remote=node)
    assert time.monotonic() - started < QUICK_SECONDS


KILLED_READER = """
import sys
from dataset_rt import DatasetRuntime, ReaderConfig, RemoteConfig
with DatasetRuntime(num_workers=2) as runtime:
    result = runtime.open_caches(
        "train", sys.argv[1], reader_config=ReaderConfig(seed=11),
        remote=RemoteConfig(local_dir=sys.argv[2]),
    )
    it = iter(result.dataset)
    for _ in range(5):
        next(it)
    print("reading", flush=True)
    sys.stdin.read()  # killed here, with records fetched ahead and pinned
"""


def test_a_reader_killed_while_reading_leaves_nothing_that_breaks_the_next(
    runtime: DatasetRuntime, published: tuple[Path, str], tmp_path: Path
) -> None:
    local_base, url = published
    with subprocess.Popen(
        [sys.executable, "-c", KILLED_READER, url, str(tmp_path / "node")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == "reading"
        finally:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL
    expected = read_epochs(open_dataset(runtime, local_base, tmp_path, False))
    assert read_epochs(open_dataset(runtime, url, tmp_path, True)) == expected


class RangeLog:
    """A proxy in front of the S3 server that logs each GET's path and ``Range`` header, and
    holds each GET of a shard for ``shard_delay`` seconds."""

    def __init__(self, target: str, shard_delay: float = 0.0) -> None:
        host, port = target.removeprefix("http://").split(":")
        log: list[tuple[str, str]] = []
        lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                if self.command == "GET":
                    with lock:
                        log.append((self.path.split("?")[0], self.headers.get("Range") or ""))
                    if "/shards/" in self.path:
                        time.sleep(shard_delay)
                conn = http.client.HTTPConnection(host, int(port), timeout=30)
                headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
                conn.request(self.command, self.path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                self.send_response(response.status)
                for k, v in response.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = forward

        self.log = log
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_slow_store_is_no_hung_producer_to_the_loader(
    runtime: DatasetRuntime,
    s3_env: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A read from object storage is bounded by the fetch policy, not the loader's heartbeat:
    a store slower than ``heartbeat_timeout`` delays batches and never ends the pass as a
    stopped or hung producer (which would hide the store's own error when it fails)."""
    url = s3_store(s3_env).url("train")
    original = write_cache(tmp_path / "src", n=40)
    _native.push_cache(original, url, RemoteConfig())
    expected = [
        bytes(s.data) for s in open_dataset(runtime, original.parent, tmp_path, False).dataset
    ]
    proxy = RangeLog(s3_env, shard_delay=2.0)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    try:
        remote = open_dataset(runtime, url[: -len("/train")], tmp_path, True)
        loader = DataLoader(
            remote.dataset,
            batch_size=8,
            num_workers=2,
            collate_fn=list,
            transform=lambda s: bytes(s.data),
            heartbeat_timeout=1.0,
        )
        got = [sample for batch in loader for sample in batch]
    finally:
        proxy.close()
    assert got == expected
    assert any("/shards/" in path for path, _ in proxy.log)


SHARING_READER = """
import hashlib, sys
from dataset_rt import DatasetRuntime, ReaderConfig, RemoteConfig
with DatasetRuntime(num_workers=2) as runtime:
    result = runtime.open_caches(
        "train", sys.argv[1], reader_config=ReaderConfig(seed=11),
        remote=RemoteConfig(local_dir=sys.argv[2]),
    )
    print("ready", flush=True)
    sys.stdin.readline()
    digest = hashlib.sha256()
    for s in result.dataset:
        digest.update(bytes(s.data) + repr(s.metadata).encode())
    print(digest.hexdigest(), flush=True)
"""


def test_two_processes_sharing_a_local_directory_download_each_range_once(
    runtime: DatasetRuntime,
    s3_env: str,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = s3_store(s3_env).url("train")
    original = write_cache(tmp_path / "src", n=160)
    _native.push_cache(original, url, RemoteConfig())
    expected = hashlib.sha256()
    for s in open_dataset(runtime, original.parent, tmp_path, False).dataset:
        expected.update(bytes(s.data) + repr(s.metadata).encode())

    proxy = RangeLog(s3_env)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    base = url[: -len("/train")]
    readers = [
        subprocess.Popen(
            [sys.executable, "-c", SHARING_READER, base, str(tmp_path / "node")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for reader in readers:
            assert reader.stdout is not None
            assert reader.stdout.readline().strip() == "ready"
        for reader in readers:  # both read the same epoch at the same time
            assert reader.stdin is not None
            reader.stdin.write("go\n")
            reader.stdin.flush()
        digests = [reader.communicate(timeout=120)[0].strip() for reader in readers]
    finally:
        for reader in readers:
            reader.kill()
            reader.wait()
        proxy.close()
    assert digests == [expected.hexdigest()] * 2
    shard_gets = [(path, rng) for path, rng in proxy.log if "/shards/" in path]
    shards = {path for path, _ in shard_gets}
    assert len(shards) == len(list(original.glob("shards/*.bin"))) > 4
    # No byte of a shard was downloaded twice: the ranges fetched from one object, by either
    # process, never overlap.
    for shard in shards:
        spans = sorted(
            tuple(int(x) for x in rng.removeprefix("bytes=").split("-"))
            for path, rng in shard_gets
            if path == shard
        )
        assert all(rng.startswith("bytes=") for path, rng in shard_gets if path == shard)
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert start > end, f"{shard}: {spans}"
