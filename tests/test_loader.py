"""The shared-memory loader (issue 4): order, zero-copy, resume, concurrency, errors, torch."""

from __future__ import annotations

import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from loader_helpers import (  # noqa: F401
    SEED,
    children,
    gone,
    load,
    load_lz4,
    no_leaks,
    own_segments,
    payload,
    payload_lz4,
    views_a_shard_map,
    wait_until,
)

import dataset_rt
from dataset_rt import ConfigError, StateError
from dataset_rt._loader import DataLoader, slots
from dataset_rt._native import LoaderError, WorkerError

N = 60


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader-cache")
    load(path, N)
    return path


@pytest.fixture
def dataset(base):
    return load(base, N)


def ids(batches) -> list[int]:
    return [s.metadata["i"] for b in batches for s in b]


def index_of(sample) -> tuple[int, bytes]:
    return sample.metadata["i"], bytes(sample.data)


def keyed(sample):
    """A picklable, module-level transform (spawn needs one)."""
    return sample.metadata["i"], bytes(sample.data)


def epoch_ids(dataset, epoch: int) -> list[int]:
    dataset.set_epoch(epoch)
    return [s.metadata["i"] for s in dataset]


@pytest.mark.parametrize("num_workers", [0, 1, 2])
def test_order_and_bytes_equal_the_in_process_dataset(dataset, num_workers):
    expected = [epoch_ids(dataset, 0), epoch_ids(dataset, 1)]
    with DataLoader(dataset, batch_size=7, num_workers=num_workers) as loader:
        assert len(loader) == 9
        for epoch in (0, 1):
            sizes, got = [], []
            for b in loader:  # views of num_workers=0 are valid until the next batch
                sizes.append(len(b))
                for s in b:
                    got.append(s.metadata["i"])
                    assert bytes(s.data) == payload(s.metadata["i"])
                    assert s.metadata["tag"] == f"s{s.metadata['i']}"
            assert sizes == [7] * 8 + [4]
            assert got == expected[epoch]


def test_drop_last_and_collate(dataset):
    expected = epoch_ids(dataset, 0)
    with DataLoader(dataset, batch_size=7, drop_last=True, collate_fn=tuple) as loader:
        batches = list(loader)
    assert len(batches) == len(loader) == 8
    assert all(isinstance(b, tuple) and len(b) == 7 for b in batches)
    assert [s.metadata["i"] for b in batches for s in b] == expected[:56]


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_start_methods(dataset, start_method):
    expected = epoch_ids(dataset, 0)
    loader = DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        transform=keyed,
        multiprocessing_context=start_method,
    )
    with loader:
        got = [x for b in loader for x in b]
    assert [i for i, _ in got] == expected
    assert all(data == payload(i) for i, data in got)


@pytest.mark.parametrize("argument", ["transform", "collate_fn", "worker_init_fn"])
def test_a_function_spawn_cannot_send_is_named_before_anything_starts(dataset, argument):
    """Spawned workers get the functions pickled: a lambda is refused at iter() by the name of
    its argument, with what to do instead, before a producer or a worker is started (the
    autouse leak check); the same loader then runs with a module-level function."""
    loader = DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        multiprocessing_context="spawn",
        **{argument: lambda x: x},
    )
    with loader:
        with pytest.raises(pickle.PicklingError) as raised:
            iter(loader)
        message = str(raised.value)
        assert f"DataLoader.{argument} cannot be sent to 'spawn' worker processes" in message
        assert "top level" in message and "multiprocessing_context='fork'" in message
        assert children() == []
        # The options are read-only: the test reaches past that to run the same loader.
        object.__setattr__(loader, argument, None)
        assert len([x for b in loader for x in b]) == len(dataset)


