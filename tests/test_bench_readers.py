"""The benchmarks' own readers of a DatasetRT cache's files must read what DatasetRT reads: a
reader that drifts from the storage format measures nothing (torch over the cache, in
bench/bench_loader.py, parses record headers itself)."""

import sys
from pathlib import Path

import pytest

from dataset_rt import DatasetRuntime, ReaderConfig, ShardCompression, WriterConfig
from dataset_rt.testing import make_source

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def bench_loader():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_loader

        yield bench_loader
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("compressed", [False, True])
def test_torch_over_the_cache_reads_every_payload_as_dataset_rt_does(
    tmp_path, bench_loader, compressed
):
    if compressed:
        pytest.importorskip("lz4")
    samples = [
        (bytes([i % 7]) * (100 + 37 * i), {"i": i, "name": "x" * (i % 5)}) for i in range(40)
    ]
    # LZ4 with ratio 1.0 keeps every record that compresses at all (these all do).
    compression = ShardCompression(algo="lz4", ratio=1.0) if compressed else ShardCompression()
    writer = WriterConfig(show_progress=False, shard_compression=compression)
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.from_cache_sources(
            make_source("bench", samples),
            tmp_path,
            writer_config=writer,
            reader_config=ReaderConfig(shuffle=False),
        )
        dataset = result.dataset
        expected = [bytes(s.data) for s in dataset]
    reader = bench_loader.CacheMapDataset(tmp_path / "bench", None)
    assert len(reader) == len(samples)
    assert [bytes(reader[i]) for i in range(len(reader))] == expected
    assert expected == [payload for payload, _ in samples]
