"""Records stored uncompressed travel through the loader's ring as references to their shard
file: the producer copies nothing, and every consumer serves a read-only view of its own map of
the shard (LZ4 records still travel decompressed in the slot)."""

from __future__ import annotations

import os
import shutil

import pytest
from loader_helpers import (  # noqa: F401
    load,
    load_lz4,
    no_leaks,
    own_segments,
    payload,
    payload_lz4,
    views_a_shard_map,
)

from dataset_rt import (
    CacheMalformedError,
    DatasetRTError,
    DatasetRuntime,
    WorkerError,
    WriterConfig,
)
from dataset_rt._loader import DataLoader, slots
from dataset_rt.testing import make_source

SIZE = 16 * 1024
N = 40


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("refs-cache")
    load(path, N, size=SIZE)
    return path


def mapped_file(address: int) -> str:
    """The file (or pseudo-file) this process maps at `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5] if len(fields) > 5 else ""
    raise AssertionError(f"{address:#x} is not mapped")


def address_of(view: memoryview) -> int:
    import numpy as np

    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def where_is(sample):
    """What a worker's transform sees as ``sample.data``: its type, what it views, the file
    mapped under it (read in the worker), read-only or not, and whether the bytes are right."""
    data = sample.data
    i = sample.metadata["i"]
    return (
        type(data).__name__,
        type(data.obj).__name__,
        mapped_file(address_of(data)),
        data.readonly,
        i,
        bytes(data) == payload(i, SIZE),
    )


def test_views_at_num_workers_0_are_slices_of_the_shard_map(base, monkeypatch):
    dataset = load(base, N, size=SIZE)
    shard = str(base / "loader" / "shards" / "000000.bin")
    expected = [(s.metadata["i"], bytes(s.data)) for s in dataset]
    dataset.set_epoch(0)
    slot_maps = []
    init = slots.SlotMap.__init__

    def recording(self, seq, slot_map):
        slot_maps.append(seq)
        init(self, seq, slot_map)

    monkeypatch.setattr(slots.SlotMap, "__init__", recording)
    kept = []
    with DataLoader(dataset, batch_size=6, num_workers=0) as loader:
        for batch in loader:
            for s in batch:
                view = s.data
                assert isinstance(view, memoryview) and view.readonly
                # A view of a map of the shard file, not of the ring.
                assert views_a_shard_map(view)
                assert mapped_file(address_of(view)) == shard
                kept.append((s.metadata["i"], view))
    # No slot was mapped: every payload was a reference, its slot handed back at once.
    assert slot_maps == []
    assert [(i, bytes(v)) for i, v in kept] == expected
    # Kept views are views of the shard map: valid after the loader closed, no copy made.
    assert all(bytes(v) == payload(i, SIZE) for i, v in kept)
    assert own_segments() == []


@pytest.mark.parametrize("persistent", [False, True])
def test_worker_transforms_receive_views_of_the_shard_map(base, persistent):
    dataset = load(base, N, size=SIZE)
    shard = str(base / "loader" / "shards" / "000000.bin")
    with DataLoader(
        dataset,
        batch_size=5,
        num_workers=2,
        transform=where_is,
        persistent_workers=persistent,
    ) as loader:
        for epoch in range(2):
            dataset.set_epoch(epoch)
            expected = [s.metadata["i"] for s in dataset]
            got = [x for b in loader for x in b]
            assert [i for *_, i, _ in got] == expected
            assert {(k, o, f, ro, ok) for k, o, f, ro, _, ok in got} == {
                ("memoryview", "ndarray", shard, True, True)
            }


@pytest.mark.parametrize("num_workers", [0, 2])
def test_lz4_records_still_travel_in_the_slot(tmp_path, num_workers):
    size = 8192
    dataset = load_lz4(tmp_path, 20, size=size)
    assert sum(f.stat().st_size for f in (tmp_path / "loader" / "shards").iterdir()) < 20 * size
    dataset.set_epoch(0)
    expected = [s.metadata["i"] for s in dataset]
    with DataLoader(
        dataset, batch_size=3, num_workers=num_workers, transform=lz4_where_is
    ) as loader:
        got = [x for b in loader for x in b]
    assert [i for i, *_ in got] == expected
    assert all(ok and mapped.startswith("/dev/shm/dataset-rt-") for _, ok, mapped in got), got


def lz4_where_is(sample):
    i = sample.metadata["i"]
    return i, bytes(sample.data) == payload_lz4(i, 8192), mapped_file(address_of(sample.data))


KEPT: list = []


def keep_a_view(sample):
    import numpy as np

    # numpy.frombuffer exports the slot's view past the batch: kept in a module global.
    KEPT.append(np.frombuffer(sample.data, np.uint8)[2:])
    return sample.metadata["i"]


def test_a_view_of_a_slot_kept_by_a_worker_transform_is_a_worker_error_naming_it(tmp_path):
    dataset = load_lz4(tmp_path, 20, size=8192)
    loader = DataLoader(dataset, batch_size=3, num_workers=2, transform=keep_a_view)
    with loader, pytest.raises(WorkerError, match="still exported") as info:
        list(loader)
    assert "batch 0 is still exported" in str(info.value)
    assert "copy the bytes" in str(info.value)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_shard_replaced_under_the_loader_is_an_error(tmp_path, num_workers):
    dataset = load(tmp_path, 12, size=1024)
    shard = tmp_path / "loader" / "shards" / "000000.bin"
    # The same bytes in a new file: only the file's identity tells it apart.
    shutil.copyfile(shard, tmp_path / "copy.bin")
    os.replace(tmp_path / "copy.bin", shard)
    with (
        DataLoader(dataset, batch_size=4, num_workers=num_workers) as loader,
        pytest.raises(DatasetRTError, match="replaced since the dataset was opened") as caught,
    ):
        next(iter(loader))
    assert str(shard) in str(caught.value)
    assert own_segments() == []


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cache_written_again_under_the_loader_is_a_malformed_cache(tmp_path, num_workers):
    """Republished under the same name with other samples: the next pass refuses it as it
    refuses a replaced shard, `CacheMalformedError` naming the manifest, never another cache's
    bytes. (A persistent pipeline keeps reading the files it holds open, as in-process reads
    do; a shard it had not opened yet is refused, as the next test shows.)"""
    dataset = load(tmp_path, 12, size=1024)
    cache = tmp_path / "loader"
    with DataLoader(dataset, batch_size=4, num_workers=num_workers) as loader:
        assert sum(len(b) for b in loader) == 12
        shutil.rmtree(cache)
        other = make_source("loader", [(b"other %d" % i, {"i": i}) for i in range(12)])
        DatasetRuntime(num_workers=1).from_cache_sources(
            other, tmp_path, writer_config=WriterConfig(show_progress=False)
        )
        with pytest.raises(CacheMalformedError) as caught:
            list(loader)
    message = str(caught.value)
    assert str(cache / "manifest.json") in message
    assert "replaced since the dataset was opened" in message
    assert own_segments() == []


def test_a_shard_replaced_between_persistent_passes_is_the_error_itself(tmp_path):
    """A persistent worker opens a shard when a batch first needs it: one replaced since the
    dataset was opened is refused there, and the training loop gets that `CacheMalformedError`
    as it is, at the batch's turn, not a `LoaderError` wrapping the worker's traceback. About 64
    shards of one record each, 64 samples per worker and pass: no worker has opened them all
    in the first pass."""
    samples = [(bytes([i]) * 1024, {"i": i}) for i in range(128)]
    result = DatasetRuntime(num_workers=1).from_cache_sources(
        make_source("many", samples),
        tmp_path,
        writer_config=WriterConfig(show_progress=False, shard_size_bytes=2048),
    )
    shards = sorted((tmp_path / "many" / "shards").iterdir())
    assert len(shards) >= 60
    with DataLoader(result.dataset, batch_size=2, num_workers=2, persistent_workers=True) as loader:
        assert sum(len(b) for b in loader) == 128
        for shard in shards:  # the same bytes in new files
            shutil.copyfile(shard, tmp_path / "copy.bin")
            os.replace(tmp_path / "copy.bin", shard)
        with pytest.raises(CacheMalformedError, match="replaced since the dataset was opened"):
            for batch in loader:
                assert all(bytes(s.data) == samples[s.metadata["i"]][0] for s in batch)
    assert own_segments() == []


def used_result_memory() -> int:
    """Bytes of loader result memory that hold data (pages a worker wrote), over this
    process's descriptors of it."""
    from loader_helpers import result_fds

    return sum(os.stat(f"/proc/self/fd/{e.split()[0]}").st_blocks * 512 for e in result_fds())


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_raw_records_leave_workers_as_references(base, start_method):
    dataset = load(base, N, size=SIZE)
    shard = str(base / "loader" / "shards" / "000000.bin")
    dataset.set_epoch(0)
    expected = [(s.metadata["i"], bytes(s.data)) for s in dataset]
    with DataLoader(
        dataset, batch_size=6, num_workers=2, multiprocessing_context=start_method
    ) as loader:
        samples = [s for batch in loader for s in batch]
        # Not a byte of result memory was written: every sample came as a reference.
        assert used_result_memory() == 0
    assert len(samples) == N
    assert [(s.metadata["i"], bytes(s.data)) for s in samples] == expected
    for s in samples:
        assert isinstance(s.data, memoryview) and s.data.readonly
        assert views_a_shard_map(s.data)
        assert mapped_file(address_of(s.data)) == shard
    assert own_segments() == []