def test_zero_copy_views_in_the_training_process(tmp_path):
    size = 64 * 1024
    dataset = load(tmp_path, 12, size=size)
    with DataLoader(dataset, batch_size=4, num_workers=0) as loader:
        it = iter(loader)
        first = next(it)
        view = first[0].data
        assert isinstance(view, memoryview)
        # An uncompressed record travels as a reference: a view of the shard's map, no copy.
        assert views_a_shard_map(view)
        assert bytes(view) == payload(first[0].metadata["i"], size)
        # Bytes copied per sample in Python: none of the payload (only the view objects), so
        # far less than one 64 KiB sample per batch.
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            batch = next(it)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        assert all(len(s.data) >= size for s in batch)
        assert grown < 4096 + 1024 * len(batch) < size
        # A view the loop keeps stays valid, whatever happens to its slot.
        assert bytes(view) == payload(first[0].metadata["i"], size)
        list(it)
        assert view[:] == payload(first[0].metadata["i"], size)


def where_is(sample):
    """What a worker's transform sees as ``sample.data``: its type, whether it views a shard map
    (no copy), and its length."""
    data = sample.data
    return type(data).__name__, views_a_shard_map(data), len(data)


def test_worker_transforms_get_zero_copy_views(dataset):
    with DataLoader(dataset, batch_size=8, num_workers=2, transform=where_is) as loader:
        seen = {(kind, owner) for b in loader for kind, owner, _ in b}
    assert seen == {("memoryview", True)}


def mapping_of(address: int) -> str:
    """The line of /proc/self/maps whose range holds `address`."""
    with open("/proc/self/maps") as f:
        for line in f:
            low, high = (int(x, 16) for x in line.split()[0].split("-"))
            if low <= address < high:
                return line
    raise AssertionError(f"{address:#x} is not mapped")


def test_a_kept_batch_is_read_in_place_until_its_slot_is_reused_then_privately(tmp_path):
    # LZ4 records travel decompressed in the slot (raw ones as views of their shard's map).
    size = 64 * 1024
    dataset = load_lz4(tmp_path, 24, size=size)
    with DataLoader(dataset, batch_size=4, num_workers=0) as loader:
        it = iter(loader)
        first = next(it)
        expected = [payload_lz4(s.metadata["i"], size) for s in first]
        kept = np.frombuffer(first[1].data, dtype=np.uint8)  # exports the slot's view
        address = kept.ctypes.data
        # Zero copy: the view reads the ring segment itself.
        assert "dataset-rt-" in mapping_of(address)
        second = next(it)
        assert "dataset-rt-" in mapping_of(address)
        rest = list(it)  # every slot is reused meanwhile
        assert len(rest) == 4
        # Its slot was reused: the same address now holds private, anonymous pages.
        line = mapping_of(address)
        assert "dataset-rt-" not in line
        assert line.split()[4] == "0"  # no inode: anonymous
        assert kept.ctypes.data == address
        assert kept.tobytes() == expected[1]
        assert [bytes(s.data) for s in first] == expected
        assert [bytes(s.data) for s in second] == [
            payload_lz4(s.metadata["i"], size) for s in second
        ]
    assert kept.tobytes() == expected[1]  # and after the loader closed


def test_batches_the_loop_drops_are_handed_back_without_a_copy(tmp_path, monkeypatch):
    size = 4096
    dataset = load_lz4(tmp_path, N, size=size)
    unmapped: dict[int, list[bool]] = {}
    release = slots.SlotMap.release

    def recording(self):
        done = release(self)
        unmapped.setdefault(self.seq, []).append(done)
        return done

    monkeypatch.setattr(slots.SlotMap, "release", recording)
    with DataLoader(dataset, batch_size=4, num_workers=0) as loader:
        for batch in loader:
            assert len(bytes(batch[0].data)) > 0
    # Each batch was still bound to `batch` when the next one was asked for, and unmapped the
    # time after: none was copied out of its slot. The last one is still bound to `batch`
    # after the pass: it stays in place (the pass is over, its slot is never reused).
    assert sorted(unmapped) == list(range(15))
    assert all(unmapped[seq] == [False, True] for seq in range(14)), unmapped
    assert unmapped[14] == [False]
    assert bytes(batch[0].data) == payload_lz4(batch[0].metadata["i"], size)


