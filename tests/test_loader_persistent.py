"""The shared-memory loader with persistent_workers=True: one producer, one set of workers and
one ring for every epoch, with the state semantics of a fresh pipeline per epoch."""

from __future__ import annotations

import os
import signal
import time

import pytest
from loader_helpers import (  # noqa: F401
    children,
    gone,
    load,
    no_leaks,
    own_segments,
    wait_until,
)

from dataset_rt import ConfigError
from dataset_rt._loader import DataLoader
from dataset_rt._native import LoaderError

N = 40


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("persistent-cache")
    load(path, N)
    return path


@pytest.fixture
def dataset(base):
    return load(base, N)


def keyed(sample):
    return sample.metadata["i"]


def ids(batches) -> list[int]:
    return [i for b in batches for i in b]


def epoch_ids(dataset, epoch: int) -> list[int]:
    dataset.set_epoch(epoch)
    return [s.metadata["i"] for s in dataset]


def test_persistent_workers_need_workers_as_in_torch(dataset):
    with pytest.raises(ConfigError, match="persistent_workers option needs num_workers > 0"):
        DataLoader(dataset, num_workers=0, persistent_workers=True)
    with pytest.raises(ConfigError, match="persistent_workers: 1 is not a bool"):
        DataLoader(dataset, num_workers=1, persistent_workers=1)  # type: ignore[arg-type]


def test_the_same_processes_and_ring_serve_three_epochs(dataset):
    expected = [epoch_ids(dataset, e) for e in range(3)]
    with DataLoader(
        dataset, batch_size=3, num_workers=2, transform=keyed, persistent_workers=True
    ) as loader:
        seen = []
        for epoch in range(3):
            it = iter(loader)
            assert ids(it) == expected[epoch], f"epoch {epoch}"
            seen.append((it.pids["producer"], tuple(it.pids["workers"]), it.segment_names))
            assert loader.state_dict()["epoch"] == epoch + 1
            assert loader.state_dict()["position"] == 0
            # Between epochs everything stays up and nothing is left in /dev/shm.
            assert not gone(seen[-1][0]) and not any(gone(w) for w in seen[-1][1])
            assert own_segments() == []
        assert seen[0] == seen[1] == seen[2]
        assert len(set(seen[0][1])) == 2
    assert gone(seen[0][0]) and all(gone(w) for w in seen[0][1])


def test_a_non_persistent_loader_starts_new_processes_each_epoch(dataset):
    with DataLoader(dataset, batch_size=3, num_workers=1, transform=keyed) as loader:
        pids = []
        for _ in range(2):
            it = iter(loader)
            list(it)
            pids.append(it.pids["producer"])
        assert pids[0] != pids[1]


@pytest.mark.parametrize("k", [0, 2, 5])
def test_a_resume_in_the_middle_of_an_epoch_on_a_persistent_pipeline(dataset, k):
    expected = epoch_ids(dataset, 0) + epoch_ids(dataset, 1)
    with DataLoader(dataset, batch_size=3, num_workers=2, transform=keyed) as first:
        it = iter(first)
        before = [next(it) for _ in range(k)]
        state = first.state_dict()
    with DataLoader(
        dataset, batch_size=3, num_workers=2, transform=keyed, persistent_workers=True
    ) as resumed:
        # An epoch on the pipeline first, then the loaded state on the same processes.
        it = iter(resumed)
        list(it)
        pids = it.pids
        resumed.load_state_dict(state)
        it = iter(resumed)
        after = list(it)
        assert it.pids == pids
        assert resumed.state_dict()["epoch"] == 1
        after += list(iter(resumed))
        assert it.pids == pids
    assert ids(before + after) == expected


def test_state_inside_an_epoch_of_a_persistent_pipeline(dataset):
    with DataLoader(
        dataset, batch_size=4, num_workers=2, transform=keyed, persistent_workers=True
    ) as loader:
        list(iter(loader))
        it = iter(loader)
        next(it)
        next(it)
        assert loader.state_dict()["epoch"] == 1
        assert loader.state_dict()["position"] == 8


