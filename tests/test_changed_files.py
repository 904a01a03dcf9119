"""Cache files changed under an open dataset: a shard truncated after the open (before a pass,
or after its records were read ahead) is a ``CorruptRecordError`` naming the shard and the
sample, in process and under ``DataLoader`` with and without workers, never SIGBUS or zeros; an
``index.bin`` or ``metadata.arrow`` renamed over the old one is refused by a loader, never read
as the old one's entries."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from dataset_rt import (
    CacheMalformedError,
    CorruptRecordError,
    DataLoader,
    DatasetRuntime,
    ReaderConfig,
    WriterConfig,
)
from dataset_rt.testing import make_source

SAMPLES = 200
SIZE = 3 * 1024


def payload(i: int) -> bytes:
    return bytes((i * 7 + k) % 251 | 1 for k in range(SIZE))


@pytest.fixture
def runtime():
    rt = DatasetRuntime(num_workers=2)
    yield rt
    rt.close()


def write(runtime: DatasetRuntime, base: Path, verify: str = "once"):
    """200 samples of 3 KiB in shards of 64 KiB, read in storage order."""
    result = runtime.from_cache_sources(
        make_source("c", [(payload(i), {"i": i}) for i in range(SAMPLES)]),
        base,
        reader_config=ReaderConfig(shuffle=False, verify=verify),
        writer_config=WriterConfig(show_progress=False, shard_size_bytes=64 * 1024),
    )
    assert result.dataset is not None
    return result.dataset


def truncate(path: Path, size: int) -> None:
    os.chmod(path, 0o644)
    os.truncate(path, size)


def shard_path(base: Path, shard: int) -> Path:
    return base / "c" / "shards" / f"{shard:06d}.bin"


def records_in_shard_0(base: Path) -> int:
    """How many records shard 0 holds, from the manifest."""
    import json

    manifest = json.loads((base / "c" / "manifest.json").read_text())
    return int(manifest["shards"][0]["records"])


def check_error(error: BaseException, base: Path, sample: int) -> None:
    text = str(error)
    assert str(shard_path(base, 1)) in text, text
    assert f"sample {sample}" in text, text
    assert "truncated" in text, text


@pytest.mark.parametrize("verify", ["always", "once", "never"])
def test_a_shard_truncated_before_the_pass_is_an_error_in_process(runtime, tmp_path, verify):
    dataset = write(runtime, tmp_path, verify)
    first = records_in_shard_0(tmp_path)
    assert [bytes(s.data) for s in dataset] == [payload(i) for i in range(SAMPLES)]
    truncate(shard_path(tmp_path, 1), 16)
    got = []
    with pytest.raises(CorruptRecordError) as error:
        for s in dataset:
            assert bytes(s.data) == payload(s.metadata["i"])
            got.append(s.metadata["i"])
    assert got == list(range(first))
    check_error(error.value, tmp_path, first)


@pytest.mark.parametrize("verify", ["always", "once", "never"])
def test_a_shard_truncated_after_the_read_ahead_is_an_error_in_process(runtime, tmp_path, verify):
    dataset = write(runtime, tmp_path, verify)
    first = records_in_shard_0(tmp_path)
    assert first > 17
    it = iter(dataset)
    got = []
    # Past the first chunk: the rest of the pass is read ahead, shard 1's records included.
    for _ in range(18):
        s = next(it)
        assert bytes(s.data) == payload(s.metadata["i"])
        got.append(s.metadata["i"])
    time.sleep(0.2)
    truncate(shard_path(tmp_path, 1), 16)
    with pytest.raises(CorruptRecordError) as error:
        for s in it:
            assert bytes(s.data) == payload(s.metadata["i"])
            got.append(s.metadata["i"])
    assert got == list(range(first))
    check_error(error.value, tmp_path, first)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("verify", ["always", "once", "never"])
def test_a_shard_truncated_before_a_loader_pass_is_an_error(runtime, tmp_path, verify, num_workers):
    dataset = write(runtime, tmp_path, verify)
    first = records_in_shard_0(tmp_path)
    assert sum(1 for _ in dataset) == SAMPLES
    truncate(shard_path(tmp_path, 1), 16)
    got = []
    with (
        DataLoader(dataset, 4, num_workers=num_workers) as loader,
        pytest.raises(CorruptRecordError) as error,
    ):
        for batch in loader:
            for s in batch:
                assert bytes(s.data) == payload(s.metadata["i"])
                got.append(s.metadata["i"])
    assert got == list(range(first - first % 4))
    text = str(error.value)
    assert str(shard_path(tmp_path, 1)) in text, text
    assert "truncated" in text, text


@pytest.mark.parametrize("size", [0, 17])
@pytest.mark.parametrize("reader", ["iter", "iter_batches", "loader 0", "loader 2"])
def test_an_index_truncated_before_a_pass_is_an_error_naming_it(runtime, tmp_path, size, reader):
    dataset = write(runtime, tmp_path)
    assert sum(1 for _ in dataset) == SAMPLES
    index = tmp_path / "c" / "index.bin"
    truncate(index, size)
    with pytest.raises((CacheMalformedError, CorruptRecordError)) as error:
        if reader == "iter":
            next(iter(dataset))
        elif reader == "iter_batches":
            next(iter(dataset.iter_batches(4)))
        else:
            with DataLoader(dataset, 4, num_workers=int(reader[-1])) as loader:
                next(iter(loader))
    assert str(index) in str(error.value) and "truncated" in str(error.value), error.value


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("verify", ["always", "once", "never"])
def test_a_shard_truncated_after_a_loader_read_ahead_is_an_error(
    runtime, tmp_path, verify, num_workers
):
    """The producer (and the workers) read shard 1's records ahead, the training process may
    have mapped it for a result received early; the shard is then truncated. Its batch is a
    ``CorruptRecordError`` at its turn, the batches before it are delivered whole: never zeros,
    SIGBUS, or an error ahead of them."""
    dataset = write(runtime, tmp_path, verify)
    first = records_in_shard_0(tmp_path)
    got = []
    with (
        DataLoader(dataset, 4, num_workers=num_workers, prefetch_factor=16) as loader,
        pytest.raises(CorruptRecordError) as error,
    ):
        for k, batch in enumerate(loader):
            for s in batch:
                assert bytes(s.data) == payload(s.metadata["i"])
                got.append(s.metadata["i"])
            if k == 0:
                time.sleep(0.5)  # the pipeline reads ahead, past the start of shard 1
                truncate(shard_path(tmp_path, 1), 16)
    assert got == list(range(first - first % 4))
    check_error(error.value, tmp_path, first)


@pytest.mark.parametrize("name", ["index.bin", "metadata.arrow"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_loader_refuses_an_index_or_metadata_file_renamed_over(
    runtime, tmp_path, name, num_workers
):
    dataset = write(runtime, tmp_path)
    assert sum(1 for _ in dataset) == SAMPLES  # every record verified: "once" trusts them now
    path = tmp_path / "c" / name
    data = bytearray(path.read_bytes())
    if name == "index.bin":
        # Entry 5 becomes a copy of entry 9: a loader that read this index would serve sample
        # 9's bytes as sample 5.
        entry = (len(data) - 16) // SAMPLES
        data[16 + entry * 5 : 16 + entry * 6] = data[16 + entry * 9 : 16 + entry * 10]
    new = path.with_suffix(".new")
    new.write_bytes(data)
    os.replace(new, path)
    # The dataset itself keeps reading the files it opened.
    assert [bytes(s.data) for s in dataset] == [payload(i) for i in range(SAMPLES)]
    with (
        DataLoader(dataset, 4, num_workers=num_workers) as loader,
        pytest.raises(CacheMalformedError) as error,
    ):
        for batch in loader:
            for s in batch:
                assert bytes(s.data) == payload(s.metadata["i"])
    text = str(error.value)
    assert str(path) in text and "replaced since the dataset was opened" in text, text
