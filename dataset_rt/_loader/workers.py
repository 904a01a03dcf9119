"""The loader's worker processes (consumers): each takes tickets, runs the user's ``transform``
and ``collate_fn`` on zero-copy views of a slot, writes the result's buffers into its result
memory (:mod:`.results`), sends the skeleton and releases the slot."""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

from dataset_rt import _native
from dataset_rt._loader import results, signals, slots
from dataset_rt._native import (
    CachedSample,
    CacheMalformedError,
    CorruptRecordError,
    LoaderError,
    RingClosed,
)

# A worker's transform, collate_fn and worker_init_fn.
Functions = tuple[
    Callable[[CachedSample], Any] | None,
    Callable[[list[Any]], Any] | None,
    Callable[[int], None] | None,
]


def apply(
    samples: list[CachedSample],
    transform: Callable[[CachedSample], Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    indices: list[int] | None = None,
) -> Any:
    """``collate_fn([transform(s) for s in samples])``. An exception that a sample's transform
    raised gets a note naming that sample (with its global index, from ``indices``)."""
    try:
        if transform is not None and collate_fn is not None and samples:
            return results.stack_as_transformed(
                samples, transform, collate_fn, lambda items: collate(items, collate_fn)
            )
        items: list[Any] = samples if transform is None else [transform(s) for s in samples]
        if collate_fn is None:
            return items
        return collate(items, collate_fn)
    except Exception as error:
        if transform is not None:
            name_failed_sample(error, samples, indices)
        raise


def name_failed_sample(
    error: BaseException, samples: list[CachedSample], indices: list[int] | None
) -> None:
    """Adds a note to ``error`` naming the sample of ``samples`` whose transform raised it: the
    sample held by the deepest frame of its traceback that holds one (the transform's own, or
    the loop that called it). Costs nothing until a transform raises; adds nothing when no
    frame holds a sample (a collate_fn's error), or before Python 3.11 (no notes)."""
    add_note = getattr(error, "add_note", None)
    if add_note is None:
        return
    positions = {id(s): i for i, s in enumerate(samples)}
    found = None
    tb = error.__traceback__
    while tb is not None:
        for value in tb.tb_frame.f_locals.values():
            i = positions.get(id(value))
            if i is not None and value is samples[i]:
                found = i
                break
        tb = tb.tb_next
    if found is None:
        return
    try:
        sample_id = samples[found].metadata.get("sample_id")
    except Exception:  # the note is best effort; the error is what matters
        sample_id = None
    named = []
    if indices is not None and found < len(indices):
        named.append(f"global index {indices[found]}")
    if sample_id is not None:
        named.append(f"sample_id {sample_id!r}")
    which = f" ({', '.join(named)})" if named else ""
    add_note(f"raised by the transform of sample {found} of its batch{which}")


def collate(items: list[Any], collate_fn: Callable[[list[Any]], Any]) -> Any:
    """``collate_fn(items)``; ``numpy.stack`` writes straight into result memory in a worker."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and collate_fn is numpy.stack:
        # The common collate of arrays: stacked where the training loop will read it.
        stacked = results.stack_arrays(items)
        if stacked is not None:
            return stacked
    return collate_fn(items)


def one_torch_thread() -> None:
    """One torch intra-op thread in this worker when torch is imported, as torch's own
    DataLoader sets in its workers: the workers are the parallelism, more threads only fight
    over the cores, and a worker forked from a training process that already used torch's
    thread pool can deadlock in its first parallel op otherwise. ``worker_init_fn``, which runs
    after this, may raise the count again. Never imports torch."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def consumer_main(
    ctl_name: str,
    shard_table: str,
    index: int,
    owner_pid: int,
    functions: Functions | bytes,
    conn: multiprocessing.connection.Connection,
    region: tuple[Any, int, Any] | None = None,
    persistent: bool = False,
) -> None:
    """A consumer process: takes tickets, runs the user's functions on zero-copy views (of the
    slot, or of the shard files named by ``shard_table``, the owner handle's), sends
    results (their buffers written to ``region``, the worker's result memory), releases slots.
    Exits with code 0 when the pass ends (``persistent``: waits for the next pass instead), on
    close, or with its owner; at the end of its last pass it first sends ``("done", index, None,
    [])``, so that an exit with code 0 without it (``os._exit(0)`` in user code) is a death, not
    the end of its share. Anything else that ends
    it early (a parent that is not the owner, ``worker_init_fn`` raised, a protocol error) is
    sent to the training loop as ``("fatal", index, (stage, traceback), [])`` before it exits with
    code 1."""
    # A forked worker holds copies of the training process's descriptors: user code never gets
    # the dataset's verified-samples memfd (with spawn it was closed on exec).
    _native.close_inherited_fds()
    # The training script's handlers (a SIGTERM handler that ignores the signal) are not ours.
    signals.reset_inherited()
    try:
        _native.set_parent_death_signal(owner_pid)
    except RingClosed:
        # Never attached, so a silent exit could leave the loop waiting for it: say why.
        with contextlib.suppress(OSError):
            report = ("loader", traceback.format_exc())
            conn.send_bytes(results.dumps(("fatal", index, report, [])))
        sys.exit(1)
    # A transform that makes new arrays per sample reuses the last batch's warm heap pages.
    _native.retain_worker_heap()
    stage = "loader"
    try:
        # Spawned, the user's functions arrive pickled and are unpickled here, where a failure
        # (a transform defined in a `python -c` script) is reported with its traceback.
        unpacked: Functions = pickle.loads(functions) if isinstance(functions, bytes) else functions
        transform, collate_fn, worker_init_fn = unpacked
        ring = _native.WorkerRing.attach(ctl_name, index, shard_table)
        fd = slots.open_ring(ring.ring_name)
        ring.mark_attached()
        writer = None if region is None else results.RegionWriter(*region, shards=ring)
        one_torch_thread()
        if worker_init_fn is not None:
            stage = "worker_init_fn"
            worker_init_fn(index)
            stage = "loader"
        while consume(ring, fd, transform, collate_fn, conn, writer) and persistent:
            ring.wait_next_pass()  # RingClosed once stopped or orphaned
        os.close(fd)
        ring.retire()
        with contextlib.suppress(OSError):  # the training loop closed its end: it is done too
            conn.send_bytes(results.dumps(("done", index, None, [])))
    except RingClosed:
        return  # stopped, the owner is gone, or the producer failed: the training loop knows
    except BaseException:
        with contextlib.suppress(OSError):
            report = (stage, traceback.format_exc())
            conn.send_bytes(results.dumps(("fatal", index, report, [])))
        sys.exit(1)