def tail(sample):
    return sample.data[3:]


def copied(sample):
    return bytes(sample.data[3:])


@pytest.mark.parametrize(("transform", "by_reference"), [(tail, True), (copied, False)])
def test_a_slice_of_a_record_travels_by_reference_and_a_copy_does_not(
    base, transform, by_reference
):
    from loader_helpers import in_result_memory

    dataset = load(base, N, size=SIZE)
    shard = str(base / "loader" / "shards" / "000000.bin")
    dataset.set_epoch(0)
    expected = [bytes(s.data[3:]) for s in dataset]
    with DataLoader(dataset, batch_size=4, num_workers=2, transform=transform) as loader:
        items = [x for batch in loader for x in batch]
        assert [bytes(x) for x in items] == expected
        for x in items:
            assert isinstance(x, memoryview) and x.readonly
            if by_reference:
                assert mapped_file(address_of(x)) == shard
            else:
                assert in_result_memory(address_of(x), len(x))


def mixed(sample):
    import numpy as np

    i = sample.metadata["i"]
    return {
        "i": i,
        "view": sample.data[:100],
        "array": np.frombuffer(sample.data, np.uint8)[8 : 8 + 4 * 16].view(np.uint32).reshape(4, 4),
        "copy": np.frombuffer(sample.data, np.uint8)[:64].copy(),
        "pair": (sample, bytes(sample.data[:5])),
    }


