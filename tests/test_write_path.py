"""The write path end to end (issue 2): round trips, bad inputs, configs, threads, progress."""

from __future__ import annotations

import gc
import json
import math
import os
import random
import re
import struct
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest
from loader_helpers import views_a_shard_map

from dataset_rt import (
    CacheInput,
    CacheLoaded,
    CacheMissing,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWriteError,
    CacheWritten,
    ConfigError,
    DatasetRTError,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
)
from dataset_rt.testing import ListSource, assert_cache_equal, make_source

STORAGE_ORDER = ReaderConfig(shuffle=False)
QUIET = WriterConfig(show_progress=False)
LZ4 = ShardCompression(algo="lz4", ratio=0.9)
FLAG_LZ4 = 1


def write(runtime, sources, base, *, reader=STORAGE_ORDER, **writer):
    writer.setdefault("show_progress", False)
    return runtime.from_cache_sources(
        sources, base, reader_config=reader, writer_config=WriterConfig(**writer)
    )


def index_flags(cache_dir: Path) -> list[int]:
    """The flags of every index entry: after a 16-byte header that gives the entries' length
    (at byte 12), at byte 12 of each entry."""
    index = (cache_dir / "index.bin").read_bytes()
    (entry_len,) = struct.unpack_from("<I", index, 12)
    count = (len(index) - 16) // entry_len
    return [struct.unpack_from("<I", index, 16 + entry_len * i + 12)[0] for i in range(count)]


