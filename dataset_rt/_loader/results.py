"""Worker results through shared memory: the result region.

Each loader worker has an arena, one anonymous shared file (``memfd``: nothing is named in
/dev/shm, so nothing can leak when a process is killed) that the training process creates and
both map. A worker writes every buffer of a result (bytes, bytearray, memoryview, numpy arrays,
CPU tensors, ``CachedSample.data``, at any nesting) once into the arena, where Rust's
``ResultArena`` says, and sends only the skeleton: a pickle in which each buffer is a small
descriptor (kind, range, offset, size, dtype, shape). The training process maps the arena once
and rebuilds each result as views of it: zero copies there.

A buffer that is already a view of one of the worker's shard maps (``sample.data`` of a record
stored uncompressed, a slice of it, a numpy array over it) is not written at all: Rust's index of
the worker's maps says where it lies (cache, shard, offset; by address, whatever its type), the
descriptor carries that, and the training process rebuilds a read-only view of its own map of
the same shard file. Nothing of the arena is used for it.

A range is busy until nothing in the training process references its mapping any more; then
a finalizer queues its offset, and the loop sends the queue back to the worker at its next
batch. A busy range is never reused, so memory still referenced is never overwritten. A worker
never waits for memory: a buffer that does not fit the free part of the arena is pickled into
the message instead (today's one-copy path) and the loop warns once per pass.

Freed ranges keep their pages, so the next batches write into memory that is already there
(no fresh pages for the kernel to zero). Free written pages beyond what a worker has in flight
(``prefetch_factor`` batches, plus the one the loop holds) are given back: after the loop held
many batches and let them go, Rust's arena names the excess and the worker removes those pages
from the file.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import mmap
import multiprocessing.reduction
import os
import pickle
import socket
import struct
import sys
import weakref
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from dataset_rt import _native
from dataset_rt._native import CachedSample

# Bytes of result memory per loader by default, shared evenly by its workers.
DEFAULT_RESULT_BYTES = 1 << 30
_PAGE = mmap.PAGESIZE
# Offsets per free message: one datagram, well under the socket's buffer.
_FREES_PER_MESSAGE = 4096
_BUFFER_TYPES = (bytes, bytearray, memoryview)


class BatchPickler(pickle.Pickler):
    """Pickles a worker's result; slot views become bytes (the one copy across processes)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, memoryview):
            return bytes, (obj.tobytes(),)
        if isinstance(obj, CachedSample):
            data = obj.data
            return CachedSample, (data if isinstance(data, bytes) else bytes(data), obj.metadata)
        return NotImplemented


def dumps(message: tuple[str, int, Any, list[int]]) -> bytes:
    """A message to the training loop: (tag, batch or worker index, payload, the batch's global
    sample indices)."""
    buffer = io.BytesIO()
    BatchPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(message)
    return buffer.getvalue()


def arena_bytes(result_bytes: int, workers: int) -> int:
    """Each worker's share of ``result_bytes`` in whole pages; 0 = no region."""
    return result_bytes // max(1, workers) // _PAGE * _PAGE


