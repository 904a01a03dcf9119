"""`ReaderConfig(verify=...)`: what each policy catches, in process and through the loader."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_corrupt_corpus import NAME, NUM_SAMPLES, record_payload_offset, source

from dataset_rt import (
    CacheSourcesDatasetSuccess,
    ConfigError,
    CorruptRecordError,
    DataLoader,
    ReaderConfig,
    WriterConfig,
)
from dataset_rt.testing import corrupt_byte

CORRUPTED = 7


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    from dataset_rt import DatasetRuntime

    base = tmp_path_factory.mktemp("pristine")
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            source(), base, writer_config=WriterConfig(show_progress=False, shard_size_bytes=1024)
        )
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return base / NAME


@pytest.fixture
def cache(pristine, tmp_path) -> Path:
    dest = tmp_path / "base" / NAME
    shutil.copytree(pristine, dest)
    return dest


def open_dataset(runtime, cache_dir: Path, verify: str):
    result = runtime.open_caches(
        NAME, cache_dir.parent, reader_config=ReaderConfig(shuffle=False, verify=verify)
    )
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return result.dataset


def flip_payload(cache_dir: Path, sample: int) -> None:
    shard, _, payload = record_payload_offset(cache_dir, sample)
    corrupt_byte(shard, payload + 1)


def payloads(dataset) -> dict[int, bytes]:
    return {s.metadata["i"]: bytes(s.data) for s in dataset}


def assert_names_the_record(err: CorruptRecordError, cache_dir: Path, sample: int) -> None:
    shard, record_offset, _ = record_payload_offset(cache_dir, sample)
    message = str(err)
    assert str(shard) in message
    assert f"offset {record_offset}" in message
    assert f"sample {sample}" in message
    assert "checksum mismatch" in message


def test_verify_defaults_to_once_and_takes_only_the_three_policies():
    assert ReaderConfig().verify == "once"
    for policy in ("always", "once", "never"):
        assert ReaderConfig(verify=policy).verify == policy  # type: ignore[arg-type]
    for bad in ("Always", "sometimes", "", 1, None, True):
        with pytest.raises(ConfigError, match=r"invalid ReaderConfig\.verify: expected"):
            ReaderConfig(verify=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("policy", ["always", "once"])
def test_corruption_before_the_first_read_is_caught_on_every_pass(runtime, cache, policy):
    flip_payload(cache, CORRUPTED)
    dataset = open_dataset(runtime, cache, policy)
    for _ in range(2):  # under "once" the record failed, so it was never marked verified
        received = []
        with pytest.raises(CorruptRecordError) as info:
            for sample in dataset:
                received.append(sample.metadata["i"])
        assert_names_the_record(info.value, cache, CORRUPTED)
        assert received == list(range(CORRUPTED))


def test_always_catches_corruption_after_a_verified_read(runtime, cache):
    dataset = open_dataset(runtime, cache, "always")
    payloads(dataset)
    flip_payload(cache, CORRUPTED)
    with pytest.raises(CorruptRecordError) as info:
        payloads(dataset)
    assert_names_the_record(info.value, cache, CORRUPTED)


def test_once_does_not_rehash_a_record_it_verified(runtime, cache):
    once = open_dataset(runtime, cache, "once")
    sound = payloads(once)
    flip_payload(cache, CORRUPTED)
    # The documented limit: a change after the first verified read is not seen by this dataset...
    changed = payloads(once)
    assert [i for i in range(NUM_SAMPLES) if changed[i] != sound[i]] == [CORRUPTED]
    # ...while another dataset over the same files has its own bitmap and catches it.
    with pytest.raises(CorruptRecordError) as info:
        payloads(open_dataset(runtime, cache, "once"))
    assert_names_the_record(info.value, cache, CORRUPTED)


def test_never_reads_without_hashing_but_keeps_the_structural_checks(runtime, cache):
    flip_payload(cache, CORRUPTED)
    dataset = open_dataset(runtime, cache, "never")
    read = payloads(dataset)
    assert sorted(read) == list(range(NUM_SAMPLES))
    assert read[CORRUPTED] != bytes([CORRUPTED]) * (40 + 7 * CORRUPTED)
    # The record header's sample number (bytes 24..32) no longer agrees with the index.
    shard, record_offset, _ = record_payload_offset(cache, 3)
    corrupt_byte(shard, record_offset + 24)
    with pytest.raises(CorruptRecordError, match=r"sample 3: record header .* disagrees"):
        payloads(dataset)


@pytest.mark.parametrize("policy", ["always", "once"])
def test_the_loader_producer_reads_under_the_dataset_policy(runtime, cache, policy):
    flip_payload(cache, CORRUPTED)
    dataset = open_dataset(runtime, cache, policy)
    expected = rf"sample {CORRUPTED}: checksum mismatch"
    with (
        DataLoader(dataset, batch_size=2, num_workers=0) as loader,
        pytest.raises(CorruptRecordError, match=expected),
    ):
        for _ in loader:
            pass


def test_the_loader_producer_skips_the_hash_under_never(runtime, cache):
    flip_payload(cache, CORRUPTED)
    dataset = open_dataset(runtime, cache, "never")
    with DataLoader(dataset, batch_size=2, num_workers=0) as loader:
        got = {s.metadata["i"]: bytes(s.data) for batch in loader for s in batch}
    assert sorted(got) == list(range(NUM_SAMPLES))
    assert got[CORRUPTED] != bytes([CORRUPTED]) * (40 + 7 * CORRUPTED)
