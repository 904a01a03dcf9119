"""The loader's producer reads ahead on a pool of ``producer_threads`` threads, up to
``ReaderConfig.prefetch_size`` samples: LZ4 and raw caches come out in the global order with
every byte, whatever the thread count, and bad values are refused."""

from __future__ import annotations

import random
import re

import pytest
from loader_helpers import no_leaks  # noqa: F401

from dataset_rt import (
    ConfigError,
    CorruptRecordError,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
)
from dataset_rt._loader import DataLoader
from dataset_rt.testing import corrupt_byte, make_source

N_LZ4 = 90
N_RAW = 40


def compressible(i: int) -> bytes:
    """Sample `i` of the LZ4 cache: a random head, then a long run LZ4 keeps compressed."""
    rng = random.Random(i)
    return rng.randbytes(16) + bytes([i % 251]) * (2000 + 997 * (i % 13))


def incompressible(i: int) -> bytes:
    return random.Random(-1 - i).randbytes(100 + i)


@pytest.fixture(scope="module")
def runtime():
    rt = DatasetRuntime(num_workers=2)
    yield rt
    rt.close()


def load(runtime, base, *, prefetch_size: int = 64, shuffle: bool = True):
    """An LZ4 cache and a raw one, in that order, under `base` (written on first use)."""
    lz4 = make_source("lz4", [(compressible(i), {"i": i, "src": "lz4"}) for i in range(N_LZ4)])
    raw = make_source("raw", [(incompressible(i), {"i": i, "src": "raw"}) for i in range(N_RAW)])
    result = runtime.from_cache_sources(
        [lz4, raw],
        base,
        reader_config=ReaderConfig(seed=3, shuffle=shuffle, prefetch_size=prefetch_size),
        writer_config=WriterConfig(
            show_progress=False, shard_compression=ShardCompression(algo="lz4", ratio=0.9)
        ),
    )
    assert result.dataset is not None
    return result.dataset


@pytest.fixture(scope="module")
def base(runtime, tmp_path_factory):
    path = tmp_path_factory.mktemp("readahead-cache")
    load(runtime, path)
    # The LZ4 cache is stored compressed, the raw one is not.
    lz4_bytes = sum(f.stat().st_size for f in (path / "lz4" / "shards").iterdir())
    assert lz4_bytes * 5 < sum(len(compressible(i)) for i in range(N_LZ4))
    raw_bytes = sum(f.stat().st_size for f in (path / "raw" / "shards").iterdir())
    assert raw_bytes > sum(len(incompressible(i)) for i in range(N_RAW))
    return path


def in_process(dataset, epoch: int) -> list[tuple[str, int, bytes]]:
    dataset.set_epoch(epoch)
    return [(s.metadata["src"], s.metadata["i"], bytes(s.data)) for s in dataset]


def keyed(sample):
    """A picklable transform: what the comparison needs, copied out of the slot."""
    return sample.metadata["src"], sample.metadata["i"], bytes(sample.data)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize(("producer_threads", "prefetch_size"), [(1, 1), (3, 64), (4, 7)])
def test_lz4_caches_under_the_loader_equal_in_process_iteration(
    runtime, base, num_workers, producer_threads, prefetch_size
):
    dataset = load(runtime, base, prefetch_size=prefetch_size)
    expected = [in_process(dataset, 0), in_process(dataset, 1)]
    assert {c for c, _, _ in expected[0]} == {"lz4", "raw"}
    loader = DataLoader(
        dataset,
        batch_size=9,
        num_workers=num_workers,
        transform=keyed,
        producer_threads=producer_threads,
    )
    with loader:
        assert loader.producer_threads == producer_threads
        for epoch in (0, 1):
            got = [item for batch in loader for item in batch]
            assert got == expected[epoch]


def test_the_default_thread_count_is_at_most_four(runtime, base):
    dataset = load(runtime, base)
    with DataLoader(dataset, batch_size=16) as loader:
        assert 1 <= loader.producer_threads <= 4
        got = [keyed(s) for batch in loader for s in batch]  # valid until the next batch
    assert got == in_process(dataset, 0)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "expected an int >= 1, got 0"),
        (-2, "expected an int >= 1, got -2"),
        (True, "expected an int >= 1, got True"),
        (2.0, "expected an int >= 1, got 2.0"),
        ("2", "expected an int >= 1, got '2'"),
        (2**70, f"{2**70} is too large (at most {2**64 - 1})"),
        (257, "257 threads is above the limit of 256"),
    ],
)
def test_bad_producer_threads_are_refused(runtime, base, value, message):
    dataset = load(runtime, base)
    expected = re.escape(f"invalid DataLoader.producer_threads: {message}")
    with pytest.raises(ConfigError, match=expected):
        DataLoader(dataset, producer_threads=value)


@pytest.mark.parametrize("value", [0, -1, True, 1.5, 2**20 + 1, 2**40])
def test_bad_prefetch_sizes_are_refused(value):
    # Past 2**20 samples read ahead, memory (not the disk) is what a larger value would buy.
    with pytest.raises(ConfigError, match=re.escape("invalid ReaderConfig.prefetch_size")):
        ReaderConfig(prefetch_size=value)


def test_the_largest_prefetch_size_reads_the_epoch(runtime, base):
    dataset = load(runtime, base, prefetch_size=2**20)
    assert len([s for s in dataset]) == len(dataset)


def test_a_corrupt_lz4_record_read_ahead_is_raised_in_order(runtime, tmp_path):
    dataset = load(runtime, tmp_path, shuffle=False)
    corrupt_byte(tmp_path / "lz4" / "shards" / "000000.bin", -5)  # the last LZ4 record
    shard = str(tmp_path / "lz4" / "shards" / "000000.bin")
    received: list[int] = []
    loader = DataLoader(dataset, batch_size=10, producer_threads=4)
    # Batch 8 holds sample 89, the last of the LZ4 cache; read ahead of batches 0 to 7.
    with loader, pytest.raises(CorruptRecordError, match="producer failed at batch 8") as error:
        for batch in loader:
            received += [s.metadata["i"] for s in batch]
    assert received == list(range(80))  # every batch before the bad one arrived, in order
    assert shard in str(error.value)
    assert "sample 89" in str(error.value)
