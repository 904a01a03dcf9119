"""One pass (one epoch) of the shared-memory loader in the training process, or every pass of
a persistent pipeline: starts the producer and the workers, waits for batches with the checks
that turn a dead, failed or hung party into an exception, puts worker results back in batch order
and hands slots back. What a pass reads, its slot count and size and the state it leaves are the
plan's (Rust, through ``_native.LoaderPlan``).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import multiprocessing.connection
import os
import pickle
import statistics
import subprocess
import time
import warnings
from collections import deque
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from dataset_rt import _native
from dataset_rt._loader import (
    lifecycle,
    lifetimes,
    producer,
    results,
    signals,
    slots,
    workers,
)
from dataset_rt._native import DatasetRTError, LoaderError, RuntimeStateError, WorkerError

if TYPE_CHECKING:
    from dataset_rt._loader.plan import DataLoader

# How often the training loop checks its producer and workers while it waits.
_POLL_S = 0.1

# A batch the training loop has awaited longer than the larger of SLOW_BATCH_FLOOR_S and
# SLOW_BATCH_FACTOR times the median of the workers' recent batch times (the time between two
# results of one worker, over the last _RECENT_BATCHES results) is reported once, with a
# RuntimeWarning naming the worker that holds it: a worker hung in user code keeps its
# heartbeat thread beating, so with timeout=0 the wait would otherwise be silent.
SLOW_BATCH_FLOOR_S = 60.0
SLOW_BATCH_FACTOR = 10.0
_RECENT_BATCHES = 32


class LoaderIterator(Iterator[Any]):
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
        # False in a forked child (lifecycle.forget_in_child): the pass is the parent's.
        self._owned = True
        self._closed = False
        # Set when a later iter(loader) ("iter") or DataLoader.close() ("close") closed this
        # pass before the loop received all of it: its next batch then raises instead of
        # ending the loop quietly, short of an epoch.
        self._cut_short_by: str | None = None
        self._replaced_after: int | None = None
        # Persistent pipeline between passes: the pass was fully received and ended.
        self._idle = False
        self._next = 0
        self._ring: _native.OwnerRing | None = None
        self._producer: subprocess.Popen[bytes] | None = None
        self._workers: list[multiprocessing.process.BaseProcess] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        # Each worker's result memory (None: results are pickled whole).
        self._regions: list[results.RegionOwner | None] = []
        self._warned_fallback = False
        # For the slow-batch warning: each worker's latest batch received this pass and when,
        # the time between two results of one worker (recent ones), the batch warned about.
        self._latest: dict[int, tuple[int, float]] = {}
        self._recent: deque[float] = deque(maxlen=_RECENT_BATCHES)
        self._warned_slow = -1
        # Workers whose pipe is still open, those that said their share of the pass is done,
        # and those that exited after saying so.
        self._open: set[int] = set()
        self._done: set[int] = set()
        # Workers that sent anything since they started (a spawned worker that failed while
        # importing the main module again never did).
        self._heard: set[int] = set()
        self._exited: set[int] = set()
        self._buffer: dict[int, tuple[str, Any, list[int]]] = {}
        # The global indices (rows of samples_metadata) of the batch delivered last, as the
        # producer wrote them into its slot.
        self.last_indices: list[int] = []
        self._fd: int | None = None
        # num_workers=0: the batch delivered last, and the one before it if it was still
        # referenced when the next was asked for (see .lifetimes.hand_back_slots).
        self._held: slots.SlotMap | None = None
        self._kept: slots.SlotMap | None = None
        self._unlinked = False
        self._total = 0
        self._slot_size = 0
        lifecycle.open_passes.add(self)
        _native.reap_shm_leftovers()
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        num_workers = self._num_workers
        given: workers.Functions = (self._transform, self._collate_fn, self._worker_init_fn)
        functions: workers.Functions | bytes = given
        if num_workers and self._context.get_start_method() != "fork":
            # Pickled before anything starts, unpickled by each worker inside the code that
            # reports its failures.
            functions = _pickled(given, self._context.get_start_method())
        # The segments and the producer's private directory, all locked by this process. The
        # plan decides the slot count (num_workers=0: one more slot for the batch still bound
        # to the loop's variable while the loop asks for the next one, see .lifetimes).
        # Each resource is recorded where close() finds it before a Ctrl-C can come between.
        with signals.held():
            self._ring = ring = self._plan.start_pass(
                self._prefetch_factor, self._slot_size_bytes, num_workers, self._persistent
            )
        self._total = ring.total_batches
        self._slot_size = ring.slot_size
        if num_workers == 0:
            self._fd = slots.open_ring(ring.ring_name)
        # The dataset's verified-samples memfd, if shared, is the one descriptor (besides the
        # standard ones) the producer inherits: it attaches to it and closes it.
        verified_fd = ring.verified_fd
        with signals.held():
            self._producer = subprocess.Popen(
                producer.command(self._owner, ring.spec_path),
                stdin=subprocess.DEVNULL,
                pass_fds=() if verified_fd is None else (verified_fd,),
            )
        arena = results.arena_bytes(self._result_bytes, num_workers)
        shard_table = ring.shard_table if num_workers else ""
        for i in range(num_workers):
            # A worker keeps the pages of the batches it has in flight (its share of the ring,
            # and the batch the loop holds) for the next ones; more goes back to the system.
            warm = self._prefetch_factor + 1
            region = results.RegionOwner(arena, warm) if arena else None
            self._regions.append(region)
            receiver, sender = self._context.Pipe(duplex=False)
            process = self._context.Process(
                target=workers.consumer_main,
                args=(
                    ring.ctl_name,
                    shard_table,
                    i,
                    self._owner,
                    functions,
                    sender,
                    None if region is None else region.worker_args(),
                    self._persistent,
                ),
                name=f"dataset-rt-worker-{i}",
                daemon=True,
            )
            with signals.held():
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
                lifecycle.started_workers.add(process)
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
        if self._closed or not self._idle or not self._in_owner():
            return False
        ring = self._ring
        assert ring is not None and self._producer is not None
        try:
            code = self._producer.poll()
            if code is not None:
                raise LoaderError(
                    f"the loader's producer process (pid {self._producer.pid}) "
                    f"{lifecycle.describe_exit(code)} between passes"
                    + (f"; its error: {ring.error_text()}" if ring.error_text() else "")
                    + ": the persistent pipeline is closed, the next iter() starts a new one"
                )
            for i, process in enumerate(self._workers):
                if not process.is_alive():
                    self._receive(i)  # raises the worker's own report when it sent one
                    raise LoaderError(
                        f"loader worker {i} (pid {process.pid}) "
                        f"{lifecycle.describe_exit(process.exitcode)} between passes: the "
                        "persistent pipeline is closed, the next iter() starts a new one"
                    )
            handle = self._plan.restart_pass(ring)
            if handle is None:
                return False
            self._ring = handle
            self._total = handle.total_batches
            self._next = 0
            self._buffer.clear()
            self._warned_fallback = False
            self._latest.clear()
            self._warned_slow = -1
            self._idle = False
            self._plan.commit_pass(handle)
        except BaseException:
            self.close()
            raise
        return True

    def _in_owner(self) -> bool:
        """Whether this process started the pass (``False`` in a forked child)."""
        return self._owned and os.getpid() == self._owner

    def _require_owner(self) -> None:
        if not self._in_owner():
            raise lifecycle.forked_error(self._owner, "DataLoader iterator")

    def _disown(self) -> None:
        """In a forked child (:func:`.lifecycle.forget_in_child`): the pass is the parent's;
        every use raises ``RuntimeStateError`` and closing does nothing."""
        self._owned = False

    def __iter__(self) -> LoaderIterator:
        self._require_owner()
        return self

    def __len__(self) -> int:
        self._require_owner()
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

    def untouched(self) -> bool:
        """Whether this pass is under way and has handed out no batch yet."""
        return not self._closed and not self._idle and self._next == 0 and self._total > 0

    def __next__(self) -> Any:
        # Before anything else: a forked child must not take the parent's batch, nor close the
        # parent's pass on the way out.
        self._require_owner()
        if self._closed:
            cut_short = self._cut_short()
            if cut_short is not None:
                raise cut_short
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
        except Exception as error:
            self.close()
            # DataLoader.close() from another thread, while this one waited for the batch: what
            # failed here (a closed pipe, the ring gone) is its consequence.
            cut_short = self._cut_short()
            if cut_short is not None and not isinstance(error, RuntimeStateError):
                raise cut_short from error
            raise
        except BaseException:
            self.close()
            raise

    def _cut_short(self) -> RuntimeStateError | None:
        """The error for a pass that a later ``iter(loader)`` or ``DataLoader.close()`` closed
        before the loop received all of it; ``None`` for any other pass."""
        if self._cut_short_by == "iter":
            return RuntimeStateError(
                f"this pass of the DataLoader was closed after {self._replaced_after} of its "
                f"{self._total} batches by a later iter(loader): a loader runs one pass at a "
                "time, so iterating it inside its own loop ends the loop's pass. Take an "
                "example batch before the loop, or from a second DataLoader"
            )
        if self._cut_short_by == "close":
            return RuntimeStateError(
                "the DataLoader was closed (DataLoader.close()) during this pass, after the loop "
                f"received {self._next} of its {self._total} batches: the pass cannot go on. "
                "Leave the loop (break) before closing the loader, or close it after the loop"
            )
        return None

    # ---- waiting, with the checks that turn a dead, failed or hung party into an exception ----

    def _check(self, seq: int, started: float) -> None:
        if self._closed:  # by DataLoader.close() from another thread, say
            raise self._cut_short() or LoaderError(
                f"the pass was closed while batch {seq} was awaited"
            )
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
                f"{lifecycle.describe_exit(code)} before writing batch {seq}"
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
                if not self._finished(index):
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
                # Finished: it attached and had no batch left (others are still starting).
                if not process.is_alive() and not self._finished(i):
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
        slot_map, samples, indices = taken
        # None: every payload is a view of a shard map, and the slot is already handed back.
        if slot_map is not None:
            self._held = slots.SlotMap(seq, slot_map)
        batch = workers.apply(samples, self._transform, self._collate_fn, indices)
        self.last_indices = indices
        return batch

    def _release_held(self) -> None:
        """Hands back the slots of the batches the loop has moved past (``num_workers=0``),
        released or kept as :func:`.lifetimes.hand_back_slots` decides."""
        ring = self._ring
        if ring is None:
            return
        kept, self._kept = self._kept, None
        held, self._held = self._held, None
        self._kept = lifetimes.hand_back_slots(ring, held, kept)

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
            tag, t, payload, indices = pickle.load(stream)
            self._heard.add(i)
            if tag == "fatal":
                raise self._worker_failed(i, *payload)
            if tag == "done":
                self._done.add(i)
                continue
            if tag == "region":
                ranges, fell_back = payload
                region = self._regions[i]
                assert region is not None and self._ring is not None
                try:
                    payload = region.load(ranges, stream, self._ring)
                    tag = "ok"
                except DatasetRTError as e:
                    # A shard its buffers view was truncated: raised at this batch's turn, not
                    # now, ahead of the batches before it.
                    payload, tag = e, "raise"
                if fell_back:
                    self._warn_fallback()
            self._buffer[t] = (tag, payload, indices)
            now = time.monotonic()
            latest = self._latest.get(i)
            if latest is not None:
                self._recent.append(now - latest[1])
            self._latest[i] = (t, now)

    def _warn_fallback(self) -> None:
        if not self._warned_fallback:
            self._warned_fallback = True
            share = results.arena_bytes(self._result_bytes, self._num_workers)
            warnings.warn(
                f"the loader's result memory is full (result_bytes={self._result_bytes}, "
                f"{share} bytes per worker): batches the training loop still holds use it, or "
                "a result is larger than a worker's share; buffers that do not fit are pickled "
                "(one more copy). Raise result_bytes or keep fewer batches (warned once per "
                "pass)",
                RuntimeWarning,
                stacklevel=5,  # the loop that called next()
            )

    def _check_slow(self, seq: int, started: float) -> None:
        """Warns once when batch ``seq`` has been awaited far longer than the workers' recent
        batches took (see ``SLOW_BATCH_FLOOR_S``), naming the worker that holds it."""
        waited = time.monotonic() - started
        if seq == self._warned_slow or waited <= SLOW_BATCH_FLOOR_S:
            return
        median = statistics.median(self._recent) if self._recent else 0.0
        bound = max(SLOW_BATCH_FLOOR_S, SLOW_BATCH_FACTOR * median)
        if waited <= bound:
            return
        self._warned_slow = seq
        # A worker takes its tickets in increasing order and sends its results in that order:
        # the one that took batch seq has sent nothing after it yet.
        holders = [
            i
            for i in range(len(self._workers))
            if i not in self._exited and self._latest.get(i, (-1, 0.0))[0] < seq
        ]
        named = ", ".join(f"loader worker {i} (pid {self._workers[i].pid})" for i in holders)
        assert self._ring is not None
        if seq >= self._ring.produced:
            where = "the producer has not written it yet"
        elif len(holders) == 1:
            where = f"{named} holds it and is still running"
        elif holders:
            where = f"one of {named} holds it (none of them has sent a later batch)"
        else:
            where = "no running worker can hold it"
        recent = f"{median:.3g} s" if self._recent else "none yet"
        warnings.warn(
            f"batch {seq} has been awaited for {waited:.1f} s, more than {bound:.1f} s (the "
            f"larger of {SLOW_BATCH_FLOOR_S:g} s and {SLOW_BATCH_FACTOR:g} times the workers' "
            f"recent batch time, {recent}): {where}. A worker hung in transform or collate_fn "
            "keeps beating; timeout= turns such a wait into LoaderError (warned once per batch)",
            RuntimeWarning,
            stacklevel=4,  # the loop that called next()
        )

    def _worker_failed(self, i: int, stage: str, report: str) -> LoaderError:
        pid = self._workers[i].pid
        if stage == "worker_init_fn":
            return WorkerError(f"worker_init_fn raised in loader worker {i} (pid {pid}):\n{report}")
        return LoaderError(f"loader worker {i} (pid {pid}) failed:\n{report}")

    def _finished(self, i: int) -> bool:
        """Whether worker ``i``, which exited, ended as a worker ends: with code 0 after saying
        that its share of the pass is done, or stopped by the producer's failure (whose error
        comes at its batch). Raises the report it sent, if any."""
        self._receive(i)
        if self._workers[i].exitcode != 0:
            return False
        return i in self._done or (self._ring is not None and self._ring.error_text() is not None)

    def _worker_died(self, i: int, when: str) -> LoaderError:
        """The error for worker ``i`` having exited: the one it sent, if any."""
        self._receive(i)  # raises the worker's own report when it sent one
        process = self._workers[i]
        why = ""
        if process.exitcode == 0:
            why = (
                " before its share of the pass was done (code 0 without a report: something in "
                "the worker, the transform or a library it calls, ended the process with "
                "os._exit(0) or exit(0))"
            )
        elif i not in self._heard and self._context.get_start_method() == "spawn":
            why = (
                " before it sent anything; its traceback is on the standard error. A spawned "
                "worker starts by importing the main module again: a script that builds and "
                'iterates the loader at its top level needs `if __name__ == "__main__":` '
                "around that code, as multiprocessing's guide says"
            )
        return LoaderError(
            f"loader worker {i} (pid {process.pid}) "
            f"{lifecycle.describe_exit(process.exitcode)} {when}{why}"
        )

    def _flush_frees(self) -> None:
        for region in self._regions:
            if region is not None and region.pending:
                region.flush()

    def _from_workers(self, seq: int) -> Any:
        started = time.monotonic()
        # The batches the loop let go since the last call go back to their workers now, not
        # only when the loop has to wait: a loop slower than its workers always finds its batch
        # received, and the workers would take fresh memory for every batch meanwhile.
        self._flush_frees()
        while seq not in self._buffer:
            self._flush_frees()
            self._check(seq, started)
            self._check_slow(seq, started)
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
                    if not self._finished(i):
                        raise self._worker_died(i, f"while batch {seq} was awaited")
                    self._exited.add(i)
                else:
                    self._receive(conns[obj])
        tag, payload, indices = self._buffer.pop(seq)
        # The shards of its records may have been truncated since the producer read them
        # ahead: the batch's bytes (and the worker's input) would be zeros, or SIGBUS.
        assert self._ring is not None
        self._ring.check_delivered(indices)
        if tag == "raise":
            raise payload
        if tag == "err":
            raise WorkerError(
                f"transform or collate_fn raised in a loader worker on batch {seq}:\n{payload}"
            )
        self.last_indices = indices
        return payload

    # ---- shutdown ----

    def close(self) -> None:
        """Stops the producer and workers (killing those that do not exit within seconds),
        removes the segments and keeps the state at what the loop received."""
        self.shutdown(lifecycle.EXIT_GRACE_S)

    def replace(self) -> None:
        """Closes the pass for a later ``iter(loader)``: when the loop had not received all of
        it, its next ``next()`` raises ``RuntimeStateError`` rather than ending the loop."""
        if not self._closed and self._in_owner() and (self._next < self._total or not self._ring):
            self._replaced_after = self._next
            self._cut_short_by = "iter"
        self.close()

    def close_by_loader(self) -> None:
        """Closes the pass for ``DataLoader.close()``: when the loop had not received all of
        it, its next ``next()`` (or the one waiting in another thread) raises
        ``RuntimeStateError`` rather than ending the loop short of its epoch."""
        if not self._closed and self._in_owner() and self._next < self._total:
            self._cut_short_by = "close"
        self.close()

    def shutdown(self, grace: float) -> None:
        """Sets the stop flag and wakes every party; waits up to ``grace`` seconds in all for
        the children to exit, then SIGKILLs the rest. No wait is unbounded."""
        if self._closed or not self._in_owner():
            return  # a forked child: the processes, ring and pipes are the parent's
        self._closed = True
        lifecycle.open_passes.discard(self)
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
        lifecycle.stop_children(self._workers, self._producer, grace)
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


def _pickled(functions: workers.Functions, method: str) -> bytes:
    """The pass's functions pickled for workers that do not inherit them (spawn); one that
    cannot be is a ``PicklingError`` naming the argument and what to do instead."""
    try:
        return pickle.dumps(functions)
    except Exception as error:
        names = ("transform", "collate_fn", "worker_init_fn")
        culprit = next(
            (n for n, f in zip(names, functions, strict=True) if not _picklable(f)), None
        )
        what = f"DataLoader.{culprit}" if culprit else "the DataLoader's functions"
        raise pickle.PicklingError(
            f"{what} cannot be sent to {method!r} worker processes, which receive it pickled "
            f"({type(error).__name__}: {error}); define it at a module's top level (not as a "
            "lambda or a nested function), or use multiprocessing_context='fork'"
        ) from error


def _picklable(value: object) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True
