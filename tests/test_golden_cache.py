"""The committed golden caches, one per format version (`tests/data/golden_vN/golden`, each
written once by `tests/data/make_golden.py` with the DatasetRT of that version): every later
DatasetRT must keep reading these exact bytes.

The expected values are written out here on purpose instead of imported from the generator: the
bytes on disk are frozen, and so is what they must decode to.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import types
from pathlib import Path

import pytest

from dataset_rt import CacheLoaded, CacheSourcesDatasetSuccess, ReaderConfig, WriterConfig

DATA = Path(__file__).parent / "data"
VERSIONS = [1, 2, 3]


def golden(version: int) -> Path:
    return DATA / f"golden_v{version}" / "golden"


@pytest.fixture(params=VERSIONS, ids=lambda v: f"v{v}")
def version(request) -> int:
    return request.param


PAYLOADS = [
    bytes.fromhex("77abc86d5c37fe261ce84966b29ddcc90a2ced0d"),
    bytes.fromhex("2442ffeede6ab0781f47fb14845f2683237ccb5e6c"),
    b"golden v1 compressible payload " * 16,
    bytes.fromhex("336e4be6f30cfa46f61ef5b3323991e17906cfee427513"),
    bytes.fromhex("899495bbab1c65f7145b3cd960010db25dda42adcb41885e"),
    bytes.fromhex("d7837a735e63d4506ca548bc37308f3702329c20cdba0312a7"),
]
METADATA = [
    {"sample_id": "g0", "label": 0, "score": 0.5, "flag": True, "caption": ""},
    {"sample_id": "g1", "label": -(2**63), "score": math.nan, "flag": False, "caption": "café"},
    {"sample_id": "g2", "label": 2**63 - 1, "score": math.inf, "flag": True, "caption": "日本語 ✓"},
    {"sample_id": "g3", "label": 3, "score": -math.inf, "flag": False, "caption": "a\x00b"},
    {"sample_id": "g4", "label": -4, "score": -0.0, "flag": True, "caption": "🙂 emoji"},
    {"sample_id": "g5", "label": 5, "score": 1e-308, "flag": False, "caption": "line\nbreak"},
]
COMPRESSED = {2}
SCHEMA = [
    {"name": "sample_id", "type": "str"},
    {"name": "label", "type": "int"},
    {"name": "score", "type": "float"},
    {"name": "flag", "type": "bool"},
    {"name": "caption", "type": "str"},
]


def same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    return a == b


@pytest.fixture
def golden_copy(tmp_path, version) -> Path:
    """A private copy: nothing is ever written next to the committed bytes."""
    dest = tmp_path / "base" / "golden"
    shutil.copytree(golden(version), dest)
    return dest


def files(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def test_every_readable_version_has_a_committed_golden():
    from dataset_rt import _native

    assert VERSIONS[-1] == _native.FORMAT_VERSION
    assert sorted(p.name for p in DATA.glob("golden_v*")) == [f"golden_v{v}" for v in VERSIONS]


def test_committed_golden_is_complete_and_has_no_lock_file(version):
    assert sorted(files(golden(version))) == [
        "index.bin",
        "manifest.json",
        "metadata.arrow",
        "shards/000000.bin",
        "shards/000001.bin",
    ]
    assert not (golden(version).parent / ".golden.lock").exists()


def test_manifest_has_its_format_version(version):
    manifest = json.loads((golden(version) / "manifest.json").read_text(encoding="utf-8"))
    assert manifest["format"] == "dataset-rt-cache"
    assert manifest["format_version"] == version
    assert manifest["name"] == "golden"
    assert manifest["num_samples"] == 6
    assert manifest["metadata_schema"] == SCHEMA
    assert manifest["sample_id"] == "metadata"
    assert manifest["sample_id_type"] == "str"
    assert manifest["compression"] == {"algo": "lz4", "ratio": 0.5}
    assert [s["records"] for s in manifest["shards"]] == [3, 3]
    assert manifest["raw_payload_bytes"] == sum(map(len, PAYLOADS))


def test_reads_exact_samples_in_storage_order(runtime, golden_copy):
    before = files(golden_copy)

    result = runtime.from_cache_sources(
        types.SimpleNamespace(name="golden"),  # no source: the cache must load as it is
        golden_copy.parent,
        reader_config=ReaderConfig(shuffle=False, validate_cache=True),
        writer_config=WriterConfig(show_progress=False),
    )

    assert isinstance(result, CacheSourcesDatasetSuccess), result
    assert result.results == [CacheLoaded("golden", golden_copy, 6)]
    dataset = result.dataset
    assert len(dataset) == 6
    samples = list(dataset)
    assert len(samples) == 6
    for i, sample in enumerate(samples):
        assert bytes(sample.data) == PAYLOADS[i], i
        assert isinstance(sample.data, bytes if i in COMPRESSED else memoryview), i
        assert list(sample.metadata) == list(METADATA[i]), i
        for key, want in METADATA[i].items():
            assert same(sample.metadata[key], want), (i, key, sample.metadata[key])
    assert files(golden_copy) == before


def test_metadata_table_reads_with_pyarrow_and_polars(version):
    import polars as pl
    import pyarrow.ipc

    table = pyarrow.ipc.open_file(golden(version) / "metadata.arrow").read_all()
    assert table.column_names == [f["name"] for f in SCHEMA]
    frame = pl.read_ipc(golden(version) / "metadata.arrow")
    assert frame["sample_id"].to_list() == [m["sample_id"] for m in METADATA]
    assert frame["label"].to_list() == [m["label"] for m in METADATA]
    assert frame["caption"].to_list() == [m["caption"] for m in METADATA]
    assert frame["flag"].to_list() == [m["flag"] for m in METADATA]
    scores = frame["score"].to_list()
    assert all(same(a, m["score"]) for a, m in zip(scores, METADATA, strict=True))


def record_header(version: int, shard: bytes, offset: int) -> tuple:
    """(magic, flags, meta_len, stored_len, raw_len, reserved, sample, checksum) of the record at
    `offset`, by the documented layout of `version`'s record header."""
    if version == 1:
        return struct.unpack_from("<4sIIIIIQQ", shard, offset)
    magic, reserved, checksum, flags, meta_len, stored, raw, sample = struct.unpack_from(
        "<4sIQIIIIQ", shard, offset
    )
    return magic, flags, meta_len, stored, raw, reserved, sample, checksum


