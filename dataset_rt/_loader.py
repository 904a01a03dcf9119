"""The shared-memory loader: a Rust producer process fills a ring of batch slots in /dev/shm,
``num_workers`` Python processes run ``transform`` / ``collate_fn`` on zero-copy views of them,
and batches reach the training loop in global order. The ring protocol, the order, the batch
layout and the iterator state are Rust's (``shm/``, ``rust/python/src/loader.rs``); this module
starts and watches processes and moves results.

Lifetimes of the zero-copy views (``CachedSample.data``, a ``memoryview`` into a slot):

- ``num_workers=0``: valid for as long as anything references them, as with torch, also after
  the loader is closed. Each batch is one ``mmap`` of its slot, and its slot goes back to the
  producer only once the training process no longer references that map (no copy), or, for a
  batch the loop keeps past the next one, after the map's pages became a private copy in place
  (same address and bytes: one copy of each kept batch, so memory grows with what is kept, as
  with torch). A slot is never reused while anything can read it. See _release_held.
- ``num_workers>0``: slot views are valid inside ``transform`` / ``collate_fn``. The buffers of
  the result (bytes, bytearray, memoryview, numpy arrays, CPU tensors, ``CachedSample.data``, at
  any nesting) are written once by the worker into its result memory before the slot is
  released (``_regions``). The training loop receives views of that memory: numpy arrays and
  tensors (writable), read-only ``memoryview`` for bytes-like leaves, ``CachedSample`` whose
  ``data`` is such a view; other objects as pickled. They stay valid as long as you hold them,
  also after the pass ends: the memory is reused only once nothing references it. When held
  batches fill ``result_bytes``, buffers that do not fit are pickled (one more copy) with a
  ``RuntimeWarning`` once per pass; nothing waits, nothing is overwritten.

Stopping: a pass still open when the interpreter exits is closed by an ``atexit`` hook that runs
before multiprocessing's own (which would SIGTERM the workers and join them without a bound).
Children never depend on the training script's signal handlers: they reset them at start, and
:meth:`_LoaderIterator.close` stops them with the control segment's stop flag and a futex
wake-up, waits a bounded time, then SIGKILLs what is left.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import io
import json
import mmap
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # registers multiprocessing's exit hook before ours: see the end
import os
import pickle
import subprocess
import sys
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

from dataset_rt import _native, _producer, _regions, _signals
from dataset_rt._native import CachedSample, ConfigError, LoaderError, RingClosed, WorkerError

if TYPE_CHECKING:
    from dataset_rt._dataset import Dataset

__all__ = ["DataLoader"]

SHM_DIR = "/dev/shm"
# Seconds a live producer or worker may show no sign of life before the loop gives up on it.
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
# How often the training loop checks its producer and workers while it waits.
_POLL_S = 0.1
# How long close() lets children exit on their own before killing them: a stopped child that
# is waiting on the ring exits within milliseconds; one inside a long transform is killed.
_EXIT_GRACE_S = 2.0
# The same at interpreter exit, where nothing waits for a result any more.
_AT_EXIT_GRACE_S = 0.5
# How long a SIGKILLed child may take to be reaped (it cannot refuse; this only bounds the join).
_KILL_WAIT_S = 2.0


def _open_ring(name: str) -> int:
    return os.open(os.path.join(SHM_DIR, name), os.O_RDWR)


class _BatchViews:
    """One batch's zero-copy views: slices of a Python-owned ``mmap`` of just its slot (abi3
    has no buffer protocol for Rust). Releasing unmaps it, so a kept view raises ValueError
    and nothing can ever read the slot once it is reused."""

    __slots__ = ("map", "seq", "views", "whole")

    def __init__(self, fd: int, seq: int, slot_offset: int, used: int, entries: list[Any]) -> None:
        self.seq = seq
        self.map = mmap.mmap(fd, used, offset=slot_offset, access=mmap.ACCESS_READ)
        self.whole = memoryview(self.map)
        self.views = [self.whole[offset : offset + length] for offset, length, _ in entries]

    def release(self) -> None:
        """Raises LoaderError when something still exports the slot (numpy.frombuffer of a
        view, say): the slot is then not handed back."""
        for attempt in range(2):
            try:
                for view in self.views:
                    view.release()
                self.whole.release()
                self.map.close()
                return
            except BufferError:
                if attempt == 0:
                    gc.collect()
        raise LoaderError(
            f"a view of batch {self.seq} is still exported (for example numpy.frombuffer of "
            "sample.data is alive) when its ring slot must be reused: copy the bytes "
            "(bytes(sample.data), numpy.array(...)) if they must outlive the batch"
        )


class _SlotMap:
    """The training process's map of one delivered batch's slot (``num_workers=0``): the batch's
    ``sample.data`` views are slices of it, and it is Python's, so they keep it alive."""

    __slots__ = ("map", "seq")

    def __init__(self, seq: int, slot_map: mmap.mmap) -> None:
        self.seq = seq
        self.map = slot_map

    def release(self) -> bool:
        """Unmaps the slot unless something still references the map (a view, a buffer made
        from one such as ``numpy.frombuffer``); says whether it did."""
        try:
            self.map.close()
        except BufferError:
            return False
        return True


