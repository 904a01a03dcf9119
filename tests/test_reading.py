"""Reading: record checksums on every read, zero-copy payloads that outlive the dataset, LZ4
payloads, epoch lengths and bounded prefetch."""

from __future__ import annotations

import gc
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from loader_helpers import views_a_shard_map

from dataset_rt import (
    CacheLoaded,
    CorruptRecordError,
    Dataset,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
    _native,
)
from dataset_rt.testing import corrupt_byte, make_source

NONE = ShardCompression(algo="none", ratio=1.0)
LZ4 = ShardCompression(algo="lz4", ratio=0.9)
SHARD_HEADER_LEN = 16
RECORD_HEADER_LEN = 40
FLAG_LZ4 = 1


def payload(i: int) -> bytes:
    # Compressible (LZ4 keeps it compressed) and unique per sample.
    return (f"sample-{i:05d}|".encode() * 40)[: 200 + i]


def source(name: str, n: int):  # type: ignore[no-untyped-def]
    return make_source(
        name,
        [
            (payload(i), {"sample_id": i, "label": f"l{i % 3}", "x": i / 2, "odd": i % 2 == 1})
            for i in range(n)
        ],
    )


def writer(compression: ShardCompression, shard_size: int = 256 * 1024 * 1024) -> WriterConfig:
    return WriterConfig(
        shard_compression=compression, show_progress=False, shard_size_bytes=shard_size
    )


def open_dataset(
    base: Path,
    src: Any,
    reader: ReaderConfig | None = None,
    compression: ShardCompression = NONE,
    workers: int = 2,
    shard_size: int = 256 * 1024 * 1024,
) -> tuple[DatasetRuntime, Dataset]:
    runtime = DatasetRuntime(num_workers=workers)
    result = runtime.from_cache_sources(
        src,
        base,
        reader_config=reader or ReaderConfig(shuffle=False),
        writer_config=writer(compression, shard_size),
    )
    return runtime, result.dataset


