"""Worker results through shared memory: zero copies in the training process, nesting, the
lifetime of what the loop holds, and the documented fallback when the memory is full."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import mmap
import os
import sys
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
from loader_helpers import (  # noqa: F401
    in_result_memory,
    load,
    load_lz4,
    no_leaks,
    payload,
    result_fds,
    result_mappings,
)

from dataset_rt._loader import DataLoader, results
from dataset_rt._native import CachedSample, ConfigError, WorkerError

N = 60


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("results-cache")
    load(path, N)
    return path


@pytest.fixture
def dataset(base):
    return load(base, N)


def epoch0(dataset) -> list[tuple[int, bytes]]:
    dataset.set_epoch(0)
    return [(s.metadata["i"], bytes(s.data)) for s in dataset]


def as_array(sample):
    return np.frombuffer(sample.data, np.uint8).copy()


def address(obj) -> int:
    if isinstance(obj, np.ndarray):
        return obj.__array_interface__["data"][0]
    if isinstance(obj, memoryview):
        return np.frombuffer(obj, np.uint8).__array_interface__["data"][0]
    return obj.data_ptr()  # a tensor


def base_chain_ends_in_a_map(array: np.ndarray) -> bool:
    obj = array
    while isinstance(obj, np.ndarray):
        obj = obj.base
    return isinstance(obj, memoryview) and isinstance(obj.obj, mmap.mmap)


def fixed(sample):
    """Every sample as 8 bytes: its index, then 7 bytes of its payload, so batches stack."""
    head = payload(sample.metadata["i"])[:7].ljust(7, b"\0")
    assert bytes(sample.data).startswith(head.rstrip(b"\0"))
    return np.frombuffer(bytes([sample.metadata["i"] % 256]) + head, np.uint8).copy()


def test_arrays_arrive_as_views_of_result_memory(dataset):
    ids = [i for i, _ in epoch0(dataset)]
    with DataLoader(
        dataset, batch_size=6, num_workers=2, transform=fixed, collate_fn=np.stack
    ) as loader:
        batches = list(loader)
    got = np.concatenate(batches)
    assert got[:, 0].tolist() == [i % 256 for i in ids]
    for batch in batches:
        assert batch.shape == (6, 8) and batch.dtype == np.uint8
        assert batch.flags.writeable
        assert base_chain_ends_in_a_map(batch)
        assert in_result_memory(address(batch), batch.nbytes)


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_cached_samples_of_lz4_records_arrive_with_data_in_result_memory(tmp_path, start_method):
    # LZ4 records travel decompressed in the slot, so their bytes go through result memory
    # (records stored uncompressed arrive as views of the shard files: test_loader_refs.py).
    dataset = load_lz4(tmp_path, 30, size=2048)
    expected = epoch0(dataset)
    loader = DataLoader(dataset, batch_size=7, num_workers=2, multiprocessing_context=start_method)
    with loader:
        samples = [s for batch in loader for s in batch]
    assert all(type(s) is CachedSample for s in samples)
    assert [(s.metadata["i"], bytes(s.data)) for s in samples] == expected
    for s in samples:
        assert isinstance(s.data, memoryview) and s.data.readonly
        assert in_result_memory(address(s.data), len(s.data))


@pytest.mark.torch
def test_nested_results_keep_their_structure_and_leaves_view_result_memory(dataset):
    torch = pytest.importorskip("torch")

    def nested(sample):
        i = sample.metadata["i"]
        return (
            as_array(sample),
            i,
            {"t": torch.full((3, 5), i, dtype=torch.int64), "name": f"s{i}"},
            [bytearray(sample.data), memoryview(b"x" * (i + 1)), b""],
        )

    expected = epoch0(dataset)
    with DataLoader(dataset, batch_size=4, num_workers=2, transform=nested) as loader:
        items = [item for batch in loader for item in batch]
    assert len(items) == len(expected)
    for (array, i, d, buffers), (j, data) in zip(items, expected, strict=True):
        assert i == j and d["name"] == f"s{j}"
        assert array.tobytes() == data and in_result_memory(address(array), array.nbytes)
        assert torch.equal(d["t"], torch.full((3, 5), j, dtype=torch.int64))
        assert in_result_memory(address(d["t"]), 15 * 8)
        assert bytes(buffers[0]) == data and bytes(buffers[1]) == b"x" * (j + 1)
        assert in_result_memory(address(buffers[0]), len(data))
        assert buffers[2] == b""


@pytest.fixture(scope="module")
def thousand_batches(tmp_path_factory):
    return load(tmp_path_factory.mktemp("thousand"), 2000)


@pytest.mark.parametrize("pages", [None, 64])
def test_held_batches_are_never_overwritten(thousand_batches, pages):
    """Every batch of a 1,000-batch epoch kept to the end, then checked: with the default
    memory, and with 32 pages per worker, where the memory runs out and the rest is pickled."""
    dataset = thousand_batches
    ids = [i for i, _ in epoch0(dataset)]
    loader = DataLoader(
        dataset,
        batch_size=2,
        num_workers=2,
        transform=fixed,
        collate_fn=np.stack,
        result_bytes=None if pages is None else pages * mmap.PAGESIZE,
    )
    with loader, warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        batches = list(loader)
    assert len(batches) == 1000
    rows = np.concatenate(batches)
    assert rows.tolist() == [fixed(_Sample(i)).tolist() for i in ids]
    inside = sum(in_result_memory(address(b), b.nbytes) for b in batches)
    if pages is None:
        assert inside == 1000 and warned == []
    else:
        assert inside == pages  # one page each, never reused while held
        assert [str(w.message)[:36] for w in warned] == ["the loader's result memory is full ("]


class _Sample:
    def __init__(self, i: int) -> None:
        self.metadata = {"i": i}
        self.data = payload(i)


def test_released_memory_is_reused_and_held_memory_is_not(dataset):
    # Eight pages per worker, one per batch, 30 batches each: enough only if the loop's frees
    # reach the workers (a full region would warn, and warnings fail the suite).
    loader = DataLoader(
        dataset, batch_size=1, num_workers=2, transform=fixed, result_bytes=16 * mmap.PAGESIZE
    )
    with loader:
        seen = 0
        for batch in loader:
            assert in_result_memory(address(batch[0]), 8)
            seen += 1
            del batch
        assert seen == N
    gc.collect()
    assert result_mappings() == []


def test_free_pages_beyond_two_batches_go_back_and_read_as_the_next_batch():
    batch = 64 * 1024  # a batch as large as the smallest range a batch reserves
    owner = results.RegionOwner(32 * batch)
    fd, capacity, frees, warm = owner.worker_args()
    writer = results.RegionWriter(results._SharedFd(os.dup(fd.fd)), capacity, frees, warm)
    reader = np.frombuffer(owner._map, np.uint8)  # the training process's map

    def written() -> int:  # bytes of the file that hold pages (tmpfs counts real pages)
        return os.fstat(owner.fd).st_blocks * 512

    def write(value: int) -> tuple[int, int]:
        writer.begin()
        got = writer.alloc(batch)
        assert got is not None
        got[2][:] = bytes([value]) * batch
        return writer.arena.finish()[0]

    try:
        held = [write(k + 1) for k in range(8)]  # the loop holds eight batches
        assert written() == 8 * batch == writer.arena.resident
        owner.pending.extend(offset for offset, _ in held)  # ... then lets them all go
        owner.flush()
        writer.begin()
        # Two batches' worth stay in the file for the next ones, the rest left it: those pages
        # read as zeros in the training process's map (reading them puts zeroed pages back),
        # the kept ones as they were written.
        assert written() == 2 * batch == writer.arena.resident
        firsts = [int(reader[offset]) for offset, _ in held]
        assert firsts == [1, 2] + [0] * 6
        assert all(not reader[o : o + n].any() for o, n in held[2:])
        # The next batches land on kept and given-back pages alike, and read as themselves.
        again = [write(100 + k) for k in range(5)]
        for k, (offset, n) in enumerate(again):
            assert n == batch and (reader[offset : offset + n] == 100 + k).all()
        assert sorted(o for o, _ in again) == sorted(o for o, _ in held[:5])
    finally:
        del reader
        gc.collect()
        owner.close()


def test_memory_given_back_after_a_kept_epoch_holds_the_next_epochs_batches(dataset):
    ids = [i for i, _ in epoch0(dataset)]
    loader = DataLoader(
        dataset,
        batch_size=1,
        num_workers=2,
        transform=fixed,
        collate_fn=np.stack,
        persistent_workers=True,
    )
    with loader:
        kept = list(loader)  # 60 batches of a page each, held: 30 pages per worker
        assert np.concatenate(kept).tolist() == [fixed(_Sample(i)).tolist() for i in ids]
        fds = [r.fd for r in loader._iterator._regions if r is not None]
        held_pages = sum(os.fstat(fd).st_blocks for fd in fds) * 512 // mmap.PAGESIZE
        assert held_pages == 60
        del kept
        gc.collect()
        # The next epoch, one batch at a time: the frees reach the workers, which keep 16 warm
        # pages each (the smallest range) and give the rest back; every batch reads right.
        rows = []
        for batch in loader:
            assert fixed(_Sample(int(batch[0][0]))).tolist() == batch[0].tolist()
            rows.append(int(batch[0][0]))
            del batch
        assert sorted(rows) == sorted(ids)
        pages = sum(os.fstat(fd).st_blocks for fd in fds) * 512 // mmap.PAGESIZE
        assert pages <= 2 * 16 + 4, pages


def test_a_full_region_falls_back_to_pickling_with_one_warning(dataset):
    # One worker: which worker takes which batch is up to timing, which worker's memory
    # fills first with it.
    loader = DataLoader(
        dataset, batch_size=1, num_workers=1, transform=fixed, result_bytes=2 * mmap.PAGESIZE
    )
    ids = [i for i, _ in epoch0(dataset)]
    with pytest.warns(RuntimeWarning, match=r"result memory is full") as warned:
        batches = list(loader)
    assert len([w for w in warned if issubclass(w.category, RuntimeWarning)]) == 1
    assert warned[0].filename == __file__  # points at the loop, not at the loader
    assert [b[0].tolist() for b in batches] == [fixed(_Sample(i)).tolist() for i in ids]
    inside = [in_result_memory(address(b[0]), 8) for b in batches]
    # Two pages, held to the end: the first two batches; the rest pickled.
    assert inside == [True, True] + [False] * (N - 2)
    # The pass is over; what is held keeps the worker's mapping (and its descriptor) alive.
    assert len(result_fds()) == len(result_mappings()) == 1
    del batches
    gc.collect()
    assert result_fds() == [] and result_mappings() == []


def test_a_result_larger_than_a_workers_share_is_pickled(dataset):
    expected = epoch0(dataset)

    def big(sample):
        return np.full(3 * mmap.PAGESIZE, sample.metadata["i"] % 256, np.uint8)

    loader = DataLoader(
        dataset, batch_size=1, num_workers=1, transform=big, result_bytes=2 * mmap.PAGESIZE
    )
    with loader, pytest.warns(RuntimeWarning, match=r"8192 bytes per worker"):
        batches = list(loader)
    assert [int(b[0][0]) for b in batches] == [i % 256 for i, _ in expected]
    assert all(b[0].shape == (3 * mmap.PAGESIZE,) for b in batches)
    assert not any(in_result_memory(address(b[0])) for b in batches)


def test_result_bytes_zero_pickles_everything(dataset):
    expected = epoch0(dataset)
    with DataLoader(dataset, batch_size=5, num_workers=1, result_bytes=0) as loader:
        samples = [s for batch in loader for s in batch]
    assert all(isinstance(s.data, bytes) for s in samples)
    assert [(s.metadata["i"], s.data) for s in samples] == expected


@pytest.mark.parametrize("value", [-1, 1.5, True, "1"])
def test_bad_result_bytes_is_refused(dataset, value):
    with pytest.raises(ConfigError, match=r"DataLoader\.result_bytes"):
        DataLoader(dataset, num_workers=1, result_bytes=value)


def new_image(sample):
    """What a decoding transform does: a new 150,528-byte array per sample."""
    return np.full(150_528, sample.metadata["i"] % 256, np.uint8)


def faults_so_far(images):
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("user_setting", [None, "MALLOC_MMAP_THRESHOLD_"])
def test_a_worker_reuses_its_freed_heap_unless_the_user_set_glibcs(
    dataset, monkeypatch, user_setting
):
    if user_setting is not None:
        # glibc's default threshold, set by hand: arrays of 150,528 bytes get mappings of their
        # own, faulted in anew each time. glibc reads it when a process starts, hence spawn.
        monkeypatch.setenv(user_setting, "131072")
    with DataLoader(
        dataset,
        batch_size=10,
        num_workers=1,
        transform=new_image,
        collate_fn=faults_so_far,
        multiprocessing_context="spawn",
    ) as loader:
        counts = list(loader)
    # Each batch allocates and frees 10 x 37 pages. A worker that keeps its freed heap faults
    # them in for its first batches only; the user's setting is kept, and then they fault in
    # again for every batch.
    per_batch = [b - a for a, b in itertools.pairwise(counts[1:])]
    if user_setting is None:
        assert max(per_batch) < 100, per_batch
    else:
        assert min(per_batch) > 300, per_batch


@contextlib.contextmanager
def counting_writer() -> Iterator[tuple[results.RegionWriter, list[int]]]:
    """A worker's side of a 1 MiB region, current for :func:`results.result_buffer`, with the
    size of every allocation it makes recorded."""
    owner = results.RegionOwner(1 << 20)
    fd, capacity, frees, warm = owner.worker_args()
    writer = results.RegionWriter(results._SharedFd(os.dup(fd.fd)), capacity, frees, warm)
    sizes: list[int] = []
    real_alloc = writer.alloc

    def counted(n):
        sizes.append(n)
        return real_alloc(n)

    writer.alloc = counted  # type: ignore[method-assign]
    try:
        with results.writing(writer):
            yield writer, sizes
    finally:
        del writer.alloc  # no cycle: the writer's mapping goes with the caller's frame
        owner.close()


def test_numpy_stack_as_collate_fn_writes_the_batch_into_result_memory_once():
    from dataset_rt._loader import workers

    parts = [np.full((4, 4), k, dtype=np.float32) for k in range(8)]
    with counting_writer() as (writer, sizes):
        stacked = workers.apply(parts, None, np.stack)
        assert writer.owned(stacked.__array_interface__["data"][0], stacked.nbytes)
        message = writer.encode(0, stacked, list(range(8)))
        # What the fast path cannot take is numpy's business, with numpy's result or error.
        mixed = workers.apply([np.zeros(2, np.uint8), np.ones(2, np.float64)], None, np.stack)
        with pytest.raises(ValueError, match="same shape"):
            workers.apply([np.zeros(2), np.zeros(3)], None, np.stack)
    assert sizes == [8 * 16 * 4]  # the stack's one write; encoding copied nothing
    assert np.array_equal(stacked, np.stack(parts)) and stacked.dtype == np.float32
    assert len(message) < 400  # the skeleton only
    assert mixed.dtype == np.float64 and mixed.tolist() == [[0, 0], [1, 1]]
    # Outside a worker: numpy's own stack.
    assert workers.apply([np.ones(2), np.zeros(2)], None, np.stack).tolist() == [[1, 1], [0, 0]]


def _dropped_as_it_goes(make):
    """A transform over ints that records, at each call, how many of its earlier results are
    still alive."""
    import weakref

    made: list[weakref.ref] = []
    alive_at_call: list[int] = []

    def transform(k):
        gc.collect()
        alive_at_call.append(sum(r() is not None for r in made))
        item = make(k)
        made.append(weakref.ref(item))
        return item

    return transform, alive_at_call


def test_transform_then_numpy_stack_writes_each_result_into_its_row_and_drops_it():
    from dataset_rt._loader import workers

    transform, alive = _dropped_as_it_goes(lambda k: np.full((4, 4), k, dtype=np.float32))
    with counting_writer() as (writer, sizes):
        stacked = workers.apply(list(range(8)), transform, np.stack)
        assert writer.owned(stacked.__array_interface__["data"][0], stacked.nbytes)
    # One write of the whole batch, and each result dropped before the next is made (were
    # they all kept for the stack, this would be 0, 1, ..., 7).
    assert sizes == [8 * 16 * 4]
    assert alive == [0] * 8
    assert np.array_equal(stacked, np.stack([np.full((4, 4), k, np.float32) for k in range(8)]))


def test_a_transform_result_unlike_the_first_hands_the_rows_to_the_collate():
    from dataset_rt._loader import workers

    def widening(k):  # float64 from the fourth sample on: numpy promotes the whole batch
        return np.full(3, k, dtype=np.float32 if k < 3 else np.float64)

    def growing(k):
        return np.zeros(3 if k < 5 else 4)

    def listed(k):
        return [k] if k == 2 else np.array([k])

    with counting_writer() as (_writer, sizes):
        mixed = workers.apply(list(range(6)), widening, np.stack)
        # numpy's own error, as without the rows
        with pytest.raises(ValueError, match="same shape"):
            workers.apply(list(range(6)), growing, np.stack)
        plain = workers.apply(list(range(4)), listed, np.stack)
    assert mixed.dtype == np.float64
    assert mixed.tolist() == np.stack([widening(k) for k in range(6)]).tolist()
    assert plain.tolist() == [[0], [1], [2], [3]]
    # The rows went to the collate as they were: written once more, by numpy's stack.
    assert sizes[:2] == [6 * 3 * 4, 6 * 3 * 8]
    # Outside a worker, and with another collate: as before.
    assert workers.apply([1, 2], lambda k: np.full(2, k), np.stack).tolist() == [[1, 1], [2, 2]]
    assert workers.apply([1, 2], lambda k: np.full(2, k), list)[1].tolist() == [2, 2]


@pytest.mark.torch
def test_transform_then_torch_default_collate_writes_rows_as_they_come():
    torch = pytest.importorskip("torch")
    from dataset_rt._loader import workers
    from dataset_rt.torch import default_collate

    transform, alive = _dropped_as_it_goes(lambda k: torch.full((2, 3), k, dtype=torch.int16))
    with counting_writer() as (writer, sizes):
        stacked = workers.apply(list(range(8)), transform, default_collate)
        assert writer.owned(stacked.data_ptr(), stacked.nbytes) is not None
        # A dtype numpy lacks is copied row by row by torch.
        halves = workers.apply(
            list(range(3)),
            lambda k: torch.full((2,), k + 0.5, dtype=torch.bfloat16),
            default_collate,
        )
        assert writer.owned(halves.data_ptr(), halves.nbytes) is not None

        # From a result unlike the first on, the collate gets the rows as tensors: its own
        # errors, and for mixed dtypes torch.stack's promotion (not the first tensor's dtype).
        def widening(k):
            return torch.full((2,), k + 0.25, dtype=torch.int16 if k < 2 else torch.float64)

        widened = workers.apply(list(range(4)), widening, default_collate)
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            workers.apply(list(range(4)), lambda k: torch.zeros(2 + k // 3), default_collate)
        # A tensor that needs grad is torch's business (its stack refuses out=).
        grads = workers.apply(
            [1, 2], lambda k: torch.full((2,), float(k), requires_grad=True), default_collate
        )
    assert sizes[:2] == [8 * 6 * 2, 3 * 2 * 2]
    assert alive == [0] * 8
    assert halves.dtype == torch.bfloat16 and halves.tolist() == [
        [0.5, 0.5],
        [1.5, 1.5],
        [2.5, 2.5],
    ]
    assert stacked.dtype == torch.int16 and stacked.shape == (8, 2, 3)
    assert torch.equal(stacked, torch.stack([torch.full((2, 3), k) for k in range(8)]).short())
    assert grads.requires_grad and grads.tolist() == [[1, 1], [2, 2]]
    assert widened.dtype == torch.float64
    assert torch.equal(widened, torch.stack([widening(k) for k in range(4)]))


@pytest.mark.torch
def test_torch_default_collate_stacks_into_result_memory_once(dataset):
    torch = pytest.importorskip("torch")
    from dataset_rt.torch import DataLoader as TorchDataLoader
    from dataset_rt.torch import default_collate

    # In a worker: the stack lands in the region, and sending it copies nothing more.
    parts = [torch.full((4, 4), k, dtype=torch.float32) for k in range(8)]
    with counting_writer() as (writer, sizes):
        stacked = default_collate(parts)
        assert writer.owned(stacked.data_ptr(), stacked.nbytes) is not None
        message = writer.encode(0, stacked, list(range(8)))
        assert writer.arena.in_use == mmap.PAGESIZE
    assert sizes == [8 * 16 * 4]  # the stack's one write; encoding copied nothing
    assert torch.equal(stacked, torch.stack(parts))
    assert len(message) < 400  # the skeleton only

    def as_tensor(sample):
        return torch.from_numpy(fixed(sample))

    ids = [i for i, _ in epoch0(dataset)]
    with TorchDataLoader(dataset, batch_size=6, num_workers=2, transform=as_tensor) as loader:
        batches = list(loader)
    assert torch.cat(batches)[:, 0].tolist() == [i % 256 for i in ids]
    assert all(in_result_memory(b.data_ptr(), b.nbytes) for b in batches)
    # Outside a worker it is torch's collate.
    assert default_collate([torch.ones(2), torch.zeros(2)]).tolist() == [[1, 1], [0, 0]]


def _mixed_dtypes(kind, wide_ids):
    """A transform whose samples in ``wide_ids`` give a wider dtype than the others (whose
    values the narrower one cannot hold), as a tensor or a numpy array, alone or nested."""
    import torch

    narrow, wide, value = {
        "int32-int64": (torch.int32, torch.int64, lambda i: 2**40 + i),
        "float32-float64": (torch.float32, torch.float64, lambda i: i + 0.1),
        "int64-float32": (torch.int64, torch.float32, lambda i: i + 0.5),
    }[kind]

    def transform(sample, as_numpy=False, nested=False):
        i = sample.metadata["i"]
        leaf = (
            torch.tensor([value(i), i], dtype=wide)
            if i in wide_ids
            else torch.tensor([i, i], dtype=narrow)
        )
        if as_numpy:
            leaf = leaf.numpy()
        return {"x": (leaf, i), "i": i} if nested else leaf

    return transform, torch.promote_types(narrow, wide)


@pytest.mark.torch
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["int32-int64", "float32-float64", "int64-float32"])
def test_torch_default_collate_promotes_mixed_dtypes_as_torch_stack_for_any_num_workers(
    dataset, num_workers, kind
):
    torch = pytest.importorskip("torch")
    from dataset_rt.torch import DataLoader as TorchDataLoader

    ids = [i for i, _ in epoch0(dataset)]
    # The fourth sample of each batch of 6 is the wide one: the first is always narrow.
    wide_ids = {i for k, i in enumerate(ids) if k % 6 == 3}
    base, promoted = _mixed_dtypes(kind, wide_ids)
    for as_numpy, nested in [(False, False), (True, False), (False, True), (True, True)]:
        transform = functools.partial(base, as_numpy=as_numpy, nested=nested)
        dataset.set_epoch(0)
        items = [transform(s) for s in dataset]
        dataset.set_epoch(0)
        expected = [
            torch.utils.data.default_collate(items[k : k + 6]) for k in range(0, len(items), 6)
        ]
        with TorchDataLoader(
            dataset, batch_size=6, num_workers=num_workers, transform=transform
        ) as loader:
            batches = list(loader)
        assert len(batches) == len(expected) == N // 6
        for got, want in zip(batches, expected, strict=True):
            if nested:
                assert got["i"].tolist() == want["i"].tolist()
                assert got["x"][1].tolist() == want["x"][1].tolist()
                got, want = got["x"][0], want["x"][0]
            assert want.dtype == promoted  # every batch mixes the two dtypes
            assert got.dtype == want.dtype, (as_numpy, nested)
            assert torch.equal(got, want), (as_numpy, nested)
    # numpy.stack as the collate promotes as numpy does, with workers or not.
    transform = functools.partial(base, as_numpy=True)
    dataset.set_epoch(0)
    items = [transform(s) for s in dataset]
    dataset.set_epoch(0)
    with DataLoader(
        dataset, batch_size=6, num_workers=num_workers, transform=transform, collate_fn=np.stack
    ) as loader:
        arrays = list(loader)
    for k, got in enumerate(arrays):
        want = np.stack(items[6 * k : 6 * k + 6])
        assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.torch
def test_pin_memory_without_an_accelerator_warns_like_torch(dataset):
    torch = pytest.importorskip("torch")
    from dataset_rt.torch import DataLoader as TorchDataLoader

    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    loader = TorchDataLoader(dataset, batch_size=30, pin_memory=True)
    with loader, pytest.warns(UserWarning, match="no accelerator is found"):
        batches = list(loader)
    assert len(batches) == 2


@pytest.mark.torch
@pytest.mark.parametrize(("argument", "value"), [("generator", "a torch.Generator")])
def test_ignored_torch_arguments_warn_once_per_process(dataset, monkeypatch, argument, value):
    torch = pytest.importorskip("torch")
    import dataset_rt.torch as dataset_rt_torch

    if value == "a torch.Generator":
        value = torch.Generator()
    monkeypatch.setattr(dataset_rt_torch, "_warned_ignored", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # repeats are the loader's to suppress, not Python's
        for _ in range(3):
            dataset_rt_torch.DataLoader(dataset, batch_size=4, num_workers=1, **{argument: value})
        dataset_rt_torch.DataLoader(dataset, batch_size=4, num_workers=1)
    messages = [str(w.message) for w in caught if w.category is UserWarning]
    assert messages == [
        f"dataset_rt.torch.DataLoader ignores {argument}=: "
        + (dataset_rt_torch._IGNORED_ARGUMENTS[argument])
    ]
    assert caught[0].filename == __file__  # points at the caller, as torch's warnings do


@pytest.mark.torch
def test_persistent_workers_is_honoured_without_a_warning(dataset):
    pytest.importorskip("torch")
    import dataset_rt.torch as dataset_rt_torch

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader = dataset_rt_torch.DataLoader(
            dataset, batch_size=4, num_workers=1, persistent_workers=True
        )
    with loader:
        assert loader.persistent_workers is True
        assert "persistent_workers" not in dataset_rt_torch._IGNORED_ARGUMENTS


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("collate_fn", [None, np.stack])
def test_a_transforms_error_names_the_sample_it_raised_for(dataset, num_workers, collate_fn):
    order = [i for i, _ in epoch0(dataset)]
    victim = order[13]  # the second sample of the fourth batch of 4

    def bad(sample):
        if sample.metadata["i"] == victim:
            raise ValueError("cannot decode")
        return fixed(sample)

    loader = DataLoader(
        dataset, batch_size=4, num_workers=num_workers, transform=bad, collate_fn=collate_fn
    )
    loader.set_epoch(0)
    with loader, pytest.raises((ValueError, WorkerError)) as info:
        for _ in loader:
            pass
    note = f"raised by the transform of sample 1 of its batch (global index {victim}"
    if num_workers == 0:
        assert isinstance(info.value, ValueError)
        text = "\n".join(getattr(info.value, "__notes__", []))
    else:
        assert "batch 3" in str(info.value) and "ValueError: cannot decode" in str(info.value)
        text = str(info.value)
    if sys.version_info >= (3, 11):
        assert note in text, text