def consume(
    ring: _native.WorkerRing,
    fd: int,
    transform: Callable[[CachedSample], Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    conn: multiprocessing.connection.Connection,
    writer: results.RegionWriter | None,
) -> bool:
    """Processes the pass's tickets; says whether the pass ended (``False``: stop now)."""
    while (seq := ring.take_ticket()) is not None:
        entries = None
        try:
            while entries is None:
                entries = ring.wait_batch(seq, 1.0)
        except (CacheMalformedError, CorruptRecordError, OSError) as error:
            # The batch's shards failed their check here (replaced or cut short since the
            # dataset was opened): the training loop raises this error, as it is, at the
            # batch's turn, as it raises the producer's.
            conn.send_bytes(results.dumps(("raise", seq, error, [])))
            return False
        slot_offset, used, items, indices = entries
        views = slots.BatchViews(fd, seq, slot_offset, used, items)
        try:
            samples = [
                CachedSample(v, meta) for v, (_, _, meta, _) in zip(views.views, items, strict=True)
            ]
            if writer is None:
                result = apply(samples, transform, collate_fn, indices)
                message = results.dumps(("ok", seq, result, indices))
            else:
                writer.begin()
                with results.writing(writer):
                    result = apply(samples, transform, collate_fn, indices)
                    message = writer.encode(seq, result, indices)
        except BaseException:
            if writer is not None:
                writer.arena.abort()
            message = results.dumps(("err", seq, traceback.format_exc(), indices))
        # Everything that could reference the slot is gone before it is handed back.
        samples = result = []
        try:
            views.release()
        except LoaderError:
            conn.send_bytes(results.dumps(("err", seq, traceback.format_exc(), indices)))
            return False
        ring.release(seq)
        try:
            conn.send_bytes(message)
        except OSError:  # the training loop closed its end: it is shutting down
            return False
    return True
