"""The shared-memory loader under faults (issue 4 §6): SIGKILL of the training process, the
producer and a consumer; a corrupt record. Each must end in an exception or a clean exit within
seconds, never a hang, with nothing left in /dev/shm."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from loader_helpers import gone, load, no_leaks, own_segments, wait_until  # noqa: F401

from dataset_rt import CorruptRecordError
from dataset_rt._loader import DataLoader
from dataset_rt._native import LoaderError
from dataset_rt.testing import corrupt_byte

N = 400


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("faults-cache")
    load(path, N)
    return path


def slow(sample):
    time.sleep(0.01)
    return sample.metadata["i"]


TRAINER = textwrap.dedent(
    """
    import json, sys, time
    sys.path.insert(0, {tests!r})
    from loader_helpers import load
    from dataset_rt._loader import DataLoader
    dataset = load(__import__("pathlib").Path({base!r}), {n})
    loader = DataLoader(dataset, batch_size=2, num_workers=2, prefetch_factor=1,
                        transform=lambda s: s.metadata["i"])
    it = iter(loader)
    next(it)
    print(json.dumps(it.pids), flush=True)
    time.sleep(600)
    """
)


def test_sigkill_of_the_training_process_stops_everything(base):
    script = TRAINER.format(tests=os.path.dirname(__file__), base=str(base), n=N)
    trainer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = trainer.stdout.readline()
        pids = json.loads(line)
        others = [pids["producer"], *pids["workers"]]
        assert not any(gone(p) for p in others)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        assert wait_until(lambda: all(gone(p) for p in others), 5), "children outlived it"
        assert wait_until(lambda: own_segments(trainer.pid) == [], 5)
    finally:
        if trainer.poll() is None:
            trainer.kill()
        trainer.wait()
        trainer.stdout.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sigkill_of_the_producer_raises_within_seconds(base, num_workers):
    dataset = load(base, N)
    with DataLoader(dataset, batch_size=2, num_workers=num_workers, transform=slow) as loader:
        it = iter(loader)
        next(it)
        os.kill(it.pids["producer"], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(LoaderError, match=r"producer process .* was killed by signal 9"):
            for _ in it:
                pass
        assert time.monotonic() - started < 5


def test_sigkill_of_a_consumer_raises_within_seconds(base):
    dataset = load(base, N)
    with DataLoader(dataset, batch_size=2, num_workers=2, transform=slow) as loader:
        it = iter(loader)
        next(it)
        os.kill(it.pids["workers"][1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(LoaderError, match=r"worker 1 .* was killed by signal 9"):
            for _ in it:
                pass
        assert time.monotonic() - started < 5


def test_corrupt_record_is_raised_in_order(tmp_path):
    dataset = load(tmp_path, 40, shuffle=False)
    shard = tmp_path / "loader" / "shards" / "000000.bin"
    corrupt_byte(shard, -5)  # inside the last record's payload
    received = []
    loader = DataLoader(dataset, batch_size=4, num_workers=1, transform=slow)
    with loader, pytest.raises(CorruptRecordError, match="producer failed at batch 9"):
        for batch in loader:
            received += batch
    assert received == list(range(36))  # every batch before the bad one arrived, in order


def test_closing_mid_epoch_stops_children_quickly(base):
    dataset = load(base, N)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, transform=slow)
    it = iter(loader)
    next(it)
    started = time.monotonic()
    loader.close()
    assert time.monotonic() - started < 3
    assert own_segments() == []
