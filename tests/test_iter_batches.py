"""Batch reads: ``Dataset.iter_batches`` gives the order, rank split, epochs and state of
per-sample iteration, a batch at a time, with zero-copy payloads and the batch's rows of the
samples-metadata table."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from dataset_rt import (
    Batch,
    CachedSample,
    ConfigError,
    CorruptRecordError,
    Dataset,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
)
from dataset_rt.testing import corrupt_byte, make_source

N = 23
NONE = ShardCompression()
LZ4 = ShardCompression(algo="lz4", ratio=0.9)


def payload(name: str, i: int) -> bytes:
    # Compressible, so that an LZ4 cache really stores it compressed.
    return f"{name}:{i}:".encode() * 8


def source(name: str = "c", n: int = N, ids: str = "int"):  # type: ignore[no-untyped-def]
    return make_source(
        name,
        [
            (
                payload(name, i),
                {
                    "sample_id": i if ids == "int" else f"{name}-{i}",
                    "label": f"l{i % 3}",
                    "x": i / 2,
                },
            )
            for i in range(n)
        ],
    )


@contextmanager
def opened(
    base: Path,
    sources: Any,
    reader: ReaderConfig | None = None,
    compression: ShardCompression = NONE,
) -> Iterator[Dataset]:
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            sources,
            base,
            reader_config=reader or ReaderConfig(seed=7),
            writer_config=WriterConfig(show_progress=False, shard_compression=compression),
        )
        yield result.dataset


def per_sample(dataset: Dataset) -> list[bytes]:
    return [bytes(sample.data) for sample in dataset]


def flat(batches: Any) -> list[bytes]:
    return [bytes(x) for batch in batches for x in batch.data]


def from_spans(batch: Batch) -> list[bytes]:
    buffers = batch.buffers
    return [bytes(buffers[b][start:end]) for b, start, end in batch.spans.tolist()]


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
@pytest.mark.parametrize("batch_size", [1, 4, 7, N, N + 5])
def test_order_equals_per_sample_iteration(
    tmp_path: Path, compression: ShardCompression, batch_size: int
) -> None:
    with opened(tmp_path, source(), compression=compression) as dataset:
        for epoch in (0, 3):
            dataset.set_epoch(epoch)
            expected = per_sample(dataset)
            dataset.set_epoch(epoch)
            batches = list(dataset.iter_batches(batch_size))
            assert flat(batches) == expected, f"epoch {epoch}"
            sizes = [len(b) for b in batches]
            assert sizes[:-1] == [batch_size] * (len(sizes) - 1)
            assert 1 <= sizes[-1] <= batch_size
            assert sum(sizes) == N


def test_payload_types(tmp_path: Path) -> None:
    with opened(tmp_path / "raw", source()) as dataset:
        batch = next(dataset.iter_batches(5))
        assert isinstance(batch, Batch)
        assert all(isinstance(x, memoryview) and x.readonly for x in batch.data)
    with opened(tmp_path / "lz4", source(), compression=LZ4) as dataset:
        batch = next(dataset.iter_batches(5))
        assert all(isinstance(x, bytes) for x in batch.data)


def test_changing_the_data_list_changes_nothing_of_the_batch(tmp_path: Path) -> None:
    with opened(tmp_path, source()) as dataset:
        batch = next(dataset.iter_batches(3))
        first = batch.data
        expected = [bytes(x) for x in first]
        first.append(b"junk")
        first[0] = b"zz"
        assert [bytes(x) for x in batch.data] == expected
        assert batch.data is not batch.data


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
def test_samples_pickle_and_copy_as_their_values(tmp_path: Path, compression: Any) -> None:
    import copy
    import pickle

    with opened(tmp_path, source(), compression=compression) as dataset:
        samples = list(dataset)
    made = CachedSample(memoryview(b"abc"), {"label": 3})
    for sample in [*samples[:3], made]:
        for twin in (
            pickle.loads(pickle.dumps(sample)),
            copy.copy(sample),
            copy.deepcopy(sample),
        ):
            assert type(twin) is CachedSample
            assert isinstance(twin.data, bytes) and twin.data == bytes(sample.data)
            assert twin.metadata == sample.metadata
            assert twin.metadata is not sample.metadata


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
@pytest.mark.parametrize("batch_size", [1, 7, N])
def test_spans_give_the_payloads_of_data(
    tmp_path: Path, compression: ShardCompression, batch_size: int
) -> None:
    with opened(tmp_path, source(), compression=compression) as dataset:
        expected = per_sample(dataset)
        dataset.set_epoch(0)
        got = []
        for batch in dataset.iter_batches(batch_size):
            spans = batch.spans
            assert spans.dtype == np.int64
            assert spans.shape == (len(batch), 3)
            assert not spans.flags.writeable
            assert batch.spans is spans  # built once
            assert (spans[:, 2] - spans[:, 1] == [len(x) for x in batch.data]).all()
            got += from_spans(batch)
        assert got == expected


def test_buffers_are_the_shards_then_the_decompressed_payloads(tmp_path: Path) -> None:
    # Raw records in several small shards beside a compressed cache: the shards a batch reads,
    # whole and in order of first use, then one bytes of the batch's decompressed payloads.
    with DatasetRuntime(num_workers=2) as runtime:
        raw = runtime.from_cache_sources(
            source("r", 40),
            tmp_path / "small",
            reader_config=ReaderConfig(seed=1),
            writer_config=WriterConfig(show_progress=False, shard_size_bytes=1024),
        ).dataset
        shards = sorted((tmp_path / "small" / "r" / "shards").glob("*.bin"))
        assert len(shards) > 3
        sizes = {p.stat().st_size for p in shards}
        batch = next(raw.iter_batches(40))
        buffers = batch.buffers
        assert batch.buffers is buffers  # made once
        assert all(isinstance(b, memoryview) and b.readonly for b in buffers)
        assert {len(b) for b in buffers} <= sizes
        assert len(buffers) == len(shards)
        first_use = list(dict.fromkeys(batch.spans[:, 0].tolist()))
        assert first_use == list(range(len(buffers)))
        assert from_spans(batch) == [bytes(x) for x in batch.data]
    with opened(tmp_path / "mixed", [source("r", 9)]):
        pass
    with opened(tmp_path / "mixed", [source("r", 9), source("z", 9)], compression=LZ4) as mixed:
        # "r" was written raw before; "z" is written compressed now.
        kinds = set()
        for batch in mixed.iter_batches(18):
            *maps, last = batch.buffers
            assert isinstance(last, bytes)
            assert all(isinstance(b, memoryview) for b in maps)
            owned = batch.spans[:, 0] == len(maps)
            assert owned.sum() == 9
            # The decompressed payloads lie end to end in the last buffer, in batch order.
            ends = batch.spans[owned, 2]
            assert batch.spans[owned, 1].tolist() == [0, *ends[:-1].tolist()]
            assert ends[-1] == len(last)
            assert from_spans(batch) == [bytes(x) for x in batch.data]
            kinds |= {type(x) for x in batch.data}
        assert kinds == {memoryview, bytes}


def test_spans_and_buffers_stay_valid(tmp_path: Path) -> None:
    with opened(tmp_path, source()) as dataset:
        expected = per_sample(dataset)
        dataset.set_epoch(0)
        kept = [(b.buffers, b.spans) for b in dataset.iter_batches(4)]
    del dataset
    gc.collect()
    got = [bytes(bufs[b][s:e]) for bufs, spans in kept for b, s, e in spans.tolist()]
    assert got == expected


def test_passes_advance_epochs_as_per_sample_iteration(tmp_path: Path) -> None:
    with opened(tmp_path, source()) as dataset:
        expected = [per_sample(dataset) for _ in range(3)]
        dataset.set_epoch(0)
        got = [flat(dataset.iter_batches(5)) for _ in range(3)]
        assert got == expected
        assert expected[0] != expected[1]
        assert dataset.state_dict()["epoch"] == 3


@pytest.mark.parametrize("drop_last", [False, True], ids=["short_last", "drop_last"])
def test_the_iterator_counts_the_batches_left_and_knows_its_epoch(
    tmp_path: Path, drop_last: bool
) -> None:
    with opened(tmp_path, source()) as dataset:
        dataset.set_epoch(2)
        batches = dataset.iter_batches(7, drop_last=drop_last)
        assert batches.epoch == 2
        expected = N // 7 if drop_last else -(-N // 7)
        for left in range(expected, 0, -1):
            assert len(batches) == left
            next(batches)
        assert len(batches) == 0
        assert list(batches) == []


@pytest.mark.parametrize("drop_last", [False, True], ids=["pad", "drop"])
def test_rank_split_equals_per_sample_iteration(tmp_path: Path, drop_last: bool) -> None:
    world = 3
    with opened(tmp_path / "w", source()):
        pass
    shares = []
    for rank in range(world):
        reader = ReaderConfig(seed=3, rank=rank, world_size=world, drop_last=drop_last)
        with opened(tmp_path / "w", source(), reader) as dataset:
            expected = per_sample(dataset)
            dataset.set_epoch(0)
            assert flat(dataset.iter_batches(4)) == expected
            shares.append(expected)
    assert len({len(s) for s in shares}) == 1
    if drop_last:
        assert len({x for s in shares for x in s}) == world * len(shares[0])


def test_indices_and_rows_match_samples_metadata(tmp_path: Path) -> None:
    # Two caches: their own metadata columns (nulls where a cache lacks one), and weights.
    other = make_source(
        "d",
        [(payload("d", i), {"sample_id": i, "label": "d", "flag": i % 2 == 0}) for i in range(9)],
    )
    with opened(tmp_path, [source(), other]) as dataset:
        table = dataset.samples_metadata()
        weights = [1.0 + (i % 5) for i in range(len(table))]
        dataset.set_samples_metadata(table.with_columns(pl.Series("weight", weights)))
        table = dataset.samples_metadata()
        payloads = {
            (row["cache_id"], row["sample_id"]): payload(row["cache_id"], row["sample_id"])
            for row in table.iter_rows(named=True)
        }
        seen = 0
        for batch in dataset.iter_batches(6):
            indices = batch.indices
            assert indices.dtype == np.int64
            assert len(indices) == len(batch)
            rows = batch.rows
            assert rows.schema == table.schema
            assert rows.equals(table[indices.tolist()])
            keys = list(zip(rows["cache_id"], rows["sample_id"], strict=True))
            assert [bytes(x) for x in batch.data] == [payloads[k] for k in keys]
            assert batch.rows is rows  # built once
            seen += len(batch)
        assert seen == len(dataset)
        assert table["flag"].null_count() == N


def test_rows_with_int_and_str_ids_together(tmp_path: Path) -> None:
    with opened(tmp_path, [source("i", 5), source("s", 4, ids="str")]) as dataset:
        table = dataset.samples_metadata()
        assert table.schema["sample_id"] == pl.String
        batches = list(dataset.iter_batches(4))
        for batch in batches:
            assert batch.rows.equals(table[batch.indices.tolist()])
        assert sorted(np.concatenate([b.indices for b in batches]).tolist()) == list(range(9))


def test_a_batch_is_whole_after_its_runtime_is_closed(tmp_path: Path) -> None:
    """Every member of a batch, first asked for after the runtime was closed, is there: the
    rows too, though they are built on first access."""
    with opened(tmp_path, [source("i", 5), source("s", 4, ids="str")]) as dataset:
        table = dataset.samples_metadata()
        expected = per_sample(dataset)
        dataset.set_epoch(0)
        batches = list(dataset.iter_batches(4))
    # The runtime is closed here.
    assert flat(batches) == expected
    for batch in batches:
        assert batch.rows.equals(table[batch.indices.tolist()])
        assert len(batch.spans) == len(batch) and len(batch.buffers) >= 1


def test_views_stay_valid(tmp_path: Path) -> None:
    with opened(tmp_path, source()) as dataset:
        expected = per_sample(dataset)
        dataset.set_epoch(0)
        iterator = dataset.iter_batches(3)
        kept = [next(iterator) for _ in range(3)]
        views = [x for b in kept for x in b.data]
        rest = list(iterator)
        del iterator, kept
    # The runtime is closed and the dataset is gone: the views keep their maps alive.
    del dataset
    gc.collect()
    assert [bytes(v) for v in views] == expected[:9]
    assert flat(rest) == expected[9:]


@pytest.mark.parametrize("batch_size", [1, 5, 8])
def test_state_counts_the_samples_of_yielded_batches(tmp_path: Path, batch_size: int) -> None:
    with opened(tmp_path, source()) as dataset:
        # The states per-sample iteration reports after k samples, k = 0 .. N - 1.
        expected = []
        samples = iter(dataset)
        for _ in range(N):
            expected.append(dataset.state_dict())
            next(samples)
        del samples
        dataset.set_epoch(0)
        states = [dataset.state_dict()]
        for _ in dataset.iter_batches(batch_size):
            states.append(dataset.state_dict())
        assert states[:-1] == expected[::batch_size]
        assert (states[-1]["epoch"], states[-1]["position"]) == (1, 0)


@pytest.mark.parametrize("compression", [NONE, LZ4], ids=["none", "lz4"])
@pytest.mark.parametrize("position", [0, 1, 5, 11, 22])
def test_resume_at_any_position(
    tmp_path: Path, compression: ShardCompression, position: int
) -> None:
    batch_size = 4
    with opened(tmp_path, source(), compression=compression) as dataset:
        expected = per_sample(dataset)
        dataset.set_epoch(0)
        samples = iter(dataset)
        for _ in range(position):
            next(samples)
        state = dataset.state_dict()
        del samples
    with opened(tmp_path, source(), compression=compression) as resumed:
        resumed.load_state_dict(state)
        batches = list(resumed.iter_batches(batch_size))
        # The first batch after resume is full-size and starts at the state's next sample.
        assert len(batches[0]) == min(batch_size, N - position)
        assert flat(batches) == expected[position:]
        assert resumed.state_dict()["epoch"] == 1


def test_batch_state_resumes_per_sample_and_batched(tmp_path: Path) -> None:
    with opened(tmp_path, source()) as dataset:
        expected = per_sample(dataset)
        dataset.set_epoch(0)
        batches = dataset.iter_batches(5)
        next(batches)
        next(batches)
        state = dataset.state_dict()
        assert state["position"] == 10
        del batches
    with opened(tmp_path, source()) as resumed:
        resumed.load_state_dict(state)
        assert per_sample(resumed) == expected[10:]
        resumed.load_state_dict(state)
        assert flat(resumed.iter_batches(3)) == expected[10:]


def test_resume_on_ranks(tmp_path: Path) -> None:
    world, batch_size = 2, 3
    with opened(tmp_path / "w", source()):
        pass
    for rank in range(world):
        reader = ReaderConfig(seed=5, rank=rank, world_size=world)
        with opened(tmp_path / "w", source(), reader) as dataset:
            expected = per_sample(dataset)
            dataset.set_epoch(0)
            batches = dataset.iter_batches(batch_size)
            head = flat([next(batches)])
            state = dataset.state_dict()
            del batches
            dataset.load_state_dict(state)
            assert head + flat(dataset.iter_batches(batch_size)) == expected


@pytest.mark.parametrize("start", [0, 3])
def test_drop_last(tmp_path: Path, start: int) -> None:
    batch_size = 5
    with opened(tmp_path, source()) as dataset:
        expected = per_sample(dataset)
        dataset.set_epoch(0)
        samples = iter(dataset)
        for _ in range(start):
            next(samples)
        state = dataset.state_dict()
        del samples
        dataset.load_state_dict(state)
        batches = list(dataset.iter_batches(batch_size, drop_last=True))
        whole = (N - start) // batch_size
        assert [len(b) for b in batches] == [batch_size] * whole
        assert flat(batches) == expected[start : start + whole * batch_size]
        # The pass ended at its last whole batch: the state is the next epoch's start.
        after = dataset.state_dict()
        assert (after["epoch"], after["position"]) == (1, 0)


def test_drop_last_state_ends_with_the_last_whole_batch(tmp_path: Path) -> None:
    with opened(tmp_path, source()) as dataset:
        batches = dataset.iter_batches(10, drop_last=True)
        next(batches)
        assert dataset.state_dict()["position"] == 10
        next(batches)
        assert (dataset.state_dict()["epoch"], dataset.state_dict()["position"]) == (1, 0)
        with pytest.raises(StopIteration):
            next(batches)


def test_drop_last_with_fewer_samples_than_a_batch(tmp_path: Path) -> None:
    with opened(tmp_path, source()) as dataset:
        assert list(dataset.iter_batches(N + 1, drop_last=True)) == []
        assert dataset.state_dict()["epoch"] == 1


@pytest.mark.parametrize("bad", [0, -1])
def test_invalid_batch_size_changes_nothing(tmp_path: Path, bad: int) -> None:
    with opened(tmp_path, source()) as dataset:
        samples = iter(dataset)
        next(samples)
        state = dataset.state_dict()
        dataset.load_state_dict(state)
        with pytest.raises(ConfigError, match=f"batch_size {bad}: must be at least 1"):
            dataset.iter_batches(bad)
        assert dataset.state_dict() == state
        with pytest.raises(TypeError):
            dataset.iter_batches(2.5)  # type: ignore[arg-type]


def test_corrupt_record_fails_its_batch_and_keeps_the_state(tmp_path: Path) -> None:
    n, bad = 20, 7
    with opened(tmp_path, source(n=n), ReaderConfig(shuffle=False)):
        pass
    (shard,) = (tmp_path / "c" / "shards").glob("*.bin")
    data = shard.read_bytes()
    corrupt_byte(shard, data.index(payload("c", bad)) + 2)
    with opened(tmp_path, source(n=n), ReaderConfig(shuffle=False)) as dataset:
        batches = dataset.iter_batches(3)
        got = flat([next(batches), next(batches)])
        assert got == [payload("c", i) for i in range(6)]
        with pytest.raises(CorruptRecordError, match=f"sample {bad}"):
            next(batches)
        # The failed batch was not handed out; the pass ends there.
        assert dataset.state_dict()["position"] == 6
        with pytest.raises(StopIteration):
            next(batches)
