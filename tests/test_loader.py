"""The shared-memory loader (issue 4): order, zero-copy, resume, concurrency, errors, torch."""

from __future__ import annotations

import mmap
import os
import random
import time
import tracemalloc

import numpy as np
import pytest
from loader_helpers import SEED, load, no_leaks, own_segments, payload  # noqa: F401

from dataset_rt import ConfigError, StateError
from dataset_rt._loader import DataLoader
from dataset_rt._native import LoaderError, WorkerError, reap_shm_leftovers

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


def test_zero_copy_views_in_the_training_process(base):
    big = load(base.parent / "big", 8)  # noqa: F841  (a second cache keeps sizes apart)
    dataset = load(base, N)
    with DataLoader(dataset, batch_size=4, num_workers=0) as loader:
        it = iter(loader)
        first = next(it)
        view = first[0].data
        assert isinstance(view, memoryview)
        assert isinstance(view.obj, mmap.mmap)  # the ring's Python-owned map: no bytes copy
        assert bytes(view) == payload(first[0].metadata["i"])
        # Bytes copied per sample in Python: none of the payload (only the view objects).
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            batch = next(it)
            grown = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
        payload_bytes = sum(len(s.data) for s in batch)
        assert payload_bytes > 0
        assert grown < 4096 + 1024 * len(batch)
        # The first batch's views were released when the second was requested.
        with pytest.raises(ValueError):
            bytes(view)
        with pytest.raises(ValueError):
            view[0]
        list(it)


def test_a_view_still_exported_blocks_reuse(dataset):
    with DataLoader(dataset, batch_size=4, num_workers=0) as loader:
        it = iter(loader)
        kept = np.frombuffer(next(it)[0].data, dtype=np.uint8)  # exports the slot's view
        with pytest.raises(LoaderError, match="still exported"):
            next(it)
        del kept


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
        time.sleep(0.3)  # let the producer and workers run ahead
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


def test_leftovers_of_dead_owners_are_reaped_and_live_ones_kept():
    dead = 2**22 + 12345  # above the default pid_max: no process has it
    ours = f"/dev/shm/dataset-rt-{os.getpid()}-feedface-ctl"
    theirs = f"/dev/shm/dataset-rt-{dead}-feedface-ctl"
    for path in (ours, theirs):
        with open(path, "wb") as f:
            f.write(b"x")
    try:
        removed = reap_shm_leftovers()
        assert os.path.basename(theirs) in removed
        assert not os.path.exists(theirs)
        assert os.path.exists(ours)
    finally:
        for path in (ours, theirs):
            if os.path.exists(path):
                os.unlink(path)


def test_set_epoch_and_len(dataset):
    with DataLoader(dataset, batch_size=10) as loader:
        loader.set_epoch(3)
        assert ids(loader) == epoch_ids(dataset, 3)
        assert loader.state_dict()["epoch"] == 4


def sleepy(sample):
    time.sleep(random.random() * 0.0002)
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
