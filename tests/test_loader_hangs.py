"""Hangs that a beating heartbeat hides: a worker forked from a training process that used torch's
thread pool (each worker runs one torch thread, as torch's own workers do), and a batch that takes
far longer than the workers' recent ones (a ``RuntimeWarning`` naming the worker that holds it)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from loader_helpers import load, no_leaks  # noqa: F401

from dataset_rt import DataLoader
from dataset_rt._loader import passes

N = 48
BATCH = 4

TORCH_FORK = textwrap.dedent(
    """
    import sys, time
    import torch
    from dataset_rt import DataLoader, DatasetRuntime, WriterConfig
    from dataset_rt.testing import make_source

    def big_view(sample):
        big = torch.zeros(1 << 20)  # a parallel fill
        big[5] = sample.metadata["i"]
        return big[4:8]

    with DatasetRuntime(num_workers=1) as runtime:
        source = make_source("c", [(bytes([i]) * 64, {"i": i}) for i in range(16)])
        result = runtime.from_cache_sources(
            source, sys.argv[1], writer_config=WriterConfig(show_progress=False)
        )
        torch.zeros(1 << 20).sum()  # the training process uses torch's thread pool first
        with DataLoader(
            result.dataset, 4, num_workers=2, transform=big_view, timeout=60,
            multiprocessing_context="fork",
        ) as loader:
            print(sum(len(batch) for batch in loader))
    """
)


@pytest.mark.torch
def test_a_parallel_torch_transform_in_a_forked_worker_finishes(tmp_path):
    """The training process used torch's thread pool, then forked workers whose transform runs
    a parallel torch op: without one torch thread per worker, the workers deadlock while their
    heartbeats beat (the default timeout=0 would wait forever; here the subprocess would time
    out)."""
    pytest.importorskip("torch")
    run = subprocess.run(
        [sys.executable, "-c", TORCH_FORK, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["16"]


def threads_in_worker(get_num_threads, sample):
    return get_num_threads()


def more_threads(index: int) -> None:
    import torch

    torch.set_num_threads(2)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return load(tmp_path_factory.mktemp("hangs"), N)


@pytest.mark.torch
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_each_worker_runs_one_torch_thread_unless_worker_init_fn_raises_it(dataset, context):
    torch = pytest.importorskip("torch")
    # With spawn, unpickling the transform (which holds a torch function) imports torch in the
    # worker before it starts, as a transform from a module that imports torch would.
    transform = functools.partial(threads_in_worker, torch.get_num_threads)
    kwargs = {"num_workers": 1, "transform": transform, "multiprocessing_context": context}
    with DataLoader(dataset, BATCH, **kwargs) as loader:
        assert {n for batch in loader for n in batch} == {1}
    with DataLoader(dataset, BATCH, worker_init_fn=more_threads, **kwargs) as loader:
        assert {n for batch in loader for n in batch} == {2}


def sleepy(pid_file: str, sleeper: int, seconds: float, sample):
    """Sleeps on sample ``sleeper`` (recording which process did), then returns its index."""
    if sample.metadata["i"] == sleeper:
        Path(pid_file).write_text(str(os.getpid()))
        time.sleep(seconds)
    return sample.metadata["i"]


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_a_batch_awaited_far_longer_than_recent_ones_is_reported_once(
    dataset, tmp_path, monkeypatch, context
):
    with DataLoader(dataset, BATCH) as loader:
        order = [[s.metadata["i"] for s in b] for b in loader]
    slow = 6  # a batch after several quick ones
    pid_file = tmp_path / "sleeper"
    transform = functools.partial(sleepy, str(pid_file), order[slow][0], 2.0)
    loader = DataLoader(
        dataset, BATCH, num_workers=2, transform=transform, multiprocessing_context=context
    )
    with loader:
        it = iter(loader)
        # The workers' start (seconds with spawn) is awaited under the default rule.
        got = [next(it) for _ in range(slow)]
        workers = it.pids["workers"]
        monkeypatch.setattr(passes, "SLOW_BATCH_FLOOR_S", 0.5)
        with pytest.warns(RuntimeWarning, match="has been awaited for") as caught:
            got += list(it)
    assert got == order
    slow_warnings = [str(w.message) for w in caught if "has been awaited" in str(w.message)]
    assert len(slow_warnings) == 1, slow_warnings  # once per batch, not once per poll
    (message,) = slow_warnings
    sleeper = int(pid_file.read_text())
    assert message.startswith(f"batch {slow} has been awaited for "), message
    assert f"loader worker {workers.index(sleeper)} (pid {sleeper}) holds it" in message, message
    assert "timeout=" in message


def test_the_slow_batch_rule_is_not_triggered_by_ordinary_batches(dataset):
    """The default rule: a floor of a minute, and ten times the recent batch time above it."""
    assert passes.SLOW_BATCH_FLOOR_S == 60.0
    assert passes.SLOW_BATCH_FACTOR == 10.0
    with DataLoader(dataset, BATCH, num_workers=2) as loader:
        assert sum(len(b) for b in loader) == N  # warnings are errors in this suite