def align16(x: int) -> int:
    return -(-x // 16) * 16


def records(shard: Path) -> list[dict[str, int]]:
    """Record headers of a shard, from docs/storage-format (header, metadata, aligned payload)."""
    data = shard.read_bytes()
    assert data[:8] == b"DRTSHARD"
    (version,) = struct.unpack_from("<I", data, 8)
    found = []
    offset = SHARD_HEADER_LEN
    while offset < len(data):
        assert data[offset : offset + 4] == b"DRTR", f"no record at {offset}"
        if version >= 2:  # v2 and v3 share the record layout
            flags, meta_len, stored_len, raw_len, sample = struct.unpack_from(
                "<IIIIQ", data, offset + 16
            )
        else:
            flags, meta_len, stored_len, raw_len = struct.unpack_from("<IIII", data, offset + 4)
            (sample,) = struct.unpack_from("<Q", data, offset + 24)
        payload_offset = offset + align16(RECORD_HEADER_LEN + meta_len)
        found.append(
            {
                "offset": offset,
                "sample": sample,
                "flags": flags,
                "payload": payload_offset,
                "stored_len": stored_len,
                "raw_len": raw_len,
            }
        )
        offset = align16(payload_offset + stored_len)
    return found


def find_record(cache_dir: Path, sample: int) -> tuple[Path, dict[str, int]]:
    for shard in sorted((cache_dir / "shards").glob("*.bin")):
        for record in records(shard):
            if record["sample"] == sample:
                return shard, record
    raise AssertionError(f"sample {sample} not found in {cache_dir}")


# ---- record checksums on read


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_flipped_payload_byte_caught_on_read(
    tmp_path: Path, compression: ShardCompression, where: str
) -> None:
    n, bad = 30, 17
    runtime, dataset = open_dataset(tmp_path, source("c", n), compression=compression)
    runtime.close()
    shard, record = find_record(tmp_path / "c", bad)
    assert bool(record["flags"] & FLAG_LZ4) == (compression is LZ4)
    offset = {
        "first": record["payload"],
        "middle": record["payload"] + record["stored_len"] // 2,
        "last": record["payload"] + record["stored_len"] - 1,
    }[where]
    corrupt_byte(shard, offset)

    for reader in (
        ReaderConfig(shuffle=False, validate_cache=False),
        ReaderConfig(seed=3, validate_cache=False, prefetch_size=1),
        ReaderConfig(seed=4, validate_cache=False, prefetch_size=64),
    ):
        runtime, dataset = open_dataset(tmp_path, source("c", n), reader, compression)
        with runtime:
            received = []
            with pytest.raises(CorruptRecordError) as caught:
                for sample in dataset:
                    assert bytes(sample.data) == payload(sample.metadata["sample_id"])
                    received.append(sample.metadata["sample_id"])
            assert bad not in received
            message = str(caught.value)
            assert '"c"' in message  # the cache
            assert str(shard) in message  # the shard file
            assert f"offset {record['offset']}" in message
            assert f"sample {bad}" in message


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
def test_samples_before_a_corrupt_record_are_delivered(
    tmp_path: Path, compression: ShardCompression
) -> None:
    # Read-ahead must not turn a corrupt record into the loss of the good ones before it: the
    # loop receives every sample up to the corrupt one, then the error.
    n, bad = 30, 5
    runtime, _ = open_dataset(tmp_path, source("c", n), compression=compression)
    runtime.close()
    shard, record = find_record(tmp_path / "c", bad)
    corrupt_byte(shard, record["payload"] + 3)
    for prefetch in (1, 4, 64):
        reader = ReaderConfig(shuffle=False, prefetch_size=prefetch)
        runtime, dataset = open_dataset(tmp_path, source("c", n), reader, compression)
        with runtime:
            received = []
            with pytest.raises(CorruptRecordError, match=f"sample {bad}"):
                for sample in dataset:
                    received.append(sample.metadata["sample_id"])
            assert received == list(range(bad)), f"prefetch_size={prefetch}"
            assert dataset.state_dict()["position"] == bad


def test_corrupt_record_in_a_later_shard(tmp_path: Path) -> None:
    n = 40
    runtime, dataset = open_dataset(tmp_path, source("c", n), shard_size=2048)
    runtime.close()
    shards = sorted((tmp_path / "c" / "shards").glob("*.bin"))
    assert len(shards) >= 3
    victim = records(shards[2])[1]
    corrupt_byte(shards[2], victim["payload"])
    runtime, dataset = open_dataset(tmp_path, source("c", n), shard_size=2048)
    with runtime, pytest.raises(CorruptRecordError) as caught:
        list(dataset)
    assert str(shards[2]) in str(caught.value)
    assert f"sample {victim['sample']}" in str(caught.value)


def test_corrupt_record_never_read_is_not_reported(tmp_path: Path) -> None:
    # Checksums are verified as records are read: an unread record cannot fail the epoch.
    order = _native.epoch_order(0, 0, 10, 5, False)  # 5 of the 10 samples
    unread = min(set(range(10)) - set(order))
    runtime, dataset = open_dataset(tmp_path, source("c", 10))
    runtime.close()
    shard, record = find_record(tmp_path / "c", unread)
    corrupt_byte(shard, record["payload"])
    reader = ReaderConfig(shuffle=False, samples_per_epoch=5)
    runtime, dataset = open_dataset(tmp_path, source("c", 10), reader)
    with runtime:
        assert [s.metadata["sample_id"] for s in dataset] == order


def test_flipped_metadata_byte_caught_on_read(tmp_path: Path) -> None:
    runtime, _ = open_dataset(tmp_path, source("c", 10))
    runtime.close()
    shard, record = find_record(tmp_path / "c", 4)
    corrupt_byte(shard, record["offset"] + RECORD_HEADER_LEN + 2)
    runtime, dataset = open_dataset(tmp_path, source("c", 10))
    with runtime, pytest.raises(CorruptRecordError, match="sample 4"):
        list(dataset)


# ---- payload types and zero copy


def test_uncompressed_payloads_are_zero_copy_mmap_views(tmp_path: Path) -> None:
    runtime, dataset = open_dataset(tmp_path, source("c", 20), ReaderConfig(seed=1))
    with runtime:
        samples = list(dataset)
    for sample in samples:
        assert isinstance(sample.data, memoryview)
        assert views_a_shard_map(sample.data)
        assert sample.data.readonly
        assert sample.data.contiguous
        assert sample.data == payload(sample.metadata["sample_id"])
    # One mapping per shard, shared by every view into it.
    assert len({id(s.data.obj) for s in samples}) == 1


def test_views_stay_valid_after_dataset_and_runtime_are_gone(tmp_path: Path) -> None:
    runtime, dataset = open_dataset(
        tmp_path, source("c", 20), ReaderConfig(seed=2), shard_size=2048
    )
    iterator = iter(dataset)
    held = [next(iterator) for _ in range(15)]
    views = [s.data for s in held]
    expected = [payload(s.metadata["sample_id"]) for s in held]
    runtime.close()
    del iterator, dataset, runtime, held
    gc.collect()
    for view, want in zip(views, expected, strict=True):
        assert bytes(view) == want
        assert view.tobytes() == want


def test_views_map_the_validated_shard_even_after_the_directory_is_replaced(
    tmp_path: Path,
) -> None:
    """The core validates and verifies records in its own map of each shard; the zero-copy
    views must map that same file, not whatever the path names when they are first made."""
    first = make_source("swap", [(b"A" * 64 + bytes([i]), {"i": i}) for i in range(6)])
    runtime, dataset = open_dataset(tmp_path, first, ReaderConfig(shuffle=False))
    with runtime:
        # Replace the cache before any view is made: away with it, and a different cache of the
        # same name and the same layout (so every offset still lands on a payload) in its place.
        shutil.rmtree(tmp_path / "swap")
        second = make_source("swap", [(b"B" * 64 + bytes([i]), {"i": i}) for i in range(6)])
        with DatasetRuntime(num_workers=1) as other:
            other.from_cache_sources(second, tmp_path, writer_config=writer(NONE))
        assert (tmp_path / "swap" / "manifest.json").exists()

        samples = list(dataset)
    assert all(isinstance(s.data, memoryview) for s in samples)
    assert [bytes(s.data) for s in samples] == [b"A" * 64 + bytes([i]) for i in range(6)]


def test_lz4_payloads_are_bytes(tmp_path: Path) -> None:
    runtime, dataset = open_dataset(tmp_path, source("c", 12), ReaderConfig(seed=1), LZ4)
    with runtime:
        samples = list(dataset)
    _, record = find_record(tmp_path / "c", 0)
    assert record["flags"] & FLAG_LZ4
    assert record["stored_len"] < record["raw_len"]
    for sample in samples:
        assert type(sample.data) is bytes
        assert sample.data == payload(sample.metadata["sample_id"])


def test_lz4_keeps_incompressible_payloads_raw_and_zero_copy(tmp_path: Path) -> None:
    noise = [os.urandom(300) for _ in range(4)]
    mixed = make_source(
        "mixed",
        [(noise[i // 2] if i % 2 else payload(i), {"sample_id": i}) for i in range(8)],
    )
    runtime, dataset = open_dataset(tmp_path, mixed, ReaderConfig(shuffle=False), LZ4)
    with runtime:
        samples = list(dataset)
    for i, sample in enumerate(samples):
        if i % 2:
            assert isinstance(sample.data, memoryview)
            assert bytes(sample.data) == noise[i // 2]
        else:
            assert type(sample.data) is bytes
            assert sample.data == payload(i)


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
def test_metadata_and_payloads_round_trip(tmp_path: Path, compression: ShardCompression) -> None:
    runtime, dataset = open_dataset(tmp_path, source("c", 9), compression=compression)
    with runtime:
        samples = list(dataset)
    assert [s.metadata for s in samples] == [
        {"sample_id": i, "label": f"l{i % 3}", "x": i / 2, "odd": i % 2 == 1} for i in range(9)
    ]
    assert all(type(s.metadata["odd"]) is bool for s in samples)
    assert [bytes(s.data) for s in samples] == [payload(i) for i in range(9)]


def test_empty_payloads(tmp_path: Path) -> None:
    src = make_source("empty_payloads", [(b"", {"sample_id": i}) for i in range(3)])
    runtime, dataset = open_dataset(tmp_path, src)
    with runtime:
        assert [bytes(s.data) for s in dataset] == [b"", b"", b""]


# ---- epoch length and prefetch


def test_len_is_this_ranks_samples_per_epoch(tmp_path: Path) -> None:
    cases = [
        (ReaderConfig(), 10),
        (ReaderConfig(rank=0, world_size=3), 4),
        (ReaderConfig(rank=2, world_size=3), 4),
        (ReaderConfig(rank=2, world_size=3, drop_last=True), 3),
        (ReaderConfig(samples_per_epoch=25), 25),
        (ReaderConfig(samples_per_epoch=25, rank=1, world_size=2), 13),
        (ReaderConfig(samples_per_epoch=25, rank=1, world_size=2, drop_last=True), 12),
        (ReaderConfig(samples_per_epoch=3), 3),
        (ReaderConfig(samples_per_epoch=0), 0),
        (ReaderConfig(rank=11, world_size=12), 1),
        (ReaderConfig(rank=11, world_size=12, drop_last=True), 0),
    ]
    for reader, expected in cases:
        runtime, dataset = open_dataset(tmp_path, source("c", 10), reader)
        with runtime:
            assert len(dataset) == expected, reader
            for _ in range(2):
                iterator = iter(dataset)
                assert len(iterator) == expected
                received = list(iterator)
                assert len(received) == expected, reader
                assert len(iterator) == 0


def test_iterator_len_counts_down(tmp_path: Path) -> None:
    runtime, dataset = open_dataset(tmp_path, source("c", 10), ReaderConfig(seed=1))
    with runtime:
        iterator = iter(dataset)
        for remaining in range(10, 0, -1):
            assert len(iterator) == remaining
            next(iterator)
        assert len(iterator) == 0
        with pytest.raises(StopIteration):
            next(iterator)


@pytest.mark.parametrize("samples_per_epoch", [0, 1, 4, 10, 11, 37])
def test_samples_per_epoch_changes_epoch_length(tmp_path: Path, samples_per_epoch: int) -> None:
    reader = ReaderConfig(seed=6, samples_per_epoch=samples_per_epoch)
    runtime, dataset = open_dataset(tmp_path, source("c", 10), reader)
    with runtime:
        for epoch in range(2):
            received = [s.metadata["sample_id"] for s in dataset]
            assert received == _native.epoch_order(6, epoch, 10, samples_per_epoch)
            counts = [received.count(i) for i in range(10)]
            low, high = samples_per_epoch // 10, -(-samples_per_epoch // 10)
            assert all(c in (low, high) for c in counts)
        assert dataset.state_dict()["epoch_len"] == samples_per_epoch


def test_samples_per_epoch_without_samples_is_refused(tmp_path: Path) -> None:
    # No sample can fill an epoch of 5: a clear error (when loading or at the latest when
    # iterating), not a worker panic, and never a len() of 5 over an empty pass.
    runtime = DatasetRuntime(num_workers=1)
    with runtime, pytest.raises(_native.ConfigError, match="samples_per_epoch"):
        result = runtime.from_cache_sources(
            make_source("nothing", []),
            tmp_path,
            reader_config=ReaderConfig(samples_per_epoch=5),
            writer_config=writer(NONE),
        )
        list(result.dataset)


def test_samples_per_epoch_above_the_limit_is_refused() -> None:
    ReaderConfig(samples_per_epoch=2**40)  # the documented limit itself is accepted
    with pytest.raises(_native.ConfigError, match=r"samples_per_epoch.*2\*\*40"):
        ReaderConfig(samples_per_epoch=2**40 + 1)
    with pytest.raises(_native.ConfigError, match=r"2\*\*40"):
        _native.epoch_order(0, 0, 10, 2**62)


# A process that asks for epoch orders far larger than memory. Before these were checked, the
# allocation aborted the interpreter; here a listed order must come back as a Python exception,
# and a pass over such an epoch, whose order is computed position by position, must read.
HUGE_ORDERS = r"""
import json, sys, types
from dataset_rt import DatasetRuntime, ReaderConfig, WriterConfig, _native

outcomes = {}

def attempt(what, action):
    try:
        action()
        outcomes[what] = "no error"
    except Exception as error:
        outcomes[what] = f"{type(error).__name__}: {error}"

attempt("epoch_order", lambda: _native.epoch_order(0, 0, 10, 2**39))
attempt("weighted_epoch_order", lambda: _native.epoch_order(0, 0, 2, 2**39, True, [1.0, 2.0]))
with DatasetRuntime(num_workers=1) as runtime:
    result = runtime.from_cache_sources(
        types.SimpleNamespace(name="c"),
        sys.argv[1],
        reader_config=ReaderConfig(samples_per_epoch=2**39),
        writer_config=WriterConfig(show_progress=False),
    )
    attempt("dataset", lambda: next(iter(result.dataset)))
    attempt("state", lambda: result.dataset.state_dict())
    outcomes["position"] = result.dataset.state_dict()["position"]
print(json.dumps(outcomes))
"""


def test_an_epoch_larger_than_memory_reads_and_its_list_is_a_memory_error(
    tmp_path: Path,
) -> None:
    runtime, _ = open_dataset(tmp_path, source("c", 10))
    runtime.close()
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [sys.executable, "-c", HUGE_ORDERS, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert done.returncode == 0, done.stderr
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    for what in ("epoch_order", "weighted_epoch_order"):
        assert outcomes[what].startswith("MemoryError: cannot allocate 4398046511104 bytes"), (
            what,
            outcomes[what],
        )
        assert "position by position" in outcomes[what]
    # The pass itself needs no memory for its 2**39 positions: its first sample arrives.
    assert outcomes["dataset"] == "no error"
    assert outcomes["state"] == "no error"
    assert outcomes["position"] == 1


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
def test_prefetch_one_gives_the_same_order(tmp_path: Path, compression: ShardCompression) -> None:
    orders = []
    for prefetch, workers in ((1, 1), (1, 3), (2, 2), (64, 3), (1000, 2)):
        reader = ReaderConfig(seed=12, prefetch_size=prefetch, samples_per_epoch=45)
        runtime, dataset = open_dataset(
            tmp_path, source("c", 30), reader, compression, workers=workers, shard_size=4096
        )
        with runtime:
            orders.append(
                [(s.metadata["sample_id"], bytes(s.data)) for _ in range(2) for s in dataset]
            )
    expected = [
        (i, payload(i)) for epoch in range(2) for i in _native.epoch_order(12, epoch, 30, 45)
    ]
    assert all(order == expected for order in orders)


def test_prefetch_zero_refused() -> None:
    with pytest.raises(_native.ConfigError, match="prefetch_size"):
        ReaderConfig(prefetch_size=0)


def test_reusing_a_cache_does_not_iterate_the_source(tmp_path: Path) -> None:
    src = source("c", 5)
    runtime, _ = open_dataset(tmp_path, src)
    runtime.close()
    assert src.iterations == 1
    runtime = DatasetRuntime(num_workers=1)
    with runtime:
        result = runtime.from_cache_sources(
            src, tmp_path, reader_config=ReaderConfig(shuffle=False), writer_config=writer(NONE)
        )
        assert isinstance(result.results[0], CacheLoaded)
        assert [bytes(s.data) for s in result.dataset] == [payload(i) for i in range(5)]
    assert src.iterations == 1