def incompressible(n: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(n)


def all_dirs(base: Path) -> list[str]:
    return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.exists() else []


# --- round trips

EVERY_TYPE = [
    {"flag": True, "count": 0, "score": 0.0, "text": ""},
    {"flag": False, "count": -1, "score": math.nan, "text": "unicode: café 日本語 🙂"},
    {"flag": True, "count": 2**63 - 1, "score": math.inf, "text": "nul \x00 inside"},
    {"flag": False, "count": -(2**63), "score": -math.inf, "text": 'quote " and \\ and \n'},
    {"flag": True, "count": 42, "score": -0.0, "text": "x" * 1000},
    {"flag": False, "count": 7, "score": 1.5e-310, "text": "\u200b"},
]


@pytest.mark.parametrize("compression", [ShardCompression(), LZ4], ids=["none", "lz4"])
def test_every_metadata_type_round_trips(runtime, tmp_path, compression):
    payloads = [incompressible(50, 1), b"a" * 4096, b"", incompressible(3, 2), b"ab" * 999, b"z"]
    source = make_source("types", zip(payloads, EVERY_TYPE, strict=True))

    result = write(runtime, source, tmp_path, shard_compression=compression)

    assert isinstance(result, CacheSourcesDatasetSuccess), result
    assert result.results == [CacheWritten("types", tmp_path / "types", 6)]
    samples = list(result.dataset)
    assert_cache_equal(samples, source)
    for sample, want in zip(samples, EVERY_TYPE, strict=True):
        for key, value in want.items():
            got = sample.metadata[key]
            assert type(got) is type(value), (key, got)
            if isinstance(value, float):
                assert math.isnan(got) == math.isnan(value)
                assert math.copysign(1.0, got) == math.copysign(1.0, value) or math.isnan(got)
    assert math.copysign(1.0, samples[4].metadata["score"]) == -1.0  # -0.0 keeps its sign
    assert samples[5].metadata["score"] == 1.5e-310  # subnormal survives


def test_metadata_arrow_holds_every_type_for_polars_and_pyarrow(runtime, tmp_path):
    import polars as pl
    import pyarrow.ipc

    source = make_source("arrow", [(b"p", m) for m in EVERY_TYPE])
    write(runtime, source, tmp_path)

    table = pyarrow.ipc.open_file(tmp_path / "arrow" / "metadata.arrow").read_all()
    frame = pl.read_ipc(tmp_path / "arrow" / "metadata.arrow")
    assert table.column_names == ["sample_id", "flag", "count", "score", "text"]
    assert frame.columns == table.column_names
    assert frame["sample_id"].to_list() == list(range(6))  # positional ids when none is given
    assert frame["count"].to_list() == [m["count"] for m in EVERY_TYPE]
    assert frame["text"].to_list() == [m["text"] for m in EVERY_TYPE]
    assert frame["flag"].to_list() == [m["flag"] for m in EVERY_TYPE]
    assert str(frame.schema["score"]) == "Float64"


def test_payloads_of_every_bytes_like_type(runtime, tmp_path):
    array = np.arange(12, dtype=np.float32)
    base = bytes(range(256))
    inputs = [
        b"plain bytes",
        bytearray(b"a bytearray"),
        memoryview(b"a memoryview"),
        memoryview(array),  # format "f": stored as its raw bytes
        memoryview(base)[::3],  # not contiguous
        memoryview(bytearray(b"sliced view"))[2:8],
        b"",
    ]
    expected = [bytes(x) for x in inputs]
    source = ListSource("bytes_like", [CacheInput(x, {}) for x in inputs])

    result = write(runtime, source, tmp_path)

    got = [bytes(s.data) for s in result.dataset]
    assert got == expected
    assert np.array_equal(np.frombuffer(got[3], dtype=np.float32), array)


def test_bytes_are_written_in_place_and_released_mutable_buffers_copied_at_once(runtime, tmp_path):
    # `bytes` payloads are read in place until written: every reference the writer took is
    # given back. A bytearray (or a view of one) changed after it was yielded keeps the value
    # it had then.
    kept = [bytes([i % 256]) * 5000 for i in range(300)]
    refs = [sys.getrefcount(b) for b in kept]

    class Mutating:
        name = "mutating"

        def __iter__(self):
            for i, b in enumerate(kept):
                yield CacheInput(b, {})
                if i % 50 == 0:
                    buf = bytearray(b"before")
                    view_of = bytearray(b"viewed")
                    yield CacheInput(buf, {})
                    yield CacheInput(memoryview(view_of), {})
                    buf[:] = b"AFTER!"
                    view_of[:] = b"CHANGE"

    result = write(runtime, Mutating(), tmp_path)

    got = [bytes(s.data) for s in result.dataset]
    expected = []
    for i, b in enumerate(kept):
        expected.append(b)
        if i % 50 == 0:
            expected += [b"before", b"viewed"]
    assert got == expected
    del result, got, expected, b
    gc.collect()
    assert [sys.getrefcount(k) for k in kept] == refs


def test_len_and_several_sources_concatenate_in_source_order(runtime, tmp_path):
    a = make_source("a", [(f"a{i}".encode(), {"i": i}) for i in range(3)])
    empty = make_source("empty", [])
    b = make_source("b", [(f"b{i}".encode(), {"j": str(i)}) for i in range(4)])

    result = write(runtime, [b, empty, a], tmp_path)

    assert [type(r) for r in result.results] == [CacheWritten] * 3
    assert [r.num_samples for r in result.results] == [4, 0, 3]
    dataset = result.dataset
    assert len(dataset) == 7
    assert dataset.num_samples == 7
    assert dataset.cache_names == ["b", "empty", "a"]
    assert [bytes(s.data) for s in dataset] == [b"b0", b"b1", b"b2", b"b3", b"a0", b"a1", b"a2"]
    # A second pass reads the same storage order again.
    assert_cache_equal(dataset, [*b.samples, *a.samples])


def test_raw_records_are_zero_copy_memoryviews_and_lz4_records_bytes(runtime, tmp_path):
    noise = incompressible(4096)
    text = b"compressible " * 400
    source = make_source("mixed", [(noise, {"k": 0}), (text, {"k": 1}), (b"", {"k": 2})])

    result = write(runtime, source, tmp_path, shard_compression=LZ4)

    raw, compressed, empty = list(result.dataset)
    assert isinstance(raw.data, memoryview)
    assert views_a_shard_map(raw.data)  # a view of the mapped shard: no copy
    assert raw.data.readonly
    assert raw.data.tobytes() == noise
    assert isinstance(compressed.data, bytes)
    assert compressed.data == text
    assert bytes(empty.data) == b""
    assert index_flags(tmp_path / "mixed") == [0, FLAG_LZ4, 0]
    manifest = json.loads((tmp_path / "mixed" / "manifest.json").read_text())
    assert manifest["raw_payload_bytes"] == len(noise) + len(text)
    assert manifest["stored_payload_bytes"] < len(noise) + len(text) // 4


def test_lz4_ratio_rule_keeps_a_record_compressed_only_under_the_ratio(runtime, tmp_path):
    # Three quarters noise, one quarter zeros: LZ4 shrinks it to roughly 0.75-0.8 of its size.
    half_compressible = incompressible(3072, 5) + bytes(1024)
    source = make_source("ratio", [(half_compressible, {})])

    loose = write(runtime, source, tmp_path / "loose", shard_compression=LZ4)
    strict = write(
        runtime,
        source,
        tmp_path / "strict",
        shard_compression=ShardCompression(algo="lz4", ratio=0.5),
    )

    assert index_flags(tmp_path / "loose" / "ratio") == [FLAG_LZ4]
    assert index_flags(tmp_path / "strict" / "ratio") == [0]
    assert next(iter(loose.dataset)).data == half_compressible
    assert isinstance(next(iter(strict.dataset)).data, memoryview)
    assert bytes(next(iter(strict.dataset)).data) == half_compressible


def test_algo_none_stores_compressible_payloads_raw(runtime, tmp_path):
    source = make_source("plain", [(b"a" * 10_000, {}), (b"b" * 100, {})])
    result = write(runtime, source, tmp_path, shard_compression=ShardCompression(algo="none"))
    assert index_flags(tmp_path / "plain") == [0, 0]
    assert all(isinstance(s.data, memoryview) for s in result.dataset)


def test_many_samples_with_small_prefetch_and_shard_rollover_keep_storage_order(runtime, tmp_path):
    rng = random.Random(7)
    samples = [
        (
            rng.randbytes(rng.randrange(0, 300)) if i % 3 else b"%d" % i * 50,
            {"sample_id": f"s{i}", "i": i},
        )
        for i in range(1500)
    ]
    source = make_source("many", samples)

    result = write(
        runtime, source, tmp_path, prefetch_size=1, shard_compression=LZ4, shard_size_bytes=4096
    )

    assert_cache_equal(result.dataset, source)
    manifest = json.loads((tmp_path / "many" / "manifest.json").read_text())
    assert len(manifest["shards"]) > 10
    assert sum(s["records"] for s in manifest["shards"]) == 1500
    assert all(s["bytes"] <= 4096 for s in manifest["shards"])  # no record here exceeds a shard


def test_metadata_keys_may_come_in_any_order(runtime, tmp_path):
    samples = [
        (b"0", {"a": 1, "b": "x", "c": True}),
        (b"1", {"c": False, "a": 2, "b": "y"}),
        (b"2", {"b": "z", "c": True, "a": 3}),
    ]
    result = write(runtime, make_source("order", samples), tmp_path)
    got = [s.metadata for s in result.dataset]
    assert got == [m for _, m in samples]
    assert all(list(m) == ["a", "b", "c"] for m in got)  # the schema's order, set by sample 0


def test_metadata_keys_built_per_sample_and_reordered_keep_their_columns(runtime, tmp_path):
    # The writer remembers key objects by identity: keys built anew for each sample (equal text,
    # other objects) and the same objects in another order must still land by name.
    def key(text):
        return "".join(list(text))

    rng = random.Random(5)
    samples = []
    for i in range(700):
        meta = {key("a"): i, key("b"): str(i), key("c"): i % 2 == 0}
        if i % 3 == 0:
            items = list(meta.items())
            rng.shuffle(items)
            meta = dict(items)
        samples.append((i.to_bytes(4, "little"), meta))
    result = write(runtime, make_source("rebuilt", samples), tmp_path)
    got = [(bytes(s.data), s.metadata) for s in result.dataset]
    assert got == [(d, {"a": i, "b": str(i), "c": i % 2 == 0}) for i, (d, _) in enumerate(samples)]


def test_existing_cache_is_loaded_without_iterating_the_source(runtime, tmp_path):
    source = make_source("reuse", [(b"one", {"v": 1}), (b"two", {"v": 2})])
    write(runtime, source, tmp_path)
    assert source.iterations == 1

    changed = make_source("reuse", [(b"different", {"v": 9})])
    result = write(runtime, changed, tmp_path)

    assert result.results == [CacheLoaded("reuse", tmp_path / "reuse", 2)]
    assert changed.iterations == 0
    assert_cache_equal(result.dataset, source)


def test_name_only_source_loads_an_existing_cache(runtime, tmp_path):
    write(runtime, make_source("named", [(b"x", {})]), tmp_path)
    result = write(runtime, types.SimpleNamespace(name="named"), tmp_path)
    assert result.results == [CacheLoaded("named", tmp_path / "named", 1)]
    assert [bytes(s.data) for s in result.dataset] == [b"x"]


# --- validation on write and on load


def test_writer_validate_cache_writes_and_reader_validate_cache_loads(runtime, tmp_path):
    source = make_source("checked", [(incompressible(100, i), {"i": i}) for i in range(20)])

    written = write(
        runtime, source, tmp_path, validate_cache=True, shard_compression=LZ4, shard_size_bytes=512
    )
    assert written.results == [CacheWritten("checked", tmp_path / "checked", 20)]

    loaded = write(
        runtime, source, tmp_path, reader=ReaderConfig(shuffle=False, validate_cache=True)
    )
    assert loaded.results == [CacheLoaded("checked", tmp_path / "checked", 20)]
    assert_cache_equal(loaded.dataset, source)


# --- bad samples (§6)


class Raising:
    """Yields `good` valid samples, then raises."""

    def __init__(self, name, good, error):
        self.name = name
        self.good = good
        self.error = error

    def __iter__(self):
        for i in range(self.good):
            yield CacheInput(b"ok", {"i": i})
        raise self.error


class IterFails:
    name = "iter_fails"

    def __iter__(self):
        raise OSError("cannot open the source files")


def ok(i):
    return CacheInput(b"ok", {"a": i})


BAD_SAMPLES = {
    "data_str": (
        [CacheInput("text", {})],
        0,
        ["data must be bytes, bytearray or memoryview, got str"],
    ),
    "data_int": ([ok(0), CacheInput(5, {"a": 1})], 1, ["data must be bytes", "got int"]),
    "data_list": ([CacheInput([1, 2], {})], 0, ["data must be bytes", "got list"]),
    "data_numpy": ([CacheInput(np.zeros(3), {})], 0, ["got ndarray", ".tobytes()"]),
    "metadata_not_mapping": (
        [CacheInput(b"x", [("a", 1)])],
        0,
        ["metadata must be a mapping", "got list"],
    ),
    "key_not_str": ([CacheInput(b"x", {1: "a"})], 0, ["metadata keys must be str, got int"]),
    "value_none": (
        [CacheInput(b"x", {"a": None})],
        0,
        ['"a" has type NoneType', "bool, int, float, str"],
    ),
    "value_list": ([CacheInput(b"x", {"a": [1]})], 0, ['"a" has type list']),
    "value_dict": ([CacheInput(b"x", {"a": {}})], 0, ['"a" has type dict']),
    "value_bytes": ([CacheInput(b"x", {"a": b"raw"})], 0, ['"a" has type bytes']),
    "int_overflow": ([ok(0), ok(2**70)], 1, ['"a"', str(2**70), "64-bit signed integer"]),
    "int_underflow": ([ok(-(2**63) - 1)], 0, ["64-bit signed integer"]),
    "missing_key": (
        [CacheInput(b"x", {"a": 1, "b": 2}), ok(1)],
        1,
        ['key "b" is missing', "sample 0"],
    ),
    "extra_key": ([ok(0), CacheInput(b"x", {"a": 1, "c": 2})], 1, ['key "c" is not in the schema']),
    # After many samples with the same key objects (and batches handed to the pool).
    "extra_key_late": (
        [ok(i) for i in range(300)] + [CacheInput(b"x", {"a": 1, "c": 2})],
        300,
        ['key "c" is not in the schema'],
    ),
    "int_to_str_late": ([ok(i) for i in range(300)] + [ok("s")], 300, ['"a" is str, but sample 0']),
    "int_to_float": ([ok(0), ok(0), ok(1.0)], 2, ['"a" is float, but sample 0 made it int']),
    "int_to_bool": ([ok(0), ok(True)], 1, ['"a" is bool, but sample 0 made it int']),
    "str_to_int": (
        [CacheInput(b"x", {"a": "s"}), ok(3)],
        1,
        ['"a" is int, but sample 0 made it str'],
    ),
    "duplicate_int_id": (
        [CacheInput(b"x", {"sample_id": i}) for i in [10, 11, 12, 11]],
        3,
        ["duplicate sample_id", "11"],
    ),
    "duplicate_str_id": (
        [CacheInput(b"x", {"sample_id": s}) for s in ["a", "b", "a"]],
        2,
        ["duplicate sample_id", '"a"'],
    ),
    "float_id": (
        [CacheInput(b"x", {"sample_id": 1.0})],
        0,
        ['"sample_id" must be an int or a str, got float'],
    ),
    "bool_id": (
        [CacheInput(b"x", {"sample_id": True})],
        0,
        ['"sample_id" must be an int or a str, got bool'],
    ),
    "not_a_cache_input": ([(b"x", {})], 0, ["expected a CacheInput", "got tuple"]),
    # A lone surrogate is not encodable text: refused, never stored as something else.
    "value_surrogate": ([CacheInput(b"x", {"a": "\ud800"})], 0, ['"a"', "surrogates not allowed"]),
    "key_surrogate": ([CacheInput(b"x", {"\ud800": 1})], 0, ["surrogates not allowed"]),
}


@pytest.mark.parametrize("case", BAD_SAMPLES, ids=list(BAD_SAMPLES))
def test_bad_sample_fails_its_source_only(runtime, tmp_path, case):
    samples, bad_index, fragments = BAD_SAMPLES[case]
    good = make_source("good", [(b"fine", {"n": 1})])

    result = write(runtime, [ListSource("bad", samples), good], tmp_path)

    assert isinstance(result, CacheSourcesDatasetSuccess), result
    failed, written = result.results
    assert isinstance(failed, CacheWriteError), failed
    assert failed.name == "bad"
    assert failed.path == tmp_path / "bad"
    assert f'source "bad", sample {bad_index}:' in failed.message
    for fragment in fragments:
        assert fragment in failed.message
    assert written == CacheWritten("good", tmp_path / "good", 1)
    assert all_dirs(tmp_path) == ["good"]  # nothing published or left over for "bad"
    assert [bytes(s.data) for s in result.dataset] == [b"fine"]


def test_source_raising_mid_way_names_source_index_and_exception(runtime, tmp_path):
    source = Raising("flaky", 3, ValueError("disk hiccup"))
    good = make_source("good", [(b"fine", {})])

    result = write(runtime, [source, good], tmp_path)

    failed = result.results[0]
    assert isinstance(failed, CacheWriteError)
    assert 'source "flaky", sample 3' in failed.message
    assert "ValueError: disk hiccup" in failed.message
    assert isinstance(result.results[1], CacheWritten)
    assert all_dirs(tmp_path) == ["good"]


@pytest.mark.parametrize("interrupt", [KeyboardInterrupt, SystemExit])
def test_interrupting_a_write_propagates_and_stops_later_sources(runtime, tmp_path, interrupt):
    """Ctrl-C (or sys.exit) inside a source is not a failed sample: it must stop the whole call
    instead of being reported as CacheWriteError while the next sources go on writing."""
    later = make_source("later", [(b"l", {})])

    with pytest.raises(interrupt):
        write(runtime, [Raising("interrupted", 2, interrupt()), later], tmp_path)

    assert later.iterations == 0
    assert all_dirs(tmp_path) == []  # the interrupted write left nothing behind


def test_source_whose_iter_raises_is_a_write_error(runtime, tmp_path):
    result = write(runtime, IterFails(), tmp_path)
    assert isinstance(result, CacheSourcesDatasetError)
    (failed,) = result.results
    assert isinstance(failed, CacheWriteError)
    assert '"iter_fails"' in failed.message
    assert "OSError: cannot open the source files" in failed.message
    assert all_dirs(tmp_path) == []


def test_not_iterable_source_without_cache_is_missing(runtime, tmp_path):
    good = make_source("good", [(b"g", {})])
    result = write(runtime, [types.SimpleNamespace(name="absent"), good], tmp_path)

    assert isinstance(result, CacheSourcesDatasetSuccess)
    missing, written = result.results
    assert isinstance(missing, CacheMissing)
    assert missing.name == "absent"
    assert missing.path == tmp_path / "absent"
    assert "not iterable" in missing.message
    assert str(tmp_path / "absent") in missing.message
    assert isinstance(written, CacheWritten)
    assert all_dirs(tmp_path) == ["good"]


def test_every_source_failing_gives_an_error_result_summarising_each(runtime, tmp_path):
    sources = [
        Raising("raises", 1, KeyError("k")),
        types.SimpleNamespace(name="nameonly"),
        ListSource("badtype", [CacheInput("s", {})]),
    ]
    result = write(runtime, sources, tmp_path)

    assert isinstance(result, CacheSourcesDatasetError)
    match result:
        case CacheSourcesDatasetError(results, message):
            pass
    assert [type(r) for r in results] == [CacheWriteError, CacheMissing, CacheWriteError]
    for name, kind in [
        ("raises", "CacheWriteError"),
        ("nameonly", "CacheMissing"),
        ("badtype", "CacheWriteError"),
    ]:
        assert f"{name}: {kind}" in message
    assert "KeyError" in message
    assert "not iterable" in message
    assert "got str" in message
    assert all_dirs(tmp_path) == []


def test_two_sources_with_one_name_fail_before_anything_is_written(runtime, tmp_path):
    first = make_source("twin", [(b"1", {})])
    second = make_source("twin", [(b"2", {})])
    other = make_source("other", [(b"3", {})])
    base = tmp_path / "base"

    with pytest.raises(ConfigError, match='two sources are named "twin"') as info:
        write(runtime, [other, first, second], base)

    assert "nothing was written" in str(info.value)
    assert not base.exists()
    assert first.iterations == second.iterations == other.iterations == 0


@pytest.mark.parametrize("name", ["", "a/b", ".hidden", "..", "a\\b", "nul\x00"])
def test_invalid_source_names_are_refused_before_writing(runtime, tmp_path, name):
    bad = make_source(name, [(b"x", {})])
    other = make_source("other", [(b"y", {})])
    base = tmp_path / "base"
    with pytest.raises(ConfigError, match="not a plain directory name"):
        write(runtime, [other, bad], base)
    assert not base.exists()
    assert other.iterations == 0


@pytest.mark.parametrize(
    "source", [object(), types.SimpleNamespace(name=3)], ids=["no_name", "int_name"]
)
def test_source_without_str_name_is_refused(runtime, tmp_path, source):
    with pytest.raises(ConfigError, match="has no str attribute `name`"):
        write(runtime, source, tmp_path / "base")
    assert not (tmp_path / "base").exists()


# --- configs

BAD_CONFIGS = {
    "none_ratio": (
        lambda: ShardCompression(algo="none", ratio=0.5),
        ['algo="none" requires ratio=1.0', "0.5"],
    ),
    "zstd": (lambda: ShardCompression(algo="zstd"), ['unknown algo "zstd"', "zstd is not in v0.1"]),
    "lz4_ratio_0": (lambda: ShardCompression(algo="lz4", ratio=0), ["0 < ratio <= 1", "got 0"]),
    "lz4_ratio_1.5": (
        lambda: ShardCompression(algo="lz4", ratio=1.5),
        ["0 < ratio <= 1", "got 1.5"],
    ),
    "lz4_ratio_nan": (lambda: ShardCompression(algo="lz4", ratio=math.nan), ["0 < ratio <= 1"]),
    "lz4_ratio_str": (
        lambda: ShardCompression(algo="lz4", ratio="0.5"),
        ["ShardCompression.ratio"],
    ),
    "reader_prefetch_0": (
        lambda: ReaderConfig(prefetch_size=0),
        ["ReaderConfig.prefetch_size", ">= 1"],
    ),
    "reader_negative_seed": (lambda: ReaderConfig(seed=-1), ["ReaderConfig.seed", "-1"]),
    "reader_seed_float": (lambda: ReaderConfig(seed=1.5), ["ReaderConfig.seed"]),
    "rank_not_below_world": (
        lambda: ReaderConfig(rank=2, world_size=2),
        ["rank 2 is not below world_size 2"],
    ),
    "world_size_0": (lambda: ReaderConfig(rank=0, world_size=0), ["ReaderConfig.world_size"]),
    "rank_alone": (lambda: ReaderConfig(rank=0), ["rank and world_size together"]),
    "writer_prefetch_0": (
        lambda: WriterConfig(prefetch_size=0),
        ["WriterConfig.prefetch_size", ">= 1"],
    ),
    "writer_prefetch_bool": (
        lambda: WriterConfig(prefetch_size=True),
        ["WriterConfig.prefetch_size"],
    ),
    "shard_size_0": (lambda: WriterConfig(shard_size_bytes=0), ["WriterConfig.shard_size_bytes"]),
    "compression_str": (
        lambda: WriterConfig(shard_compression="lz4"),
        ["expected ShardCompression"],
    ),
    "num_workers_0": (lambda: DatasetRuntime(num_workers=0), ["num_workers", "from 1 to 1024"]),
}


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=list(BAD_CONFIGS))
def test_bad_config_values_fail_at_construction(case):
    make, fragments = BAD_CONFIGS[case]
    with pytest.raises(ConfigError) as info:
        make()
    assert isinstance(info.value, DatasetRTError)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_good_configs_construct():
    assert ShardCompression(algo="lz4", ratio=1.0).ratio == 1.0
    assert ShardCompression(algo="none", ratio=1.0).algo == "none"
    assert ReaderConfig(rank=1, world_size=2, seed=2**64 - 1).rank == 1
    assert WriterConfig(prefetch_size=1, shard_size_bytes=1).prefetch_size == 1


