"""Reading releases every Python object it makes: a pass leaves nothing behind, in the training
process and in the loader's workers.

Counted with ``sys.getallocatedblocks()`` (the objects allocated by Python's allocator) around
a whole pass, after two warm-up passes. A leak of one object per sample shows as at least ``N``
blocks; caches and free lists make a few dozen either way.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable

from loader_helpers import load, load_lz4, no_leaks  # noqa: F401 (autouse fixture)

from dataset_rt import DataLoader

N = 4096
SLACK = N // 8  # far below one object per sample


def blocks_left_by(one_pass: Callable[[], int]) -> int:
    """Blocks still allocated after a third pass that were not before it."""
    assert one_pass() == N
    assert one_pass() == N
    gc.collect()
    before = sys.getallocatedblocks()
    assert one_pass() == N
    gc.collect()
    return sys.getallocatedblocks() - before


def test_per_sample_iteration_leaves_nothing(tmp_path):
    ds = load(tmp_path / "c", N, shuffle=True)

    def one_pass() -> int:
        return sum(1 for s in ds if len(s.data) > 0)

    assert blocks_left_by(one_pass) < SLACK


def test_iter_batches_leaves_nothing(tmp_path):
    ds = load(tmp_path / "c", N, shuffle=True)

    def one_pass() -> int:
        return sum(len([x for x in b.data if len(x) > 0]) for b in ds.iter_batches(64))

    assert blocks_left_by(one_pass) < SLACK


def test_batch_spans_leave_nothing(tmp_path):
    """The batch form without an object per sample: one array and the shards' views."""
    ds = load(tmp_path / "c", N, shuffle=True)

    def one_pass() -> int:
        return sum(len(b.spans) for b in ds.iter_batches(64) if all(len(x) > 0 for x in b.buffers))

    assert blocks_left_by(one_pass) < SLACK


def test_loader_in_process_leaves_nothing(tmp_path):
    """num_workers=0: raw records are views of the dataset's own shard maps."""
    ds = load(tmp_path / "c", N, shuffle=True)

    def one_pass() -> int:
        loader = DataLoader(ds, batch_size=64, collate_fn=lambda b: [s.data for s in b])
        return sum(len(batch) for batch in loader)

    assert blocks_left_by(one_pass) < SLACK


def test_loader_slot_payloads_leave_nothing(tmp_path):
    """num_workers=0 over LZ4 records: payloads are views of the ring's slots."""
    ds = load_lz4(tmp_path / "c", N, 64, shuffle=True)

    def one_pass() -> int:
        loader = DataLoader(ds, batch_size=64, collate_fn=lambda b: [s.data for s in b])
        return sum(len(batch) for batch in loader)

    assert blocks_left_by(one_pass) < SLACK


def allocated_blocks(sample) -> tuple[int, int]:
    """Runs in a worker: its pid and its allocated blocks after this sample's view was made."""
    assert len(sample.data) > 0
    return os.getpid(), sys.getallocatedblocks()


def test_workers_leave_nothing(tmp_path):
    """Workers slice their own maps of the shards for every sample: what they allocate stays
    flat over a pass instead of growing with the samples each worker handled."""
    ds = load(tmp_path / "c", N, shuffle=True)
    loader = DataLoader(
        ds,
        batch_size=64,
        num_workers=2,
        transform=allocated_blocks,
        collate_fn=list,
        multiprocessing_context="spawn",
    )
    by_worker: dict[int, list[int]] = {}
    for batch in loader:
        for pid, blocks in batch:
            by_worker.setdefault(pid, []).append(blocks)
    assert sum(len(v) for v in by_worker.values()) == N
    for pid, blocks in by_worker.items():
        assert len(blocks) >= N // 4, (pid, len(blocks))
        # From a quarter of this worker's samples (warm) to its last one.
        grown = blocks[-1] - blocks[len(blocks) // 4]
        assert grown < SLACK, (pid, grown, len(blocks))