@pytest.fixture(scope="module")
def base_1000(tmp_path_factory):
    path = tmp_path_factory.mktemp("loader-cache-1000")
    load(path, 1000)
    return path


def test_list_of_a_loader_holds_valid_batches(base_1000):
    dataset = load(base_1000, 1000)
    expected = epoch_ids(dataset, 0)
    with DataLoader(dataset, batch_size=3, num_workers=0) as loader:
        batches = list(loader)
    assert len(batches) == 334
    assert ids(batches) == expected
    for b in batches:
        for s in b:
            assert bytes(s.data) == payload(s.metadata["i"])
            assert s.metadata["tag"] == f"s{s.metadata['i']}"


def test_every_batch_of_an_epoch_kept_then_checked(base_1000):
    dataset = load(base_1000, 1000)
    expected = epoch_ids(dataset, 0)
    kept, arrays = [], []
    with DataLoader(dataset, batch_size=1, num_workers=0) as loader:
        for batch in loader:
            kept.append(batch)
            arrays.append(np.frombuffer(batch[0].data, dtype=np.uint8))
        assert len(kept) == 1000
        assert ids(kept) == expected
    # Every view and every array made from one still holds its own sample after the loader
    # closed (each slot was reused hundreds of times meanwhile).
    for (sample,), array in zip(kept, arrays, strict=True):
        i = sample.metadata["i"]
        assert bytes(sample.data) == payload(i)
        assert array.tobytes() == payload(i)


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"num_workers": 0, "batch_size": 5}, {"num_workers": 2, "batch_size": 5}),
        ({"num_workers": 2, "batch_size": 5}, {"num_workers": 0, "batch_size": 3}),
        ({"num_workers": 1, "batch_size": 4}, {"num_workers": 2, "batch_size": 7}),
    ],
)
@pytest.mark.parametrize("k", [0, 3, 7])
def test_resume_matrix(dataset, first, second, k):
    expected = epoch_ids(dataset, 0)
    with DataLoader(dataset, transform=keyed, **first) as loader:
        it = iter(loader)
        before = [next(it) for _ in range(k)]
        state = loader.state_dict()
        next(it)  # prefetched or received after the checkpoint: not in the state
        assert loader.state_dict()["position"] == state["position"] + first["batch_size"]
    with DataLoader(dataset, transform=keyed, **second) as resumed:
        resumed.load_state_dict(state)
        after = list(resumed)
        assert resumed.state_dict()["epoch"] == 1
        assert resumed.state_dict()["position"] == 0
    got = [i for b in before + after for i, _ in b]
    assert got == expected


def test_state_counts_received_batches_only(dataset):
    with DataLoader(dataset, batch_size=5, num_workers=2, transform=keyed) as loader:
        assert loader.state_dict()["position"] == 0
        it = iter(loader)
        next(it)
        # The producer runs ahead of the loop (every slot written, not only the one received):
        # the state must still count only what the loop received.
        assert wait_until(lambda: it._ring.produced >= 3, 60), it._ring.produced
        assert loader.state_dict()["epoch"] == 0
        assert loader.state_dict()["position"] == 5
        next(it)
        assert loader.state_dict()["position"] == 10
    assert loader.state_dict()["position"] == 10  # kept after close


def test_resume_with_another_world_size(base):
    single = load(base, N)
    expected = epoch_ids(single, 0)
    with DataLoader(single, batch_size=4, transform=keyed) as loader:
        it = iter(loader)
        before = [i for _ in range(4) for i, _ in next(it)]
        state = loader.state_dict()
    assert state["position"] == 16
    ranks = []
    for rank in (0, 1):
        dataset = load(base, N, rank=rank, world_size=2)
        with DataLoader(dataset, batch_size=3, num_workers=1, transform=keyed) as loader:
            loader.load_state_dict(state)
            ranks.append([i for b in loader for i, _ in b])
    # Rank r reads global positions 16 + r, 16 + r + 2, ... of the same epoch order.
    assert ranks[0] == expected[16::2]
    assert ranks[1] == expected[17::2]
    assert before == expected[:16]


