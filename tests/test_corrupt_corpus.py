"""A corpus of damaged caches: each case gives its own exact error, and a damaged cache is reported
as `CacheMalformed`, never overwritten, even when its source could rewrite it."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from dataset_rt import (
    CacheLoaded,
    CacheMalformed,
    CacheMalformedError,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CorruptRecordError,
    DatasetRTError,
    ReaderConfig,
    WriterConfig,
    _native,
)
from dataset_rt.cli import EXIT_FAILED, main
from dataset_rt.testing import ListSource, corrupt_byte, make_source, truncate_file

NAME = "victim"
SHARD_SIZE = 1024
NUM_SAMPLES = 12


def source() -> ListSource:
    return make_source(
        NAME,
        [(bytes([i]) * (40 + 7 * i), {"sample_id": f"id{i}", "i": i}) for i in range(NUM_SAMPLES)],
    )


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """One good cache, written once; each test damages its own copy."""
    from dataset_rt import DatasetRuntime

    base = tmp_path_factory.mktemp("pristine")
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            source(),
            base,
            writer_config=WriterConfig(show_progress=False, shard_size_bytes=SHARD_SIZE),
        )
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    manifest = json.loads((base / NAME / "manifest.json").read_text())
    assert len(manifest["shards"]) >= 3  # the cases below damage shard 1
    return base / NAME


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    dest = tmp_path / "base" / NAME
    shutil.copytree(pristine, dest)
    return dest


def load(runtime, cache_dir: Path, *, validate: bool, src=None):
    return runtime.from_cache_sources(
        src if src is not None else source(),
        cache_dir.parent,
        reader_config=ReaderConfig(shuffle=False, validate_cache=validate),
        writer_config=WriterConfig(show_progress=False),
    )


def snapshot(cache_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(cache_dir)): p.read_bytes()
        for p in sorted(cache_dir.rglob("*"))
        if p.is_file()
    }


def record_payload_offset(cache_dir: Path, sample: int) -> tuple[Path, int, int]:
    """(shard path, record offset, payload offset) of `sample`, read the documented way: index
    entries `<offset u64, shard u32, ...>` after a 16-byte header that gives their length (32
    bytes, 40 from v3 on), record header of 40 bytes with the metadata length at byte 20 (v2 and
    later; byte 8 in v1), payload aligned to 16."""
    index = (cache_dir / "index.bin").read_bytes()
    (entry_len,) = struct.unpack_from("<I", index, 12)
    offset, shard = struct.unpack_from("<QI", index, 16 + entry_len * sample)
    path = cache_dir / "shards" / f"{shard:06d}.bin"
    data = path.read_bytes()
    (version,) = struct.unpack_from("<I", data, 8)
    header = data[offset : offset + 40]
    assert header[:4] == b"DRTR"
    (meta_len,) = struct.unpack_from("<I", header, 8 if version == 1 else 20)
    return path, offset, offset + (40 + meta_len + 15) // 16 * 16


def edit_manifest(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(cache_dir: Path) -> None:
        path = cache_dir / "manifest.json"
        manifest = json.loads(path.read_text())
        change(manifest)
        path.chmod(0o644)  # published read-only
        path.write_text(json.dumps(manifest, indent=2))

    return apply


def set_in(*keys_and_value):
    *keys, value = keys_and_value

    def change(manifest):
        target = manifest
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    return change


def bump(*keys, by=16):
    def change(manifest):
        target = manifest
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] += by

    return change


def flip_hex_digit(*keys):
    def change(manifest):
        target = manifest
        for k in keys[:-1]:
            target = target[k]
        digits = target[keys[-1]]
        target[keys[-1]] = ("1" if digits[0] == "0" else "0") + digits[1:]

    return change


def flip_payload(cache_dir: Path, sample: int = 7) -> None:
    path, _, payload = record_payload_offset(cache_dir, sample)
    corrupt_byte(path, payload + 3)


def remove(rel: str) -> Callable[[Path], None]:
    return lambda cache_dir: (cache_dir / rel).unlink()


def truncate(rel: str) -> Callable[[Path], None]:
    """Cuts off the second half of the file (the manifest's last byte alone is a newline)."""
    return lambda cache_dir: truncate_file(cache_dir / rel, (cache_dir / rel).stat().st_size // 2)


def flip(rel: str, offset: int) -> Callable[[Path], None]:
    return lambda cache_dir: corrupt_byte(cache_dir / rel, offset) and None


def write_manifest(text: bytes) -> Callable[[Path], None]:
    def apply(cache_dir: Path) -> None:
        path = cache_dir / "manifest.json"
        path.chmod(0o644)  # published read-only
        path.write_bytes(text)

    return apply


# (damage, validate_cache, the file the message names, the words that say what mismatched)
MALFORMED = {
    # a flipped byte in each file
    "manifest_flip_structure": (flip("manifest.json", 0), False, "manifest.json", ["invalid JSON"]),
    "manifest_flip_checksum": (
        edit_manifest(flip_hex_digit("index", "checksum")),
        False,
        "manifest.json",
        ["fingerprint mismatch"],
    ),
    "manifest_flip_count": (
        edit_manifest(bump("num_samples", by=1)),
        False,
        "manifest.json",
        ["fingerprint mismatch"],
    ),
    # A load reads neither the index entries nor metadata.arrow (see the tests after this table
    # for where each load reports them); full validation checks both at open.
    "metadata_flip_validated": (
        flip("metadata.arrow", 200),
        True,
        "metadata.arrow",
        ["checksum mismatch", "xxh3-64"],
    ),
    "index_flip_validated": (flip("index.bin", -1), True, "index.bin", ["checksum mismatch"]),
    "index_header_flip": (flip("index.bin", 0), False, "index.bin", ["bad index header"]),
    "shard_flip_validated": (flip_payload, True, "shards/000001.bin", ["checksum mismatch"]),
    "shard_header_flip": (
        flip("shards/000001.bin", 0),
        False,
        "shards/000001.bin",
        ["bad shard header"],
    ),
    # truncation of each file
    "manifest_truncated": (truncate("manifest.json"), False, "manifest.json", ["invalid JSON"]),
    "index_truncated": (
        truncate("index.bin"),
        False,
        "index.bin",
        ["size is", "the manifest says"],
    ),
    "metadata_truncated": (
        truncate("metadata.arrow"),
        False,
        "metadata.arrow",
        ["size is", "the manifest says"],
    ),
    "shard_truncated": (
        truncate("shards/000001.bin"),
        False,
        "shards/000001.bin",
        ["size is", "the manifest says"],
    ),
    # a missing file
    "manifest_missing": (remove("manifest.json"), False, "manifest.json", ["file is missing"]),
    "index_missing": (remove("index.bin"), False, "index.bin", ["file is missing"]),
    "metadata_missing": (remove("metadata.arrow"), False, "metadata.arrow", ["file is missing"]),
    "shard_missing": (remove("shards/000001.bin"), False, "shards/000001.bin", ["file is missing"]),
    "last_shard_missing_validated": (
        lambda d: sorted((d / "shards").iterdir())[-1].unlink(),
        True,
        "shards/",
        ["file is missing"],
    ),
    # bad JSON, unknown or wrong version, a foreign manifest
    "bad_json": (write_manifest(b"{not json"), False, "manifest.json", ["invalid JSON"]),
    "empty_manifest": (write_manifest(b""), False, "manifest.json", ["invalid JSON"]),
    "manifest_not_object": (
        write_manifest(b"[1, 2]"),
        False,
        "manifest.json",
        ["not a DatasetRT manifest"],
    ),
    "version_99": (
        edit_manifest(set_in("format_version", 99)),
        False,
        "manifest.json",
        ["unsupported format version 99", "reads versions 1, 2 and 3"],
    ),
    "version_string": (
        edit_manifest(set_in("format_version", "1")),
        False,
        "manifest.json",
        ["format_version is missing or not an integer"],
    ),
    "version_missing": (
        edit_manifest(lambda m: m.pop("format_version")),
        False,
        "manifest.json",
        ["format_version is missing"],
    ),
    "foreign_format": (
        edit_manifest(set_in("format", "parquet")),
        False,
        "manifest.json",
        ['not a DatasetRT manifest: format is Some("parquet")'],
    ),
    "unknown_field": (
        edit_manifest(set_in("surprise", 1)),
        False,
        "manifest.json",
        ["invalid manifest", "unknown field", "surprise"],
    ),
    "other_cache_name": (
        edit_manifest(set_in("name", "someone_else")),
        False,
        "manifest.json",
        ['manifest names cache "someone_else"'],
    ),
    # wrong sizes in the manifest
    "index_size_wrong": (
        edit_manifest(bump("index", "bytes")),
        False,
        "index.bin",
        [f"{NUM_SAMPLES} samples need {16 + 40 * NUM_SAMPLES}"],
    ),
    "metadata_size_wrong": (
        edit_manifest(bump("metadata", "bytes")),
        False,
        "metadata.arrow",
        ["size is", "the manifest says"],
    ),
    "shard_size_wrong": (
        edit_manifest(bump("shards", 1, "bytes")),
        False,
        "shards/000001.bin",
        ["size is", "the manifest says"],
    ),
}


@pytest.mark.parametrize("case", MALFORMED, ids=list(MALFORMED))
def test_damaged_cache_is_malformed_with_its_own_error(runtime, cache, case):
    damage, validate, file, words = MALFORMED[case]
    damage(cache)
    before = snapshot(cache)
    src = source()

    result = load(runtime, cache, validate=validate, src=src)

    assert isinstance(result, CacheSourcesDatasetError), result
    (outcome,) = result.results
    assert isinstance(outcome, CacheMalformed), outcome
    assert outcome.name == NAME
    assert outcome.path == cache
    assert f'cache "{NAME}" is malformed' in outcome.message
    assert file in outcome.message
    for word in words:
        assert word in outcome.message
    assert outcome.message in result.message  # the summary carries the reason
    # Never overwritten, and the source was not iterated to rebuild it.
    assert src.iterations == 0
    assert snapshot(cache) == before


def test_flipped_index_byte_without_validation_fails_when_that_record_is_read(runtime, cache):
    """The last byte of the index is in the last sample's entry (its record checksum): a load
    does not hash the index, and reading that sample refuses it under every verify policy, since
    every read checks the entry against its record's header."""
    last = NUM_SAMPLES - 1
    shard, record_offset, _ = record_payload_offset(cache, last)
    corrupt_byte(cache / "index.bin", -1)

    for verify in ("always", "once", "never"):
        result = runtime.from_cache_sources(
            source(),
            cache.parent,
            reader_config=ReaderConfig(shuffle=False, verify=verify),
            writer_config=WriterConfig(show_progress=False),
        )
        assert result.results == [CacheLoaded(NAME, cache, NUM_SAMPLES)]
        received = []
        with pytest.raises(CorruptRecordError) as info:
            for sample in result.dataset:
                received.append(sample.metadata["i"])
        message = str(info.value)
        assert str(shard) in message
        assert f"offset {record_offset}" in message
        assert f"sample {last}" in message
        assert "disagrees with index entry" in message
        assert "index.bin" in message
        assert received == list(range(last)), verify


def test_flipped_metadata_byte_without_validation_fails_at_the_first_use_of_metadata(
    runtime, cache
):
    """A load does not read metadata.arrow: payloads are served, and the first use of the
    metadata table (a sample's metadata, samples_metadata()) raises, naming the file."""
    corrupt_byte(cache / "metadata.arrow", 200)

    result = load(runtime, cache, validate=False)

    assert result.results == [CacheLoaded(NAME, cache, NUM_SAMPLES)]
    samples = list(result.dataset)
    assert [bytes(s.data)[:1] for s in samples] == [bytes([i]) for i in range(NUM_SAMPLES)]
    expected = f'cache "{NAME}" is malformed: {cache / "metadata.arrow"}: checksum mismatch'
    for use in (lambda: samples[0].metadata, result.dataset.samples_metadata):
        with pytest.raises(CacheMalformedError) as info:
            use()
        assert str(info.value).startswith(expected), info.value
    with pytest.raises(CacheMalformedError, match=r"metadata\.arrow: checksum mismatch"):
        samples[5].metadata  # noqa: B018 (every use, not only the first, raises)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_flipped_metadata_byte_without_validation_fails_when_a_loader_starts(
    runtime, cache, num_workers
):
    """The shared-memory loader sizes its slots from the metadata table and sends each sample's
    row: starting it is a use of the table."""
    from dataset_rt import DataLoader

    corrupt_byte(cache / "metadata.arrow", 200)
    result = load(runtime, cache, validate=False)
    assert result.results == [CacheLoaded(NAME, cache, NUM_SAMPLES)]

    loader = DataLoader(result.dataset, batch_size=4, num_workers=num_workers)
    with pytest.raises(CacheMalformedError, match=r"metadata\.arrow: checksum mismatch"):
        list(loader)


def test_size_mismatch_states_both_sizes(runtime, cache):
    shard = cache / "shards" / "000001.bin"
    size = shard.stat().st_size
    truncate_file(shard, 16)
    (outcome,) = load(runtime, cache, validate=False).results
    assert f"size is {size - 16} bytes, the manifest says {size}" in outcome.message


def test_good_copy_loads(runtime, cache):
    """The corpus starts from a cache that loads, fully validated."""
    result = load(runtime, cache, validate=True)
    assert result.results == [CacheLoaded(NAME, cache, NUM_SAMPLES)]
    assert len(list(result.dataset)) == NUM_SAMPLES


def test_flipped_shard_byte_without_validation_fails_when_that_record_is_read(runtime, cache):
    corrupted = 7
    shard, record_offset, _ = record_payload_offset(cache, corrupted)
    flip_payload(cache, corrupted)

    result = load(runtime, cache, validate=False)

    assert result.results == [CacheLoaded(NAME, cache, NUM_SAMPLES)]  # cheap load: shards unhashed
    received = []
    with pytest.raises(CorruptRecordError) as info:
        for sample in result.dataset:
            received.append(sample.metadata["i"])
    message = str(info.value)
    assert isinstance(info.value, DatasetRTError)
    assert f'cache "{NAME}"' in message
    assert str(shard) in message
    assert f"offset {record_offset}" in message
    assert f"sample {corrupted}" in message
    assert "checksum mismatch" in message
    # Every good record before the corrupt one reaches the loop; the corrupt one never does.
    assert received == list(range(corrupted))


def test_flipped_lz4_record_is_caught_before_decompression(runtime, tmp_path):
    src = make_source("packed", [(b"compress me " * 100, {}) for _ in range(3)])
    from dataset_rt import ShardCompression

    written = runtime.from_cache_sources(
        src,
        tmp_path,
        reader_config=ReaderConfig(shuffle=False),
        writer_config=WriterConfig(
            show_progress=False, shard_compression=ShardCompression(algo="lz4", ratio=0.5)
        ),
    )
    assert isinstance(written, CacheSourcesDatasetSuccess)
    flip_payload(tmp_path / "packed", 2)
    loaded = runtime.from_cache_sources(
        src,
        tmp_path,
        reader_config=ReaderConfig(shuffle=False),
        writer_config=WriterConfig(show_progress=False),
    )
    with pytest.raises(CorruptRecordError, match=r"sample 2: checksum mismatch"):
        list(loaded.dataset)


def test_malformed_cache_does_not_block_other_sources(runtime, cache):
    corrupt_byte(cache / "index.bin", 0)
    good = make_source("healthy", [(b"h", {})])

    result = runtime.from_cache_sources(
        [source(), good],
        cache.parent,
        reader_config=ReaderConfig(shuffle=False),
        writer_config=WriterConfig(show_progress=False),
    )

    assert isinstance(result, CacheSourcesDatasetSuccess)
    assert [type(r).__name__ for r in result.results] == ["CacheMalformed", "CacheWritten"]
    assert [bytes(s.data) for s in result.dataset] == [b"h"]


# --- re-signed forgeries -----------------------------------------------------------------------
# After the damage, the manifest is made to agree with the files again, the way a forger would:
# DatasetRT's own messages reveal the checksums and the fingerprint it computed. The forgery then
# reaches the structural checks behind the checksums.

FINGERPRINT = re.compile(r"fingerprint mismatch: computed ([0-9a-f]{32})")
CHECKSUM = re.compile(
    r"(index\.bin|metadata\.arrow|shards/(\d{6})\.bin): checksum mismatch: "
    r"computed xxh3-64 ([0-9a-f]{16})"
)


def resign(cache_dir: Path) -> None:
    path = cache_dir / "manifest.json"
    for _ in range(12):
        try:
            _native.verify_cache(str(cache_dir))
            return
        except CacheMalformedError as error:
            message = str(error)
        manifest = json.loads(path.read_text())
        if found := FINGERPRINT.search(message):
            manifest["fingerprint"] = found[1]
        elif found := CHECKSUM.search(message):
            file, shard, value = found.groups()
            if file == "index.bin":
                manifest["index"]["checksum"] = value
            elif file == "metadata.arrow":
                manifest["metadata"]["checksum"] = value
            else:
                manifest["shards"][int(shard)]["checksum"] = value
        else:
            return  # consistent: what is left is the structural damage
        path.write_text(json.dumps(manifest, indent=2))
    raise AssertionError("re-signing did not converge")


def first_block(path: Path) -> int:
    """The position of the footer's first record batch Block in an Arrow IPC file
    (offset i64, metaDataLength i32, padding, bodyLength i64)."""
    data = path.read_bytes()
    schema_at = data.index(b"\xff\xff\xff\xff", 8)
    (schema_len,) = struct.unpack_from("<i", data, schema_at + 4)
    batch_at = schema_at + 8 + schema_len
    assert data[batch_at : batch_at + 4] == b"\xff\xff\xff\xff"
    (batch_len,) = struct.unpack_from("<i", data, batch_at + 4)
    (footer_len,) = struct.unpack_from("<i", data, len(data) - 10)
    return data.index(struct.pack("<qi", batch_at, 8 + batch_len), len(data) - 10 - footer_len)


# (metaDataLength or None to keep it, bodyLength, what the message says)
FORGED_BLOCKS = {
    "zero_lengths": (0, 0, "record batch block 0 has a metadata length of 0"),
    "negative_body": (None, -1, "record batch block 0 has a body length of -1"),
    "body_of_1_gib": (None, 1 << 30, "lies past the end of its region"),
}


def forge_block(cache_dir: Path, case: str) -> str:
    meta_len, body_len, words = FORGED_BLOCKS[case]
    path = cache_dir / "metadata.arrow"
    at = first_block(path)
    with path.open("r+b") as f:
        if meta_len is not None:
            f.seek(at + 8)
            f.write(struct.pack("<i", meta_len))
        f.seek(at + 16)
        f.write(struct.pack("<q", body_len))
    resign(cache_dir)
    return words


@pytest.mark.parametrize("case", FORGED_BLOCKS)
def test_resigned_metadata_footer_is_malformed_not_a_panic(runtime, cache, case):
    words = forge_block(cache, case)

    result = load(runtime, cache, validate=True)

    assert isinstance(result, CacheSourcesDatasetError), result
    (outcome,) = result.results
    assert isinstance(outcome, CacheMalformed), outcome
    assert f"{cache / 'metadata.arrow'}: " in outcome.message
    assert words in outcome.message

    # A load without full validation refuses it at the first use of the metadata table.
    loaded = load(runtime, cache, validate=False)
    assert loaded.results == [CacheLoaded(NAME, cache, NUM_SAMPLES)]
    with pytest.raises(CacheMalformedError) as info:
        loaded.dataset.samples_metadata()
    assert f"{cache / 'metadata.arrow'}: " in str(info.value)
    assert words in str(info.value)


@pytest.mark.parametrize("command", ["inspect", "verify", "head"])
def test_cli_reports_a_resigned_metadata_footer_as_malformed(cache, capsys, command):
    forge_block(cache, "zero_lengths")

    assert main([command, str(cache)]) == EXIT_FAILED

    err = capsys.readouterr().err
    assert f'cache "{NAME}" is malformed' in err
    assert "record batch block 0 has a metadata length of 0" in err


def test_shard_truncated_before_its_first_view_is_a_corrupt_record(runtime, cache):
    """Every record is verified ahead (prefetch), then shard 1 is cut to its header before any of
    its payloads is made into a view: its first record is an error naming it, never an empty
    view. Batches of shard 0's records make that moment exact: the per-sample iterator builds
    the views of a whole read chunk at once, here the whole epoch."""
    result = runtime.from_cache_sources(
        source(),
        cache.parent,
        reader_config=ReaderConfig(shuffle=False, prefetch_size=64),
        writer_config=WriterConfig(show_progress=False),
    )
    shards = [record_payload_offset(cache, i)[:2] for i in range(NUM_SAMPLES)]
    victim = cache / "shards" / "000001.bin"
    first = next(i for i, (shard, _) in enumerate(shards) if shard == victim)
    size = victim.stat().st_size
    it = iter(result.dataset.iter_batches(first))
    received = [bytes(x) for x in next(it).data]  # the whole epoch is read and verified by now
    os.truncate(victim, 16)

    with pytest.raises(CorruptRecordError) as info:
        while True:
            received.extend(bytes(x) for x in next(it).data)
    message = str(info.value)
    assert f"shard {victim} at offset {shards[first][1]}, sample {first}:" in message
    assert f"the shard is 16 bytes now but was {size} bytes when the cache was opened" in message
    assert received == [source().samples[i].data for i in range(first)]
