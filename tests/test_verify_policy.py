"""`ReaderConfig(verify=...)`: what each policy catches, in process and through the loader."""

from __future__ import annotations

import contextlib
import os
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


# ---- "once" is one record per dataset, shared by the training process and its loaders ----

MEMFD = "memfd:dataset-rt-verified"


def sample_bytes(sample) -> tuple[int, bytes]:
    return sample.metadata["i"], bytes(sample.data)


def loader_payloads(dataset, num_workers: int) -> dict[int, bytes]:
    """One loader pass (a fresh loader, so a fresh producer process)."""
    with DataLoader(
        dataset, batch_size=2, num_workers=num_workers, transform=sample_bytes
    ) as loader:
        return dict(item for batch in loader for item in batch)


def verified_memfds(pid: int | str) -> int:
    """The descriptors process `pid` holds on a verified-samples memfd."""
    fds = Path(f"/proc/{pid}/fd")
    found = 0
    for fd in fds.iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed while listed
            found += MEMFD in os.readlink(fd)  # "/memfd:NAME (deleted)"
    return found


def test_a_loader_pass_marks_every_sample_in_the_training_process_dataset(runtime, cache):
    dataset = open_dataset(runtime, cache, "once")
    assert dataset.verified_samples == 0
    got = loader_payloads(dataset, num_workers=2)
    assert sorted(got) == list(range(NUM_SAMPLES))
    # The producer process verified them, into the dataset's own record.
    assert dataset.verified_samples == NUM_SAMPLES
    assert open_dataset(runtime, cache, "always").verified_samples is None
    assert open_dataset(runtime, cache, "never").verified_samples is None


@pytest.mark.parametrize("first_workers", [0, 2])
def test_a_later_loader_does_not_hash_again_under_once(runtime, cache, first_workers):
    once = open_dataset(runtime, cache, "once")
    sound = loader_payloads(once, num_workers=first_workers)
    flip_payload(cache, CORRUPTED)
    # A new loader's producer shares the record: the change after the first verified read is
    # not seen (the documented limit of "once"), whether the first pass had workers or not...
    for workers in (2, 0):
        changed = loader_payloads(once, num_workers=workers)
        assert [i for i in range(NUM_SAMPLES) if changed[i] != sound[i]] == [CORRUPTED]
    # ...nor by the dataset itself...
    assert payloads(once)[CORRUPTED] == changed[CORRUPTED]
    # ...while "always", and "once" on another dataset, hash it and refuse it.
    for policy in ("always", "once"):
        other = open_dataset(runtime, cache, policy)
        with pytest.raises(CorruptRecordError) as info:
            loader_payloads(other, num_workers=2)
        assert_names_the_record(info.value, cache, CORRUPTED)


def test_records_read_in_process_are_not_hashed_again_by_the_loader(runtime, cache):
    once = open_dataset(runtime, cache, "once")
    sound = payloads(once)
    assert once.verified_samples == NUM_SAMPLES
    flip_payload(cache, CORRUPTED)
    changed = loader_payloads(once, num_workers=2)
    assert [i for i in range(NUM_SAMPLES) if changed[i] != sound[i]] == [CORRUPTED]


@pytest.mark.parametrize("workers", [0, 2])
def test_once_through_loaders_catches_a_record_corrupted_before_its_first_read(
    runtime, cache, workers
):
    flip_payload(cache, CORRUPTED)
    once = open_dataset(runtime, cache, "once")
    for _ in range(2):  # never marked: every loader catches it
        with pytest.raises(CorruptRecordError) as info:
            loader_payloads(once, num_workers=workers)
        assert_names_the_record(info.value, cache, CORRUPTED)
    assert once.verified_samples is not None and once.verified_samples < NUM_SAMPLES
    with pytest.raises(CorruptRecordError):
        payloads(once)


def test_a_persistent_pipeline_shares_the_record_across_epochs(runtime, cache):
    once = open_dataset(runtime, cache, "once")
    with DataLoader(
        once, batch_size=2, num_workers=2, transform=sample_bytes, persistent_workers=True
    ) as loader:
        sound = dict(item for batch in loader for item in batch)
        assert once.verified_samples == NUM_SAMPLES
        flip_payload(cache, CORRUPTED)
        changed = dict(item for batch in loader for item in batch)
    assert [i for i in range(NUM_SAMPLES) if changed[i] != sound[i]] == [CORRUPTED]


def test_only_the_training_process_holds_the_memfd(runtime, cache):
    once = open_dataset(runtime, cache, "once")
    assert verified_memfds("self") >= 1
    before = verified_memfds("self")
    with DataLoader(once, batch_size=2, num_workers=2, transform=sample_bytes) as loader:
        it = iter(loader)
        next(it)  # every process has started; the producer has read its spec and attached
        pids = it.pids  # type: ignore[attr-defined]
        assert verified_memfds(pids["producer"]) == 0
        for worker in pids["workers"]:
            assert verified_memfds(worker) == 0, f"worker {worker} holds the memfd"
        for _ in it:
            pass
    assert verified_memfds("self") == before
    # A dataset under "always" keeps no record, so it has no memfd to share.
    open_dataset(runtime, cache, "always")
    assert verified_memfds("self") == before