@pytest.mark.parametrize("rank", [0, 4, 6])
def test_padded_resume_on_the_same_world_size(base, rank):
    # 60 samples on 7 ranks: ranks 4, 5 and 6 end with a pad. A checkpoint after 2 batches of 2
    # (position 28), resumed on 7 ranks, must deliver exactly the uninterrupted pass, pads
    # included, and the in-process dataset's share.
    dataset = load(base, N, rank=rank, world_size=7)
    expected = epoch_ids(dataset, 0)
    assert len(expected) == 9
    with DataLoader(dataset, batch_size=2, num_workers=2, transform=keyed) as loader:
        full = [i for b in loader for i, _ in b]
    with DataLoader(dataset, batch_size=2, transform=keyed) as loader:
        it = iter(loader)
        before = [i for _ in range(2) for i, _ in next(it)]
        state = loader.state_dict()
    assert state["position"] == 28
    with DataLoader(dataset, batch_size=3, num_workers=1, transform=keyed) as resumed:
        resumed.load_state_dict(state)
        after = [i for b in resumed for i, _ in b]
        assert (resumed.state_dict()["epoch"], resumed.state_dict()["position"]) == (1, 0)
    assert full == expected
    assert before + after == expected
    if rank >= 4:
        order = dataset_rt._native.epoch_order(SEED, 0, N)
        assert expected[-1] == order[rank - 4]  # the pad: the epoch's first positions


def test_two_loaders_at_once_do_not_interfere(dataset, base):
    other = load(base, N)
    other.set_epoch(0)
    expected = epoch_ids(dataset, 0)
    a = DataLoader(dataset, batch_size=3, num_workers=1, transform=keyed)
    b = DataLoader(other, batch_size=5, num_workers=0, transform=keyed)
    with a, b:
        ia, ib = iter(a), iter(b)
        got_a, got_b = [], []
        for _ in range(20):
            got_a += [i for i, _ in next(ia)]
            if len(got_b) < N:
                got_b += [i for i, _ in next(ib)]
        assert len(own_segments()) == 0  # both unlinked once everyone attached
    assert got_a == expected
    assert got_b == expected


def failing(sample):
    if sample.metadata["i"] == 13:
        raise ValueError("transform refused sample thirteen")
    return sample.metadata["i"]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_transform_exception_reaches_the_training_loop(dataset, num_workers):
    loader = DataLoader(dataset, batch_size=4, num_workers=num_workers, transform=failing)
    error = WorkerError if num_workers else ValueError
    with loader, pytest.raises(error) as caught:
        list(loader)
    assert "transform refused sample thirteen" in str(caught.value)
    if num_workers:
        assert "Traceback" in str(caught.value)
        assert "in failing" in str(caught.value)


def test_batch_larger_than_a_slot_is_refused(dataset):
    with (
        DataLoader(dataset, batch_size=60, slot_size_bytes=4096) as loader,
        pytest.raises(
            LoaderError, match=r"batch 0 \(60 samples\) needs \d+ bytes but a ring slot holds 4096"
        ),
    ):
        list(loader)


def test_weighted_dataset_follows_the_weight_table(dataset):
    import polars as pl

    table = dataset.samples_metadata()
    dataset.set_samples_metadata(
        table.with_columns(pl.when(pl.col("i") < 5).then(20.0).otherwise(1.0).alias("weight"))
    )
    expected = epoch_ids(dataset, 0)
    with DataLoader(dataset, batch_size=8, num_workers=1, transform=keyed) as loader:
        got = [i for b in loader for i, _ in b]
    assert got == expected
    assert sum(i < 5 for i in got) > 5  # the weights were applied