_dumps = _regions.dumps


def _apply(
    samples: list[CachedSample],
    transform: Callable[[CachedSample], Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
) -> Any:
    items: list[Any] = samples if transform is None else [transform(s) for s in samples]
    return items if collate_fn is None else collate_fn(items)


def _consumer_main(
    ctl_name: str,
    index: int,
    owner_pid: int,
    transform: Callable[[CachedSample], Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    worker_init_fn: Callable[[int], None] | None,
    conn: multiprocessing.connection.Connection,
    region: tuple[Any, int, Any] | None = None,
    persistent: bool = False,
) -> None:
    """A consumer process: takes tickets, runs the user's functions on zero-copy views, sends
    results (their buffers written to ``region``, the worker's result memory), releases slots.
    Exits with code 0 when the pass ends (``persistent``: waits for the next pass instead), on
    close, or with its owner. Anything else that ends
    it early (a parent that is not the owner, ``worker_init_fn`` raised, a protocol error) is
    sent to the training loop as ``("fatal", index, (stage, traceback))`` before it exits with
    code 1."""
    # The training script's handlers (a SIGTERM handler that ignores the signal) are not ours.
    _signals.reset_inherited()
    try:
        _native.set_parent_death_signal(owner_pid)
    except RingClosed:
        # Never attached, so a silent exit could leave the loop waiting for it: say why.
        with contextlib.suppress(OSError):
            conn.send_bytes(_dumps(("fatal", index, ("loader", traceback.format_exc()))))
        sys.exit(1)
    stage = "loader"
    try:
        ring = _native.RingHandle.attach(ctl_name, index)
        fd = _open_ring(ring.ring_name)
        ring.mark_attached()
        writer = None if region is None else _regions.RegionWriter(*region)
        if worker_init_fn is not None:
            stage = "worker_init_fn"
            worker_init_fn(index)
            stage = "loader"
        while _consume(ring, fd, transform, collate_fn, conn, writer) and persistent:
            ring.wait_next_pass()  # RingClosed once stopped or orphaned
        os.close(fd)
        ring.retire()
    except RingClosed:
        return  # stopped, the owner is gone, or the producer failed: the training loop knows
    except BaseException:
        with contextlib.suppress(OSError):
            conn.send_bytes(_dumps(("fatal", index, (stage, traceback.format_exc()))))
        sys.exit(1)


def _consume(
    ring: _native.RingHandle,
    fd: int,
    transform: Callable[[CachedSample], Any] | None,
    collate_fn: Callable[[list[Any]], Any] | None,
    conn: multiprocessing.connection.Connection,
    writer: _regions.RegionWriter | None,
) -> bool:
    """Processes the pass's tickets; says whether the pass ended (``False``: stop now)."""
    while (seq := ring.take_ticket()) is not None:
        entries = None
        while entries is None:
            entries = ring.wait_batch(seq, 1.0)
        slot_offset, used, items = entries
        views = _BatchViews(fd, seq, slot_offset, used, items)
        try:
            samples = [
                CachedSample(v, meta) for v, (_, _, meta) in zip(views.views, items, strict=True)
            ]
            if writer is None:
                message = _dumps(("ok", seq, _apply(samples, transform, collate_fn)))
            else:
                writer.begin()
                with _regions.writing(writer):
                    result = _apply(samples, transform, collate_fn)
                    message = writer.encode(seq, result)
        except BaseException:
            if writer is not None:
                writer.arena.abort()
            message = _dumps(("err", seq, traceback.format_exc()))
        # Everything that could reference the slot is gone before it is handed back.
        samples = result = []
        try:
            views.release()
        except LoaderError:
            conn.send_bytes(_dumps(("err", seq, traceback.format_exc())))
            return False
        ring.release(seq)
        try:
            conn.send_bytes(message)
        except OSError:  # the training loop closed its end: it is shutting down
            return False
    return True


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


class _LoaderIterator(Iterator[Any]):
    """One pass (one epoch) of a :class:`DataLoader`; with ``persistent_workers``, every pass
    until the loader is closed (see :meth:`_restart`)."""

    def __init__(self, loader: DataLoader) -> None:
        # What the pass needs of its loader, copied: the iterator holds no reference to the
        # loader, so neither keeps the other alive in a cycle. Whichever of the two goes last
        # (`del loader` after `for batch in loader: break`, or `iter(DataLoader(...))` kept
        # alone) ends the pass at once through reference counting, without the cycle collector.
        self._plan = loader._plan
        self._context = loader._context
        self._num_workers = loader.num_workers
        self._prefetch_factor = loader.prefetch_factor
        self._slot_size_bytes = loader.slot_size_bytes
        self._transform = loader.transform
        self._collate_fn = loader.collate_fn
        self._worker_init_fn = loader.worker_init_fn
        self._result_bytes = loader.result_bytes
        self._timeout = loader.timeout
        self._heartbeat_timeout = loader.heartbeat_timeout
        self._persistent = loader.persistent_workers
        self._owner = os.getpid()
        self._closed = False
        # Persistent pipeline between passes: the pass was fully received and ended.
        self._idle = False
        self._next = 0
        self._ring: _native.RingHandle | None = None
        self._producer: subprocess.Popen[bytes] | None = None
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        # Each worker's result memory (None: results are pickled whole).
        self._regions: list[_regions.RegionOwner | None] = []
        self._warned_fallback = False
        # Workers whose pipe is still open, and those that exited cleanly (pass done).
        self._open: set[int] = set()
        self._exited: set[int] = set()
        self._buffer: dict[int, tuple[str, Any]] = {}
        self._fd: int | None = None
        # num_workers=0: the batch delivered last, and the one before it if it was still
        # referenced when the next was asked for (see _release_held).
        self._held: _SlotMap | None = None
        self._kept: _SlotMap | None = None
        self._unlinked = False
        self._total = 0
        self._slot_size = 0
        _open_passes.add(self)
        _native.reap_shm_leftovers()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        workers = self._num_workers
        # The segments and the producer's private directory, all locked by this process. The
        # plan decides the slot count (num_workers=0: one more slot for the batch still bound
        # to the loop's variable while the loop asks for the next one, see _release_held).
        self._ring = ring = self._plan.start_pass(
            self._prefetch_factor, self._slot_size_bytes, workers, self._persistent
        )
        self._total = ring.total_batches
        self._slot_size = ring.slot_size
        if workers == 0:
            self._fd = _open_ring(ring.ring_name)
        self._producer = subprocess.Popen(
            _producer.command(self._owner, ring.spec_path), stdin=subprocess.DEVNULL
        )
        arena = _regions.arena_bytes(self._result_bytes, workers)
        for i in range(workers):
            region = _regions.RegionOwner(arena) if arena else None
            self._regions.append(region)
            receiver, sender = self._context.Pipe(duplex=False)
            process = self._context.Process(
                target=_consumer_main,
                args=(
                    ring.ctl_name,
                    i,
                    self._owner,
                    self._transform,
                    self._collate_fn,
                    self._worker_init_fn,
                    sender,
                    None if region is None else region.worker_args(),
                    self._persistent,
                ),
                name=f"dataset-rt-worker-{i}",
                daemon=True,
            )
            try:
                process.start()
            except BaseException:
                receiver.close()
                raise
            finally:
                sender.close()
                if region is not None:
                    region.started()
            self._workers.append(process)
            self._conns.append(receiver)
            self._open.add(i)
        # Every process runs: only now does the pass use up a loaded state or the epoch.
        self._plan.commit_pass(ring)

    def _restart(self) -> bool:
        """Starts the next pass on this persistent pipeline (its segments, producer and
        workers), as the plan decides it (the next epoch, a loaded state, ``set_epoch``). Says
        ``False``, changing nothing, when this pipeline cannot take it (the last pass was not
        received to its end, or the dataset's weights or reading options changed): the loader
        then starts a fresh one. A process that died since the last pass raises ``LoaderError``
        after closing the pipeline: the next ``iter()`` starts a fresh one."""
        if self._closed or not self._idle or os.getpid() != self._owner:
            return False
        ring = self._ring
        assert ring is not None and self._producer is not None
        try:
            code = self._producer.poll()
            if code is not None:
                raise LoaderError(
                    f"the loader's producer process (pid {self._producer.pid}) "
                    f"{_describe_exit(code)} between passes"
                    + (f"; its error: {ring.error_text()}" if ring.error_text() else "")
                    + ": the persistent pipeline is closed, the next iter() starts a new one"
                )
            for i, process in enumerate(self._workers):
                if not process.is_alive():
                    self._receive(i)  # raises the worker's own report when it sent one
                    raise LoaderError(
                        f"loader worker {i} (pid {process.pid}) "
                        f"{_describe_exit(process.exitcode)} between passes: the persistent "
                        "pipeline is closed, the next iter() starts a new one"
                    )
            handle = self._plan.restart_pass(ring)
            if handle is None:
                return False
            self._ring = handle
            self._total = handle.total_batches
            self._next = 0
            self._buffer.clear()
            self._warned_fallback = False
            self._idle = False
            self._plan.commit_pass(handle)
        except BaseException:
            self.close()
            raise
        return True

    def __iter__(self) -> _LoaderIterator:
        return self

    def __len__(self) -> int:
        return max(0, self._total - self._next) if not self._closed else 0

    @property
    def persistent(self) -> bool:
        """Whether the pipeline lives on between passes (``persistent_workers=True``)."""
        return self._persistent

    @property
    def pids(self) -> dict[str, Any]:
        """The pass's processes: ``{"producer": pid, "workers": [pid, ...]}``."""
        return {
            "producer": self._producer.pid if self._producer else None,
            "workers": [p.pid for p in self._workers],
        }

    @property
    def segment_names(self) -> list[str]:
        """The pass's /dev/shm names (removed once every process has mapped them)."""
        return [self._ring.ctl_name, self._ring.ring_name] if self._ring else []

    @property
    def slot_size(self) -> int:
        """Bytes of one ring slot of this pass."""
        return self._slot_size

    def __next__(self) -> Any:
        if self._closed:
            raise StopIteration
        try:
            self._release_held()
            seq = self._next
            if seq >= self._total:
                if not self._persistent:
                    self.close()
                elif not self._idle:
                    # Everything received: the pipeline waits for the next pass.
                    assert self._ring is not None
                    self._plan.end_pass(self._ring)
                    self._idle = True
                raise StopIteration
            batch = self._inline(seq) if not self._workers else self._from_workers(seq)
            self._await_attach(seq)
            assert self._ring is not None
            self._ring.mark_delivered(seq)
            self._next = seq + 1
            return batch
        except StopIteration:
            raise
        except BaseException:
            self.close()
            raise

    # ---- waiting, with the checks that turn a dead, failed or hung party into an exception ----

    def _check(self, seq: int, started: float) -> None:
        ring = self._ring
        assert ring is not None and self._producer is not None
        if not self._unlinked and ring.all_attached():
            # Every party has mapped the segments and the producer has read its spec: nothing
            # of this loader stays in /dev/shm.
            ring.unlink()
            self._unlinked = True
        ring.check_error(seq)
        code = self._producer.poll()
        if code is not None and seq >= ring.produced:
            ring.check_error(seq)
            raise LoaderError(
                f"the loader's producer process (pid {self._producer.pid}) "
                f"{_describe_exit(code)} before writing batch {seq}"
                + (f"; its error: {ring.error_text()}" if ring.error_text() else "")
            )
        for index, silent in ring.stalls(self._heartbeat_timeout):
            self._check_stall(index, silent, seq)
        timeout = self._timeout
        if timeout > 0 and time.monotonic() - started > timeout:
            raise LoaderError(f"batch {seq} did not arrive within timeout={timeout} s")

    def _check_stall(self, index: int | None, silent: float, seq: int) -> None:
        """A party wrote no heartbeat for longer than ``heartbeat_timeout``: raises unless it
        already exited (the exit checks report a death in its own words)."""
        bound = self._heartbeat_timeout
        if index is None:
            assert self._producer is not None
            if self._producer.poll() is not None:
                return
            party = f"the loader's producer process (pid {self._producer.pid})"
        else:
            process = self._workers[index]
            if not process.is_alive():
                if process.exitcode != 0:
                    raise self._worker_died(index, f"while batch {seq} was awaited")
                return
            party = f"loader worker {index} (pid {process.pid})"
        raise LoaderError(
            f"{party} showed no sign of life for {silent:.1f} s while batch {seq} was awaited "
            f"(heartbeat_timeout={bound} s): it is stopped or hung"
        )

    def _await_attach(self, seq: int) -> None:
        """Waits until every process mapped the segments, then removes their names: from the
        first batch on, nothing of this loader is left in /dev/shm whatever gets killed."""
        started = time.monotonic()
        while not self._unlinked:
            self._check(seq, started)
            for i, process in enumerate(self._workers):
                # Exit code 0: it attached and had no batch left (others are still starting).
                if not process.is_alive() and process.exitcode != 0:
                    raise self._worker_died(i, "while starting")
            if not self._unlinked:
                assert self._ring is not None
                # Woken by each attach (a futex), else back to the checks within _POLL_S.
                self._ring.wait_attached(_POLL_S)

    def _inline(self, seq: int) -> Any:
        ring, fd = self._ring, self._fd
        assert ring is not None and fd is not None
        started = time.monotonic()
        # The training process is the only consumer: its tickets are the batches in order.
        ticket = ring.take_ticket()
        if ticket != seq:
            raise LoaderError(f"took ticket {ticket} for batch {seq}")
        # A batch already written needs no check of the other parties: only waiting does.
        taken = ring.take_batch(seq, 0.0, fd)
        while taken is None:
            self._check(seq, started)
            taken = ring.take_batch(seq, _POLL_S, fd)
        slot_map, samples = taken
        self._held = _SlotMap(seq, slot_map)
        return _apply(samples, self._transform, self._collate_fn)

    def _release_held(self) -> None:
        """Hands back the slots of the batches the loop has moved past (``num_workers=0``).

        A batch's slot goes back with no copy once nothing references its map. The batch
        delivered last is usually still bound to the loop's variable when the next is asked
        for, so if it is referenced it waits one more call; a batch still referenced then is
        kept by the user: its map becomes a private copy in place (same address, same bytes)
        before its slot goes back, so no kept view ever shows the slot's next batch."""
        ring = self._ring
        if ring is None:
            return
        kept, self._kept = self._kept, None
        if kept is not None:
            if kept.release():
                ring.release(kept.seq)
            else:
                ring.release_kept(kept.seq, kept.map)
        held, self._held = self._held, None
        if held is not None:
            if held.release():
                ring.release(held.seq)
            else:
                self._kept = held
                # release_kept reads the map's address through numpy: have it imported now,
                # before memory may run short, rather than by the first copy.
                if "numpy" not in sys.modules:
                    importlib.import_module("numpy")

    def _receive(self, i: int) -> None:
        """Reads everything worker ``i`` has sent: results go to the reorder buffer, a fatal
        error of the worker is raised."""
        conn = self._conns[i]
        while i in self._open and conn.poll():
            try:
                stream = io.BytesIO(conn.recv_bytes())
            except EOFError:
                self._open.discard(i)
                return
            tag, t, payload = pickle.load(stream)
            if tag == "fatal":
                raise self._worker_failed(i, *payload)
            if tag == "region":
                ranges, fell_back = payload
                region = self._regions[i]
                assert region is not None
                payload = region.load(ranges, stream)
                tag = "ok"
                if fell_back:
                    self._warn_fallback()
            self._buffer[t] = (tag, payload)

    def _warn_fallback(self) -> None:
        if not self._warned_fallback:
            self._warned_fallback = True
            share = _regions.arena_bytes(self._result_bytes, self._num_workers)
            warnings.warn(
                f"the loader's result memory is full (result_bytes={self._result_bytes}, "
                f"{share} bytes per worker): batches the training loop still holds use it, or "
                "a result is larger than a worker's share; buffers that do not fit are pickled "
                "(one more copy). Raise result_bytes or keep fewer batches (warned once per "
                "pass)",
                RuntimeWarning,
                stacklevel=5,  # the loop that called next()
            )

    def _worker_failed(self, i: int, stage: str, report: str) -> LoaderError:
        pid = self._workers[i].pid
        if stage == "worker_init_fn":
            return WorkerError(f"worker_init_fn raised in loader worker {i} (pid {pid}):\n{report}")
        return LoaderError(f"loader worker {i} (pid {pid}) failed:\n{report}")

    def _worker_died(self, i: int, when: str) -> LoaderError:
        """The error for worker ``i`` having exited: the one it sent, if any."""
        self._receive(i)  # raises the worker's own report when it sent one
        process = self._workers[i]
        return LoaderError(
            f"loader worker {i} (pid {process.pid}) {_describe_exit(process.exitcode)} {when}"
        )

    def _from_workers(self, seq: int) -> Any:
        started = time.monotonic()
        while seq not in self._buffer:
            for region in self._regions:
                if region is not None and region.pending:
                    region.flush()
            self._check(seq, started)
            conns: dict[Any, int] = {self._conns[i]: i for i in self._open}
            sentinels = {
                p.sentinel: i for i, p in enumerate(self._workers) if i not in self._exited
            }
            if not conns and not sentinels:
                raise LoaderError(f"every loader worker exited before batch {seq} arrived")
            ready = multiprocessing.connection.wait([*conns, *sentinels], timeout=_POLL_S)
            # Pipes before exits: a worker's last words arrive before its death is reported.
            for obj in sorted(ready, key=lambda o: isinstance(o, int)):
                if isinstance(obj, int):
                    i = sentinels[obj]
                    process = self._workers[i]
                    process.join(1.0)  # the sentinel fires just before the exit is reapable
                    if process.exitcode is None:
                        continue
                    if process.exitcode != 0:
                        raise self._worker_died(i, f"while batch {seq} was awaited")
                    self._exited.add(i)
                else:
                    self._receive(conns[obj])
        tag, payload = self._buffer.pop(seq)
        if tag == "err":
            raise WorkerError(
                f"transform or collate_fn raised in a loader worker on batch {seq}:\n{payload}"
            )
        return payload

    # ---- shutdown ----

    def close(self) -> None:
        """Stops the producer and workers (killing those that do not exit within seconds),
        removes the segments and keeps the state at what the loop received."""
        self._shutdown(_EXIT_GRACE_S)

    def _shutdown(self, grace: float) -> None:
        """Sets the stop flag and wakes every party; waits up to ``grace`` seconds in all for
        the children to exit, then SIGKILLs the rest. No wait is unbounded."""
        if self._closed or os.getpid() != self._owner:
            return
        self._closed = True
        _open_passes.discard(self)
        ring = self._ring
        if ring is not None:
            ring.stop()
        if self._held is not None:
            held, self._held = self._held, None
            # Still exported: that mapping lives on with its user; the ring is done anyway.
            with contextlib.suppress(LoaderError):
                held.release()
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + grace
        for process in self._workers:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self._workers:
            if process.is_alive():
                process.kill()
                process.join(_KILL_WAIT_S)
        if self._producer is not None:
            try:
                self._producer.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._producer.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._producer.wait(_KILL_WAIT_S)
        for region in self._regions:
            if region is not None:
                region.close()
        self._regions = []
        if ring is not None:
            ring.unlink()
            self._plan.end_pass(ring)
        self._buffer.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._ring = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


# The passes of this process that are not closed yet.
_open_passes: weakref.WeakSet[_LoaderIterator] = weakref.WeakSet()


def _close_open_passes() -> None:
    """Closes every open pass at interpreter exit. ``atexit`` runs hooks last registered
    first, and ``multiprocessing.util`` (imported above) registered its own before this one: so
    the workers are stopped here, within a bound, before multiprocessing SIGTERMs its daemonic
    children and joins them with no timeout (forever, when a worker inherited a SIGTERM handler
    that ignores the signal)."""
    for loader_pass in list(_open_passes):
        with contextlib.suppress(Exception):
            loader_pass._shutdown(_AT_EXIT_GRACE_S)


atexit.register(_close_open_passes)


def _context(value: str | BaseContext | None) -> Any:
    # Any: typeshed's BaseContext lacks Process, which every concrete context has.
    if value is None:
        # Python's default; where that is forkserver (Linux from 3.14), spawn instead.
        default = multiprocessing.get_start_method()
        return multiprocessing.get_context(default if default in ("fork", "spawn") else "spawn")
    method = value if isinstance(value, str) else value.get_start_method()
    if method not in ("fork", "spawn"):
        raise ConfigError(
            f"invalid DataLoader.multiprocessing_context: {method!r}; use 'fork' or 'spawn'"
        )
    return multiprocessing.get_context(method) if isinstance(value, str) else value


class DataLoader:
    """Batches of a :class:`~dataset_rt.Dataset` through the shared-memory loader (Linux).

    - ``batch_size``: samples per batch; the last may be short unless ``drop_last``. The only
      argument besides ``dataset`` that may be given by position.
    - ``num_workers``: processes running ``transform`` (per sample) and ``collate_fn`` (per
      batch); ``0`` runs them in the training process on zero-copy views.
    - ``collate_fn``: ``None`` yields each batch as a list.
    - ``prefetch_factor``: ring slots per worker (at least 2 slots in all, plus one with
      ``num_workers=0``): how far the producer may run ahead of the training loop.
    - With ``num_workers=0``, ``sample.data`` views stay valid as long as they are referenced
      (a batch kept past the next one is copied once when its slot is reused).
    - ``slot_size_bytes``: bytes of one slot; ``None`` sizes slots from the data, so that a
      batch of the dataset's largest samples fits. A batch that does not fit an explicit size
      raises ``LoaderError`` naming both sizes (it is never truncated).
    - ``multiprocessing_context``: ``"fork"``, ``"spawn"`` or a context; ``None`` = Python's.
    - ``timeout``: seconds to wait for one batch (``0`` = no limit).
    - ``heartbeat_timeout``: seconds the producer or a worker may show no sign of life (stopped,
      hung) before ``LoaderError``; a slow ``transform`` is no such sign (see ``timeout``).
    - ``worker_init_fn``: called with the worker index at the start of each worker.
    - ``producer_threads``: threads of the producer process that read, verify and decompress
      samples ahead of the batch being written (up to ``ReaderConfig.prefetch_size`` samples and
      64 MiB of decompressed LZ4 payloads); ``None`` = ``min(4, available cores)``. Batches keep
      the global order whatever the count.
    - ``result_bytes``: shared memory for the workers' results, split evenly among them
      (``None`` = 1 GiB; ``0`` pickles every result instead). Buffers in results travel through
      it without copies in the training process; see the module's notes on their lifetime.
    - ``persistent_workers``: keep the producer, the workers, the ring and the result memory
      between epochs (needs ``num_workers > 0``, as torch's); they stop with :meth:`close`,
      ``with``, the loader's deletion or the interpreter's exit. A pass left before its end
      (``break``) is closed at the next ``iter(loader)``, which starts a fresh pipeline.

    Each ``iter(loader)`` is one epoch (the next one, or the one a loaded state resumes).
    :meth:`state_dict` reflects the batches the training loop has received.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        *,
        num_workers: int = 0,
        transform: Callable[[CachedSample], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        prefetch_factor: int = 2,
        slot_size_bytes: int | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        timeout: float = 0.0,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        worker_init_fn: Callable[[int], None] | None = None,
        producer_threads: int | None = None,
        result_bytes: int | None = None,
        persistent_workers: bool = False,
    ) -> None:
        # /dev/shm, futexes and prctl: checked first, before anything else could fail oddly.
        if not sys.platform.startswith("linux"):
            raise ConfigError("the shared-memory loader needs Linux")
        from dataset_rt._dataset import require_dataset

        require_dataset(dataset, "dataset_rt.DataLoader")
        checks = [
            ("batch_size", batch_size, 1),
            ("num_workers", num_workers, 0),
            ("prefetch_factor", prefetch_factor, 1),
        ]
        if slot_size_bytes is not None:
            checks.append(("slot_size_bytes", slot_size_bytes, 1))
        if result_bytes is not None:
            checks.append(("result_bytes", result_bytes, 0))
        for name, value, low in checks:
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ConfigError(f"invalid DataLoader.{name}: {value!r} is not an int >= {low}")
        if not isinstance(persistent_workers, bool):
            raise ConfigError(
                f"invalid DataLoader.persistent_workers: {persistent_workers!r} is not a bool"
            )
        if persistent_workers and num_workers == 0:
            # torch's own check and words.
            raise ConfigError("persistent_workers option needs num_workers > 0")
        if timeout < 0:
            raise ConfigError(f"invalid DataLoader.timeout: {timeout!r} is negative")
        if (
            isinstance(heartbeat_timeout, bool)
            or not isinstance(heartbeat_timeout, (int, float))
            or not heartbeat_timeout > 0  # NaN included
        ):
            raise ConfigError(
                f"invalid DataLoader.heartbeat_timeout: {heartbeat_timeout!r} is not positive"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.transform = transform
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.prefetch_factor = prefetch_factor
        self.slot_size_bytes = slot_size_bytes
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.result_bytes = _regions.DEFAULT_RESULT_BYTES if result_bytes is None else result_bytes
        self._context = _context(multiprocessing_context)
        self._plan = _native.LoaderPlan(dataset._native, batch_size, drop_last, producer_threads)
        self.producer_threads = self._plan.producer_threads
        self._iterator: _LoaderIterator | None = None

    def __iter__(self) -> _LoaderIterator:
        iterator = self._iterator
        if iterator is not None and iterator.persistent and iterator._restart():
            return iterator
        self.close()
        self._iterator = _LoaderIterator(self)
        return self._iterator

    def __len__(self) -> int:
        """Batches per epoch of this rank."""
        return len(self._plan)

    def set_epoch(self, epoch: int) -> None:
        """Makes the next ``iter(loader)`` read ``epoch`` from its start; the state describes
        that start from now on (``ConfigError`` for a negative epoch)."""
        self._plan.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The dataset's state format at the batches the training loop has received: resume it
        with another ``num_workers``, ``batch_size`` or world size."""
        state: dict[str, Any] = json.loads(self._plan.state_json())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next ``iter(loader)`` continue at the exact next sample of ``state``."""
        self._plan.load_state_json(json.dumps(state))

    def close(self) -> None:
        """Stops the current pass's processes (with ``persistent_workers``, the pipeline's)
        and removes its segments."""
        if self._iterator is not None:
            self._iterator.close()
            self._iterator = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