class _SharedFd:
    """A file descriptor given to a worker process: inherited under fork, passed with the
    process's other descriptors under spawn."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        return _rebuild_fd, (multiprocessing.reduction.DupFd(self.fd),)


def _rebuild_fd(dup: Any) -> _SharedFd:
    return _SharedFd(dup.detach())


class RegionOwner:
    """The training process's side of one worker's region: owns the memfd, maps each batch's
    ranges and sends back the ones nothing references any more."""

    def __init__(self, capacity: int, warm_batches: int = 2) -> None:
        self.capacity = capacity
        self.warm_batches = warm_batches
        self.fd = os.memfd_create("dataset-rt-results", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, capacity)  # sparse: pages exist once written
            self._frees, self._worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except BaseException:
            os.close(self.fd)
            raise
        self._frees.setblocking(False)
        # Mapped once for the pass (each mapping of a file holds a descriptor, so one per batch
        # could exhaust them). Shared and writable: numpy and torch hand out ordinary writable
        # arrays without a copy or a warning; a write lands in its batch's own range, which the
        # worker reuses only once nothing here references it.
        self._map: mmap.mmap | None = mmap.mmap(self.fd, capacity)
        # Offsets of ranges no longer referenced; appended by finalizers, at any time.
        self.pending: list[int] = []

    def worker_args(self) -> tuple[_SharedFd, int, socket.socket, int]:
        return _SharedFd(self.fd), self.capacity, self._worker_end, self.warm_batches

    def started(self) -> None:
        """The worker has its copies of the descriptors."""
        self._worker_end.close()

    def load(
        self, ranges: list[tuple[int, int]], stream: io.BytesIO, shards: _native.RingHandle
    ) -> Any:
        """Rebuilds a batch on its ranges. Each range gets a root array; every leaf is a view
        of it (a numpy view, a tensor or memoryview of one), so the root lives exactly as long
        as something of the batch does, and its death frees the range. A leaf the worker sent
        as a shard reference is a view of ``shards``' (the owner handle's) map of the file."""
        import numpy

        arena = self._map
        assert arena is not None, "the region was closed"
        roots = []
        for offset, length in ranges:
            root = numpy.frombuffer(arena, numpy.uint8, length, offset)
            weakref.finalize(root, self.pending.append, offset)
            roots.append(root)
        return _RegionUnpickler(stream, roots, [offset for offset, _ in ranges], shards).load()

    def flush(self) -> None:
        """Sends the queued frees; never blocks (a full socket keeps them for the next call)."""
        pending = self.pending
        while pending:
            count = min(len(pending), _FREES_PER_MESSAGE)
            try:
                self._frees.send(struct.pack(f"<{count}Q", *pending[:count]))
            except BlockingIOError:
                return
            except OSError:  # the worker is gone: nothing to tell
                del pending[:]
                return
            del pending[:count]

    def close(self) -> None:
        """Views handed out stay valid: they keep the mapping alive until they die."""
        self._map = None
        self._frees.close()
        self._worker_end.close()
        os.close(self.fd)


class _RegionUnpickler(pickle.Unpickler):
    def __init__(
        self,
        stream: io.BytesIO,
        roots: list[Any],
        starts: list[int],
        shards: _native.RingHandle,
    ) -> None:
        super().__init__(stream)
        self._roots = roots
        self._starts = starts
        self._shards = shards

    def _shard_views(self, spans: bytes) -> list[memoryview]:
        quads = array("Q")
        quads.frombytes(spans)
        return self._shards.shard_slices(quads.tolist())

    def persistent_load(self, pid: Any) -> Any:
        kind = pid[0]
        if kind == "R":  # a list, every item a shard reference
            views = self._shard_views(pid[1])
            if pid[2] is None:
                return views
            return [CachedSample(v, m) for v, m in zip(views, pickle.loads(pid[2]), strict=True)]
        if kind == "r":
            return self._shard_views(pid[1])[0]
        if kind == "rs":
            return CachedSample(self._shard_views(pid[1])[0], pid[2])
        if kind == "ra":
            import numpy

            view = self._shard_views(pid[1])[0]
            return numpy.frombuffer(view, pid[2]).reshape(pid[3])  # read-only, as the map
        r, offset, n = pid[1], pid[2], pid[3]
        at = offset - self._starts[r]
        part = self._roots[r][at : at + n]
        if kind == "b":
            return memoryview(part).toreadonly()
        if kind == "s":
            return CachedSample(memoryview(part).toreadonly(), pid[4])
        if kind == "a":
            return part.view(pid[4]).reshape(pid[5])
        if kind == "t":
            import torch

            return torch.from_numpy(part).view(pid[4]).view(pid[5])
        if kind == "L":
            layout = array("Q")
            layout.frombytes(pid[4])
            half = len(layout) // 2
            whole = memoryview(part).toreadonly()
            views = [whole[o : o + k] for o, k in zip(layout[:half], layout[half:], strict=True)]
            if pid[5] is None:
                return views
            return [CachedSample(v, m) for v, m in zip(views, pickle.loads(pid[5]), strict=True)]
        raise pickle.UnpicklingError(f"unknown result descriptor {kind!r}")


class RegionWriter:
    """A worker's side of its region: the arena mapped writable, Rust's allocator, and the
    frees from the training process."""

    def __init__(
        self,
        fd: _SharedFd,
        capacity: int,
        frees: socket.socket,
        warm_batches: int = 2,
        shards: _native.RingHandle | None = None,
    ) -> None:
        try:
            self.map = mmap.mmap(fd.fd, capacity)
        finally:
            os.close(fd.fd)
        self.view = memoryview(self.map)
        self._anchor = ctypes.c_char.from_buffer(self.map)  # pins the map: the address holds
        self.base = ctypes.addressof(self._anchor)
        self.capacity = capacity
        self.arena = _native.ResultArena(capacity, warm_batches)
        self.frees = frees
        frees.setblocking(False)
        self.fallback = False
        # The worker's ring handle: its index of the shard maps says which buffers are views
        # of a shard file (they leave as references, not copied).
        self.shards = shards

    def begin(self) -> None:
        """A batch starts: take the frees that arrived, so that it reuses memory just released
        (its pages are warm) before it touches new memory."""
        self.fallback = False
        self.drain()

    def drain(self) -> None:
        while True:
            try:
                data = self.frees.recv(8 * _FREES_PER_MESSAGE)
            except (BlockingIOError, ConnectionError):
                return
            if not data:
                return
            for (offset,) in struct.iter_unpack("<Q", data):
                for start, length in self.arena.free(offset):
                    # Free pages beyond what the next batches reuse go back to the system
                    # (Rust's rule); a later batch there gets fresh zeroed pages, which every
                    # process's map of the file then shows.
                    self.map.madvise(mmap.MADV_REMOVE, start, length)

    def alloc(self, n: int) -> tuple[int, int, memoryview] | None:
        got = self.arena.alloc(n)
        if got is None:
            self.drain()
            got = self.arena.alloc(n)
            if got is None:
                self.fallback = True
                return None
        r, offset = got
        return r, offset, self.view[offset : offset + n]

    def owned(self, address: int, n: int) -> tuple[int, int] | None:
        offset = address - self.base
        if 0 <= offset < self.capacity:
            return self.arena.owned(offset, n)
        return None

    def encode(self, seq: int, result: Any, indices: list[int]) -> bytes:
        """The message of a batch: a header (ranges, whether something fell back, the samples'
        global indices) and the skeleton, one after the other."""
        body = io.BytesIO()
        _RegionPickler(body, self).dump(result)
        ranges = self.arena.finish()
        header = pickle.dumps(
            ("region", seq, (ranges, self.fallback), indices), pickle.HIGHEST_PROTOCOL
        )
        return header + body.getbuffer()

    def shard_spans(self, views: list[memoryview]) -> Any:
        """Where ``views`` lie in the worker's shard maps (packed ``(cache, shard, offset,
        length)`` per view, for the descriptor), or ``None`` unless every one lies wholly inside
        a map (Rust decides, by address)."""
        if self.shards is None or not views:
            return None
        import numpy

        frombuffer, u8 = numpy.frombuffer, numpy.uint8
        buffers = []
        for v in views:
            if not v.c_contiguous or v.nbytes == 0:
                return None
            flat = v if v.format == "B" and v.ndim == 1 else v.cast("B")
            buffers.append((frombuffer(flat, u8).__array_interface__["data"][0], v.nbytes))
        return self.address_spans(buffers)

    def address_spans(self, buffers: list[tuple[int, int]]) -> Any:
        """As :meth:`shard_spans`, for ``(address, length)`` pairs."""
        if self.shards is None:
            return None
        spans = self.shards.shard_spans(buffers)
        return None if spans is None else pickle.PickleBuffer(array("Q", spans).tobytes())

    # ---- the leaves ----

    def put_bytes(self, obj: Any) -> tuple[int, int, int] | None:
        source = memoryview(obj)
        n = source.nbytes
        if n == 0:
            return None
        got = self.alloc(n)
        if got is None:
            return None
        r, offset, target = got
        if source.c_contiguous:
            target[:] = source.cast("B") if source.format != "B" or source.ndim != 1 else source
        else:
            target[:] = source.tobytes()
        return r, offset, n

    def put_list(self, items: list[Any], samples: bool) -> tuple[Any, ...] | None:
        """A list of ``CachedSample`` (a batch without ``transform``) or of bytes-like objects:
        one allocation and one descriptor for all of it (per-item descriptors would cost more
        than pickling small payloads)."""
        if samples:
            if any(type(s) is not CachedSample for s in items):
                return None
            views = [memoryview(s.data) for s in items]
        else:
            if any(type(b) not in _BUFFER_TYPES for b in items):
                return None
            views = [memoryview(b) for b in items]
        metadata = (
            pickle.PickleBuffer(pickle.dumps([s.metadata for s in items], pickle.HIGHEST_PROTOCOL))
            if samples
            else None
        )
        # Views of shard maps (records stored uncompressed) go as one reference descriptor.
        spans = self.shard_spans(views)
        if spans is not None:
            return ("R", spans, metadata)
        if not all(v.c_contiguous for v in views):
            return None
        lengths = [v.nbytes for v in views]
        offsets, end = [], 0
        for n in lengths:
            start = -(-end // 64) * 64
            offsets.append(start)
            end = start + n
        if end == 0:
            return None
        got = self.alloc(end)
        if got is None:
            return None
        r, offset, target = got
        for v, o, n in zip(views, offsets, lengths, strict=True):
            target[o : o + n] = v if v.format == "B" and v.ndim == 1 else v.cast("B")
        layout = pickle.PickleBuffer(array("Q", offsets + lengths).tobytes())
        # Plain bytes inside (pickled in band, not placed): per-int descriptors would be slow.
        return ("L", r, offset, end, layout, metadata)

    def put_array(self, array: Any) -> tuple[Any, ...] | None:
        n = array.nbytes
        if n == 0 or array.dtype.hasobject:
            return None
        if array.flags.c_contiguous:
            address = array.__array_interface__["data"][0]
            got = self.owned(address, n)
            if got is not None:
                return ("a", got[0], got[1], n, array.dtype, array.shape)
            spans = self.address_spans([(address, n)])
            if spans is not None:
                return ("ra", spans, array.dtype, array.shape)
        got3 = self.alloc(n)
        if got3 is None:
            return None
        import numpy

        r, offset, target = got3
        numpy.copyto(numpy.frombuffer(target, array.dtype).reshape(array.shape), array)
        return ("a", r, offset, n, array.dtype, array.shape)

    def put_tensor(self, tensor: Any) -> tuple[Any, ...] | None:
        import torch

        if (
            tensor.device.type != "cpu"
            or tensor.layout != torch.strided
            or tensor.requires_grad
            or tensor.is_nested
            or tensor.is_quantized
        ):
            return None
        count = tensor.numel()
        n = count * tensor.element_size()
        if n == 0:
            return None
        shape = tuple(tensor.shape)
        if tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
            got = self.owned(tensor.data_ptr(), n)
            if got is not None:
                return ("t", got[0], got[1], n, tensor.dtype, shape)
        got3 = self.alloc(n)
        if got3 is None:
            return None
        r, offset, target = got3
        torch.frombuffer(target, dtype=tensor.dtype, count=count).view(shape).copy_(tensor)
        return ("t", r, offset, n, tensor.dtype, shape)


class _RegionPickler(BatchPickler):
    """Pickles a result with its buffers written to the region and replaced by descriptors;
    a buffer that does not fit is pickled as :class:`BatchPickler` does."""

    def __init__(self, stream: io.BytesIO, writer: RegionWriter) -> None:
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self._writer = writer
        numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        # Only exact types: a subclass may carry state that a plain view would lose.
        self._ndarray = getattr(numpy, "ndarray", None)
        self._tensor = getattr(torch, "Tensor", None)

    def persistent_id(self, obj: Any) -> Any:
        kind = type(obj)
        if kind is list and obj:
            first = type(obj[0])
            if first is CachedSample or first in _BUFFER_TYPES:
                return self._writer.put_list(obj, first is CachedSample)
            return None
        if kind is memoryview:
            spans = self._writer.shard_spans([obj])
            if spans is not None:
                return ("r", spans)
        if kind in _BUFFER_TYPES:
            got = self._writer.put_bytes(obj)
            return None if got is None else ("b", *got)
        if kind is CachedSample:
            data = obj.data
            if type(data) is memoryview:
                spans = self._writer.shard_spans([data])
                if spans is not None:
                    return ("rs", spans, obj.metadata)
            got = self._writer.put_bytes(data)
            return None if got is None else ("s", *got, obj.metadata)
        if kind is self._ndarray:
            return self._writer.put_array(obj)
        if kind is self._tensor:
            return self._writer.put_tensor(obj)
        return None


_current: RegionWriter | None = None


@contextlib.contextmanager
def writing(writer: RegionWriter | None) -> Iterator[None]:
    """Makes ``writer`` the target of :func:`result_buffer` while a batch is produced."""
    global _current
    _current = writer
    try:
        yield
    finally:
        _current = None


def result_buffer(nbytes: int) -> memoryview | None:
    """Writable memory for ``nbytes`` of the result being produced, inside a loader worker:
    a buffer built there (``torch.stack(..., out=)``) reaches the training loop without being
    copied. ``None`` outside a worker, for ``nbytes <= 0``, or when the region is full."""
    writer = _current
    if writer is None or nbytes <= 0:
        return None
    got = writer.alloc(nbytes)
    return None if got is None else got[2]


def stack_arrays(items: list[Any]) -> Any:
    """``numpy.stack(items)`` written straight into the result memory (one write, and nothing
    more to copy when the result is sent), or ``None`` when it cannot be: outside a worker, when
    the items are not all plain arrays of one dtype and one shape, or when the region is full.
    The caller then runs ``numpy.stack`` itself, which gives the same values and errors."""
    numpy = sys.modules.get("numpy")
    if _current is None or numpy is None or not items:
        return None
    first = items[0]
    if type(first) is not numpy.ndarray or first.dtype.hasobject:
        return None
    dtype, shape = first.dtype, first.shape
    if any(type(a) is not numpy.ndarray or a.dtype != dtype or a.shape != shape for a in items):
        return None
    buffer = result_buffer(first.nbytes * len(items))
    if buffer is None:
        return None
    out = numpy.frombuffer(buffer, dtype).reshape((len(items), *shape))
    return numpy.stack(items, out=out)


def _plain_array(item: Any, numpy: Any) -> bool:
    return type(item) is numpy.ndarray and not item.dtype.hasobject


def _plain_tensor(item: Any, torch: Any) -> bool:
    return (
        type(item) is torch.Tensor
        and item.layout == torch.strided
        and item.device.type == "cpu"
        and not (item.requires_grad or item.is_nested or item.is_quantized)
        and not (item.is_conj() or item.is_neg())
    )


def stack_as_transformed(
    samples: list[Any],
    transform: Callable[[Any], Any],
    collate_fn: Callable[[list[Any]], Any],
    collate: Callable[[list[Any]], Any],
) -> Any:
    """``collate([transform(s) for s in samples])`` where ``collate_fn`` stacks (``numpy.stack``
    on arrays, ``dataset_rt.torch.default_collate`` on tensors): inside a worker, each sample's
    result is copied into its row of the batch in result memory as soon as the transform
    returns it, and dropped. The worker then holds one sample's result instead of the whole
    batch's (less heap), and the copy reads it while it is still in the CPU's cache. The value
    is the stack's. From the first sample whose result differs from the first one (type, dtype,
    shape), or when the region has no room, the rest goes to ``collate`` as before, the rows
    already written among the items: the same values and errors as without the rows."""
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    first = transform(samples[0])
    count = len(samples)
    out: Any = None
    rows: Any = None
    is_plain: Callable[[Any], bool] = bool
    put: Callable[[Any, int, Any], None] = _put_row
    if _current is not None and count > 1 and numpy is not None:
        if collate_fn is numpy.stack and _plain_array(first, numpy):
            buffer = result_buffer(first.nbytes * count)
            if buffer is not None:
                out = numpy.frombuffer(buffer, first.dtype).reshape((count, *first.shape))
                rows, is_plain = out, lambda item: _plain_array(item, numpy)
        elif torch is not None and _plain_tensor(first, torch) and _is_torch_collate(collate_fn):
            numel = first.numel() * count
            buffer = result_buffer(numel * first.element_size())
            if buffer is not None:
                out = torch.frombuffer(buffer, dtype=first.dtype, count=numel)
                out = out.view(count, *first.shape)
                is_plain = lambda item: _plain_tensor(item, torch)  # noqa: E731
                try:  # numpy copies a row faster than torch, for the dtypes numpy has
                    first.numpy()
                    rows, put = out.numpy(), _put_tensor_row
                except (TypeError, RuntimeError):
                    # Views of the rows, made at once: copy_ into one costs less than out[i] = t.
                    rows, put = out.unbind(0), _copy_row
    if out is None:
        return collate([first, *(transform(s) for s in samples[1:])])
    dtype, shape = first.dtype, first.shape
    put(rows, 0, first)
    del first
    for i in range(1, count):
        item = transform(samples[i])
        if not (is_plain(item) and item.dtype == dtype and item.shape == shape):
            done = [out[j] for j in range(i)]  # of the collate's own kind
            return collate([*done, item, *(transform(s) for s in samples[i + 1 :])])
        put(rows, i, item)
        del item
    return out


def _put_row(rows: Any, i: int, item: Any) -> None:
    rows[i] = item


def _put_tensor_row(rows: Any, i: int, item: Any) -> None:
    rows[i] = item.numpy()


def _copy_row(rows: Any, i: int, item: Any) -> None:
    rows[i].copy_(item)


def _is_torch_collate(collate_fn: Any) -> bool:
    adapter = sys.modules.get("dataset_rt.torch")
    return adapter is not None and collate_fn is getattr(adapter, "default_collate", None)