def test_state_of_another_dataset_is_refused(dataset, tmp_path):
    other = load(tmp_path, 10)
    state = DataLoader(other).state_dict()
    with pytest.raises(StateError):
        DataLoader(dataset).load_state_dict(state)


def test_bad_arguments(dataset):
    with pytest.raises(ConfigError):
        DataLoader(dataset, batch_size=0)
    with pytest.raises(ConfigError):
        DataLoader(dataset, num_workers=-1)
    with pytest.raises(ConfigError):
        DataLoader(dataset, multiprocessing_context="forkserver")


def test_set_epoch_and_len(dataset):
    with DataLoader(dataset, batch_size=10) as loader:
        loader.set_epoch(3)
        assert ids(loader) == epoch_ids(dataset, 3)
        assert loader.state_dict()["epoch"] == 4


def sleepy(sample):
    # A random tenth of the samples takes 0-5 ms: workers finish out of order.
    if random.random() < 0.1:
        time.sleep(random.random() * 0.005)
    return sample.metadata["i"]


@pytest.mark.slow
def test_stress_ten_thousand_batches(tmp_path):
    dataset = load(tmp_path, 10_000, shuffle=True)
    expected = [s.metadata["i"] for s in dataset]
    started = time.monotonic()
    with DataLoader(dataset, batch_size=1, num_workers=2, transform=sleepy) as loader:
        got = [i for b in loader for i in b]
    assert got == expected
    assert time.monotonic() - started < 60


@pytest.mark.torch
def test_torch_subclass(dataset):
    torch = pytest.importorskip("torch")
    from dataset_rt.torch import DataLoader as TorchDataLoader

    def label(sample):
        return {"i": sample.metadata["i"], "n": torch.tensor(len(sample.data))}

    expected = epoch_ids(dataset, 0)
    with TorchDataLoader(dataset, batch_size=8, num_workers=2, transform=label) as loader:
        assert isinstance(loader, torch.utils.data.DataLoader)
        assert len(loader) == 8
        assert loader.batch_size == 8 and loader.num_workers == 2
        batches = list(loader)
    assert all(isinstance(b["i"], torch.Tensor) for b in batches)
    assert torch.cat([b["i"] for b in batches]).tolist() == expected
    assert [int(n) for b in batches for n in b["n"]] == [len(payload(i)) for i in expected]
    with pytest.raises(ConfigError):
        TorchDataLoader(dataset, shuffle=True)


@pytest.mark.torch
@pytest.mark.parametrize("num_workers", [0, 2])
def test_torch_default_collate_takes_cached_samples(dataset, num_workers):
    torch = pytest.importorskip("torch")
    from dataset_rt.torch import DataLoader as TorchDataLoader

    expected = epoch_ids(dataset, 0)
    with TorchDataLoader(dataset, batch_size=8, num_workers=num_workers) as loader:
        batches = list(loader)
    assert all(set(b) == {"data", "metadata"} for b in batches)
    ids = torch.cat([b["metadata"]["i"] for b in batches]).tolist()
    assert ids == expected
    assert [d for b in batches for d in b["data"]] == [payload(i) for i in expected]
    # With workers, the bytes arrive as read-only views of the worker's result memory.
    kind = memoryview if num_workers else bytes
    assert all(isinstance(d, kind) for b in batches for d in b["data"])
    assert [t for b in batches for t in b["metadata"]["tag"]] == [f"s{i}" for i in expected]


def test_batch_size_may_be_positional(dataset):
    with DataLoader(dataset, 16) as loader:
        assert loader.batch_size == 16
        assert [len(b) for b in loader] == [16, 16, 16, 12]