# --- runtime threads


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")
@pytest.mark.parametrize("workers", [1, 3])
def test_runtime_owns_exactly_num_workers_threads(tmp_path, workers):
    gc.collect()  # runtimes of earlier tests that are still unreachable stop their threads now
    baseline = thread_count()
    runtime = DatasetRuntime(num_workers=workers)
    try:
        assert thread_count() == baseline + workers

        sources = [
            make_source(f"s{k}", [(incompressible(2000, i), {"i": i}) for i in range(300)])
            for k in range(2)
        ]
        result = write(runtime, sources, tmp_path, show_progress=True, shard_compression=LZ4)
        assert thread_count() == baseline + workers

        assert sum(1 for _ in result.dataset) == 600
        assert thread_count() == baseline + workers
        reloaded = write(runtime, sources, tmp_path, reader=ReaderConfig(validate_cache=True))
        assert sum(1 for _ in reloaded.dataset) == 600
        assert thread_count() == baseline + workers
    finally:
        runtime.close()
    deadline = time.monotonic() + 5
    while thread_count() != baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread_count() == baseline
    assert runtime.closed


# --- progress


def test_progress_line_names_the_cache_and_rates(runtime, tmp_path, capfd):
    source = make_source("progress_cache", [(b"x" * 1000, {}) for _ in range(50)])
    write(runtime, source, tmp_path, show_progress=True)

    out, err = capfd.readouterr()
    assert out == ""
    lines = [line for line in err.splitlines() if "progress_cache" in line]
    assert lines, err
    assert "samples/s" in lines[-1]
    assert "MB/s" in lines[-1]
    assert "50 samples" in lines[-1]
    assert "[1/" not in err  # one source: no source counter