def test_nested_results_mix_references_and_result_memory(base):
    import numpy as np
    from loader_helpers import in_result_memory

    dataset = load(base, N, size=SIZE)
    shard = str(base / "loader" / "shards" / "000000.bin")
    with DataLoader(dataset, batch_size=5, num_workers=2, transform=mixed) as loader:
        items = [x for batch in loader for x in batch]
    assert len(items) == N
    for x in items:
        data = payload(x["i"], SIZE)
        assert bytes(x["view"]) == data[:100] and mapped_file(address_of(x["view"])) == shard
        array = x["array"]
        assert array.shape == (4, 4) and array.dtype == np.uint32
        assert array.tobytes() == data[8:72]
        # A view of a read-only shard map comes back read-only.
        assert not array.flags.writeable
        assert mapped_file(array.__array_interface__["data"][0]) == shard
        with pytest.raises(ValueError, match="read-only"):
            array[0, 0] = 1
        assert x["copy"].tobytes() == data[:64] and x["copy"].flags.writeable
        assert in_result_memory(x["copy"].__array_interface__["data"][0], 64)
        sample, head = x["pair"]
        assert sample.metadata["i"] == x["i"] and bytes(sample.data) == data
        assert mapped_file(address_of(sample.data)) == shard
        assert bytes(head) == data[:5]