def test_set_epoch_moves_the_state_to_that_epoch(dataset):
    with DataLoader(dataset, batch_size=10, transform=keyed) as loader:
        assert ids_of(loader) == epoch_ids(dataset, 0)
        assert loader.state_dict()["epoch"] == 1
        loader.set_epoch(10)
        assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (10, 0)
        it = iter(loader)
        next(it)
        assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (10, 10)
        loader.set_epoch(4)  # mid-pass: the state is epoch 4's start, not the live pass's
        next(it)
        assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (4, 0)
        assert ids_of(loader) == epoch_ids(dataset, 4)
        with pytest.raises(ConfigError, match="epoch"):
            loader.set_epoch(-1)


def ids_of(loader) -> list[int]:
    return [i for b in loader for i, _ in b]


def test_state_reports_the_weight_table_of_its_pass(dataset):
    import polars as pl

    with DataLoader(dataset, batch_size=8, transform=keyed) as loader:
        uniform = loader.state_dict()["weights_fingerprint"]
        it = iter(loader)
        next(it)
        table = dataset.samples_metadata()
        dataset.set_samples_metadata(
            table.with_columns(pl.when(pl.col("i") < 5).then(3.0).otherwise(1.0).alias("weight"))
        )
        # The live pass reads the uniform order: its state says so, mid-pass and after.
        assert loader.state_dict()["weights_fingerprint"] == uniform
        loader.close()
        assert loader.state_dict()["weights_fingerprint"] == uniform
        weighted = DataLoader(dataset).state_dict()["weights_fingerprint"]
        assert weighted != uniform
        list(loader)  # a new pass reads the new weights
        assert loader.state_dict()["weights_fingerprint"] == weighted


def test_a_failed_start_keeps_the_loaded_state_and_the_epoch(dataset):
    expected = epoch_ids(dataset, 2)
    with DataLoader(dataset, batch_size=5, transform=keyed) as loader:
        it = iter(loader)
        next(it)
        resumed_state = {**loader.state_dict(), "epoch": 2, "position": 15}
    broken = DataLoader(
        dataset,
        batch_size=5,
        num_workers=1,
        transform=lambda s: s,  # not picklable: the spawned worker cannot start
        multiprocessing_context="spawn",
    )
    with broken:
        broken.load_state_dict(resumed_state)
        with pytest.raises(pickle.PicklingError, match=r"DataLoader\.transform cannot be sent"):
            iter(broken)
        assert broken.state_dict() == resumed_state
        # The options are read-only: the test reaches past that to retry the same plan.
        object.__setattr__(broken, "transform", keyed)
        object.__setattr__(broken, "slot_size_bytes", 1 << 40)  # the segments cannot be made
        with pytest.raises(OSError):
            iter(broken)
        assert broken.state_dict() == resumed_state
        object.__setattr__(broken, "slot_size_bytes", None)
        assert ids_of(broken) == expected[15:]
    with DataLoader(dataset, batch_size=5, slot_size_bytes=1 << 40) as loader:
        loader.set_epoch(3)
        with pytest.raises(OSError):
            iter(loader)
        assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (3, 0)
        object.__setattr__(loader, "slot_size_bytes", None)
        object.__setattr__(loader, "transform", keyed)
        assert ids_of(loader) == epoch_ids(dataset, 3)


POLLER = textwrap.dedent(
    """
    import sys, threading
    sys.path.insert(0, {tests!r})
    from loader_helpers import load
    from dataset_rt._loader import DataLoader
    dataset = load(__import__("pathlib").Path({base!r}), {n})
    loader = DataLoader(dataset, batch_size=4, slot_size_bytes=16 << 20)
    done = threading.Event()
    def poll():
        while not done.is_set():
            loader.state_dict()
    thread = threading.Thread(target=poll)
    thread.start()
    for _ in range(10):
        it = iter(loader)
        next(it)
        loader.close()
    done.set()
    thread.join()
    print("ok", flush=True)
    """
)