def test_records_decode_by_the_documented_layout_alone(version):
    """An independent reader: index entries, record headers, embedded metadata JSON and LZ4
    block payloads, with no DatasetRT code involved."""
    import lz4.block

    root = golden(version)
    index = (root / "index.bin").read_bytes()
    entry_len = 40 if version >= 3 else 32
    assert index[:8] == b"DRTINDEX"
    assert struct.unpack_from("<II", index, 8) == (version, entry_len)
    assert len(index) == 16 + entry_len * 6
    shards = [(root / "shards" / f"{k:06d}.bin").read_bytes() for k in range(2)]
    for k, shard in enumerate(shards):
        assert shard[:8] == b"DRTSHARD"
        assert struct.unpack_from("<II", shard, 8) == (version, k)
    for i in range(6):
        at = 16 + entry_len * i
        offset, shard_no, flags, stored_len, raw_len = struct.unpack_from("<QIIII", index, at)
        if version >= 3:
            entry_meta_len, padding, checksum = struct.unpack_from("<IIQ", index, at + 24)
            assert padding == 0
        else:
            entry_meta_len, (checksum,) = None, struct.unpack_from("<Q", index, at + 24)
        assert shard_no == i // 3
        assert offset % 16 == 0
        assert flags == (1 if i in COMPRESSED else 0)
        assert raw_len == len(PAYLOADS[i])
        record = shards[shard_no]
        magic, h_flags, meta_len, h_stored, h_raw, reserved, sample, h_checksum = record_header(
            version, record, offset
        )
        assert (magic, h_flags, h_stored, h_raw, reserved, sample, h_checksum) == (
            b"DRTR",
            flags,
            stored_len,
            raw_len,
            0,
            i,
            checksum,
        )
        assert entry_meta_len in (None, meta_len)
        embedded = json.loads(record[offset + 40 : offset + 40 + meta_len])
        want = {
            k: ("NaN" if isinstance(v, float) and math.isnan(v) else v)
            for k, v in METADATA[i].items()
        }
        want["score"] = {math.inf: "Infinity", -math.inf: "-Infinity"}.get(
            METADATA[i]["score"], want["score"]
        )
        assert embedded.keys() == want.keys()  # a JSON object: key order is not part of it
        assert all(same(embedded[k], want[k]) for k in want), (i, embedded)
        start = offset + (40 + meta_len + 15) // 16 * 16
        stored = record[start : start + stored_len]
        if flags & 1:
            assert stored_len < raw_len
            assert lz4.block.decompress(stored, uncompressed_size=raw_len) == PAYLOADS[i]
        else:
            assert stored == PAYLOADS[i]