def test_set_epoch_between_epochs(dataset):
    expected = [epoch_ids(dataset, e) for e in (0, 5, 2)]
    with DataLoader(
        dataset, batch_size=5, num_workers=2, transform=keyed, persistent_workers=True
    ) as loader:
        it = iter(loader)
        got = [ids(it)]
        pids = it.pids
        loader.set_epoch(5)
        assert loader.state_dict()["epoch"] == 5
        got.append(ids(iter(loader)))
        loader.set_epoch(2)
        it = iter(loader)
        got.append(ids(it))
        assert it.pids == pids
        assert loader.state_dict()["epoch"] == 3
    assert got == expected


def test_a_pass_left_early_is_replaced_by_a_fresh_pipeline(dataset):
    with DataLoader(
        dataset, batch_size=4, num_workers=2, transform=keyed, persistent_workers=True
    ) as loader:
        it = iter(loader)
        next(it)
        first = it.pids
        it = iter(loader)  # the first pass was left: epoch 1 on new processes
        assert ids(it) == epoch_ids(dataset, 1)
        assert it.pids["producer"] != first["producer"]
        assert wait_until(lambda: gone(first["producer"]), 5)


@pytest.mark.parametrize("victim", ["worker", "producer"])
def test_a_death_between_epochs_raises_at_the_next_iter_then_a_fresh_start_works(dataset, victim):
    with DataLoader(
        dataset, batch_size=4, num_workers=2, transform=keyed, persistent_workers=True
    ) as loader:
        it = iter(loader)
        list(it)
        pid = it.pids["producer"] if victim == "producer" else it.pids["workers"][1]
        os.kill(pid, signal.SIGKILL)
        # Reapable, not only a zombie leader whose other threads are still exiting.
        if victim == "producer":
            assert wait_until(lambda: it._producer is not None and it._producer.poll(), 5)
        else:
            assert wait_until(lambda: not it._workers[1].is_alive(), 5)
        started = time.monotonic()
        with pytest.raises(LoaderError, match=r"killed by signal 9 between passes"):
            iter(loader)
        assert time.monotonic() - started < 5
        assert own_segments() == []
        # The failed iter() consumed nothing: the state is still at epoch 1's start.
        assert loader.state_dict()["epoch"] == 1
        it = iter(loader)
        assert ids(it) == epoch_ids(dataset, 1)
        assert pid not in [it.pids["producer"], *it.pids["workers"]]


def test_close_stops_an_idle_pipeline_promptly(dataset):
    loader = DataLoader(
        dataset, batch_size=4, num_workers=2, transform=keyed, persistent_workers=True
    )
    it = iter(loader)
    list(it)
    pids = [it.pids["producer"], *it.pids["workers"]]
    started = time.monotonic()
    loader.close()
    # Promptly means the idle producer and workers woke on the stop flag and exited by
    # themselves (code 0), instead of sleeping through the grace and being SIGKILLed: said by
    # their exit codes, not by a time that a loaded machine can exceed.
    assert it._producer is not None and it._producer.returncode == 0
    assert [p.exitcode for p in it._workers] == [0, 0]
    # A hang (an unbounded join, a stop nobody hears) fails here; the bounded stop takes at most
    # EXIT_GRACE_S + KILL_WAIT_S.
    assert time.monotonic() - started < 30
    assert all(gone(p) for p in pids)
    assert children() == []


def test_deleting_the_loader_stops_an_idle_pipeline(dataset):
    loader = DataLoader(
        dataset, batch_size=4, num_workers=1, transform=keyed, persistent_workers=True
    )
    it = iter(loader)
    list(it)
    pids = [it.pids["producer"], *it.pids["workers"]]
    del it, loader
    assert wait_until(lambda: all(gone(p) for p in pids), 5)


def test_the_torch_adapter_keeps_its_workers_too(dataset):
    import dataset_rt.torch as drt_torch

    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
        drt_torch.DataLoader(dataset, num_workers=0, persistent_workers=True)
    loader = drt_torch.DataLoader(
        dataset, batch_size=4, num_workers=2, transform=keyed, persistent_workers=True
    )
    try:
        pids = []
        for _ in range(2):
            assert sum(len(b) for b in loader) == N
            assert loader._shm._iterator is not None
            pids.append(loader._shm._iterator.pids)
        assert pids[0] == pids[1]
    finally:
        loader._shm.close()