def test_state_dict_from_another_thread_while_passes_start(base):
    """`state_dict()` in a thread (holding the GIL) while `iter()` creates the segments with
    the GIL released: neither may wait for the other forever."""
    script = POLLER.format(tests=os.path.dirname(__file__), base=str(base), n=N)
    try:
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("iter() and state_dict() in two threads deadlocked")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


KEEPER = textwrap.dedent(
    """
    import os, resource, sys
    from pathlib import Path
    sys.path.insert(0, {tests!r})
    from loader_helpers import load_lz4, payload_lz4
    from dataset_rt._loader import DataLoader
    dataset = load_lz4(Path({base!r}), 64, size={size})
    it = iter(DataLoader(dataset, batch_size=1))
    print(os.getpid(), it.pids["producer"], flush=True)
    kept = [next(it), next(it)]
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    limit = resource.getrlimit(resource.RLIMIT_AS)
    # Room for a few more batches: keeping every one must end in MemoryError, not a hang.
    resource.setrlimit(resource.RLIMIT_AS, (vm + 12 * {size}, limit[1]))
    try:
        for batch in it:
            kept.append(batch)
        print("no error", flush=True)
    except MemoryError as e:
        resource.setrlimit(resource.RLIMIT_AS, limit)
        assert 2 < len(kept) < 64, len(kept)
        for (sample,) in kept:
            assert bytes(sample.data) == payload_lz4(sample.metadata["i"], {size})
        print(e, flush=True)
    """
)


def test_keeping_batches_past_the_memory_limit_raises_memory_error(tmp_path):
    """Kept batches cost memory: where the process can get no more, `next()` raises
    MemoryError naming the batch; nothing hangs or leaks, and the batches kept stay valid."""
    size = 256 * 1024
    load_lz4(tmp_path, 64, size=size)  # decompressed into the slots: each kept batch costs
    script = KEEPER.format(tests=os.path.dirname(__file__), base=str(tmp_path), size=size)
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    pids, message = done.stdout.strip().split("\n")
    owner, producer = map(int, pids.split())
    assert "batch" in message and "keep fewer batches" in message, message
    assert wait_until(lambda: gone(producer), 5)
    assert own_segments(owner) == []


def test_slots_are_sized_from_the_data(dataset, tmp_path):
    with DataLoader(dataset, batch_size=4) as loader:
        it = iter(loader)
        next(it)
        assert it.slot_size == 64 * 1024  # 200-byte samples: the smallest slot
    big = load(tmp_path, 12, size=100_000)
    with DataLoader(big, batch_size=4, num_workers=1, transform=keyed) as loader:
        it = iter(loader)
        got = [x for b in it for x in b]
        # Raw records travel as references: slots hold no payload bytes, only entries and
        # metadata, so 100 KB samples take the smallest slot.
        assert it.slot_size == 64 * 1024
    assert sorted(i for i, _ in got) == list(range(12))
    assert all(data == payload(i, 100_000) for i, data in got)
    with DataLoader(big, batch_size=4, slot_size_bytes=4096, transform=keyed) as loader:
        assert sorted(i for b in loader for i, _ in b) == list(range(12))
    lz4 = load_lz4(tmp_path / "lz4", 12, size=100_000)
    with DataLoader(lz4, batch_size=4, num_workers=1, transform=keyed) as loader:
        it = iter(loader)
        got = [x for b in it for x in b]
        # LZ4 records travel decompressed in the slot: four of the largest (100 011 bytes)
        # and their overheads, rounded to a page.
        assert 4 * 100_011 < it.slot_size <= 4 * 100_011 + 4096 + 4 * 4096
    assert sorted(i for i, _ in got) == list(range(12))
    assert all(data == payload_lz4(i, 100_000) for i, data in got)
    with DataLoader(lz4, batch_size=4, slot_size_bytes=300_000) as loader:
        it = iter(loader)
        assert it.slot_size == 303_104  # rounded up to a multiple of 4096
        with pytest.raises(LoaderError, match=r"needs \d+ bytes but a ring slot holds 303104"):
            next(it)