def test_progress_counts_sources(runtime, tmp_path, capfd):
    sources = [make_source(n, [(b"y" * 100, {}) for _ in range(10)]) for n in ("first", "second")]
    write(runtime, sources, tmp_path, show_progress=True)

    err = capfd.readouterr().err
    assert any("[1/2] first" in line and "samples/s" in line for line in err.splitlines()), err
    assert any("[2/2] second" in line and "MB/s" in line for line in err.splitlines()), err


def test_progress_logs_each_finished_source_once_without_an_eta(runtime, tmp_path, capfd):
    # Captured stderr is a log: a quick source logs only its finished line, and a finished
    # source has nothing left to estimate (the running lines' ETA is tested in Rust:
    # rust/core/tests/progress.rs).
    names = ("e1", "e2", "e3")
    sources = [make_source(n, [(b"e" * 100, {}) for _ in range(10)]) for n in names]
    write(runtime, sources, tmp_path, show_progress=True)

    lines = capfd.readouterr().err.splitlines()
    for i, name in enumerate(names, start=1):
        mine = [line for line in lines if f"[{i}/3] {name}: " in line]
        assert len(mine) == 1, lines
        assert re.search(r"10 samples, 1\.00 kB \| .* \| written in \S+$", mine[0]), mine[0]
        assert "ETA" not in mine[0]


def test_show_progress_false_prints_nothing(runtime, tmp_path, capfd):
    sources = [make_source(n, [(b"z" * 100, {}) for _ in range(10)]) for n in ("p", "q")]
    write(runtime, sources, tmp_path, show_progress=False)
    write(runtime, sources, tmp_path, show_progress=False)  # and loading prints nothing either
    assert capfd.readouterr() == ("", "")


def test_progress_is_on_by_default(runtime, tmp_path, capfd):
    source = make_source("default_progress", [(b"d", {})])
    runtime.from_cache_sources(source, tmp_path, reader_config=STORAGE_ORDER)
    assert "default_progress" in capfd.readouterr().err