def test_two_loaders_in_two_processes_at_once(dataset, base):
    expected = epoch_ids(dataset, 0)
    script = OTHER_PROCESS.format(tests=os.path.dirname(__file__), base=str(base), n=N)
    other = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        with DataLoader(dataset, batch_size=3, num_workers=2, transform=keyed) as loader:
            it = iter(loader)
            got = [i for i, _ in next(it)]
            assert other.stdout.readline().strip() == "started"  # both passes are live now
            other.stdin.write("go\n")
            other.stdin.flush()
            got += [i for b in it for i, _ in b]
        theirs = json.loads(other.stdout.readline())
        assert other.wait(30) == 0
    finally:
        if other.poll() is None:
            other.kill()
        other.wait()
        other.stdin.close()
        other.stdout.close()
    assert got == expected
    assert theirs == expected
    assert own_segments(other.pid) == []


OTHER_PROCESS = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    from loader_helpers import load
    from dataset_rt._loader import DataLoader
    dataset = load(__import__("pathlib").Path({base!r}), {n})
    with DataLoader(dataset, batch_size=5, num_workers=2,
                    transform=lambda s: s.metadata["i"]) as loader:
        it = iter(loader)
        got = list(next(it))
        print("started", flush=True)
        sys.stdin.readline()
        got += [i for b in it for i in b]
    print(json.dumps(got), flush=True)
    """
)


def failing_collate(items):
    if 13 in [i for i, _ in items]:
        raise RuntimeError("collate_fn refused the batch with thirteen")
    return items


def test_collate_fn_exception_in_a_worker(dataset):
    expected = epoch_ids(dataset, 0)
    bad = next(k for k in range(0, N, 4) if 13 in expected[k : k + 4])
    received = []
    loader = DataLoader(
        dataset, batch_size=4, num_workers=2, transform=keyed, collate_fn=failing_collate
    )
    with loader, pytest.raises(WorkerError) as caught:
        for b in loader:
            received += [i for i, _ in b]
    message = str(caught.value)
    assert f"batch {bad // 4}" in message
    assert "collate_fn refused the batch with thirteen" in message
    assert "in failing_collate" in message and "Traceback" in message
    assert received == expected[:bad]


def refusing_init(index):
    raise KeyError(f"worker_init_fn refused worker {index}")


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_worker_init_fn_exception_reaches_the_training_loop(dataset, start_method):
    loader = DataLoader(
        dataset,
        batch_size=4,
        num_workers=2,
        worker_init_fn=refusing_init,
        multiprocessing_context=start_method,
    )
    with loader, pytest.raises(WorkerError) as caught:
        list(loader)
    message = str(caught.value)
    assert "worker_init_fn raised in loader worker" in message
    assert "KeyError" in message and "worker_init_fn refused worker" in message
    assert "in refusing_init" in message and "Traceback" in message


def test_the_producer_imports_this_package_without_a_changed_path(dataset):
    with DataLoader(dataset, batch_size=4) as loader:
        it = iter(loader)
        pid = it.pids["producer"]
        # Popen returns once the child exists, possibly before it has exec'd the interpreter
        # (its /proc entries are then the fork's): wait for the producer's own command line.
        deadline = time.monotonic() + 10
        while b"-I\0-S" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the producer never exec'd python -I -S"
            time.sleep(0.005)
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(entry.split(b"=", 1) for entry in f.read().split(b"\0") if b"=" in entry)
        next(it)
    ours = os.environ.get("PYTHONPATH")
    assert environ.get(b"PYTHONPATH") == (None if ours is None else ours.encode())


def test_linux_only(dataset, monkeypatch):
    monkeypatch.setattr(sys, "platform", "darwin")
    with pytest.raises(ConfigError, match="the shared-memory loader needs Linux"):
        DataLoader(dataset)
