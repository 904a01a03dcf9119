"""Worker results through shared memory: the result region.

Each loader worker has an arena, one anonymous shared file (``memfd``: nothing is named in
/dev/shm, so nothing can leak when a process is killed) that the training process creates and
both map. A worker writes each of a result's own buffers (bytes, bytearray, memoryview, numpy
arrays, CPU tensors, ``CachedSample.data``: the result itself, or what lies in it through lists,
tuples, plain named tuples and dict values) once into the arena, where Rust's ``ResultArena``
says, and sends only the skeleton: a pickle in which each such buffer is a small descriptor
(kind, range, offset, size, dtype, shape, a memoryview's format). The training process maps the
arena once and rebuilds each result as views of it: zero copies there. Everything else, dict
keys and what lies in another object's pickled state (a numpy scalar's or a date's bytes, an
object array's items, a dataclass's fields) included, is pickled as pickle makes it: a
reconstructor gets exactly what it pickled (see :meth:`RegionWriter.skeleton`).

A buffer that is already a view of one of the worker's shard maps (``sample.data`` of a record
stored uncompressed, a slice of it, a numpy array over it) is not written at all: Rust's index of
the worker's maps says where it lies (cache, shard, offset; by address, whatever its type), the
descriptor carries that, and the training process rebuilds a read-only view of its own map of
the same shard file. Nothing of the arena is used for it.

A range is reused only once nothing in the training process references it (the rule and its
mechanism: :mod:`.lifetimes`): the loop sends the queued offsets back to the worker at its next
batch. A worker never waits for memory: a buffer that does not fit the free part of the arena
is pickled into the message instead (today's one-copy path) and the loop warns once per pass.

Freed ranges keep their pages, so the next batches write into memory that is already there
(no fresh pages for the kernel to zero). Free written pages beyond what a worker has in flight
(``prefetch_factor`` batches, plus the one the loop holds) are given back: after the loop held
many batches and let them go, Rust's arena names the excess and the worker removes those pages
from the file.
"""

from __future__ import annotations

import contextlib
import copyreg
import ctypes
import errno
import io
import mmap
import multiprocessing.reduction
import os
import pickle
import socket
import struct
import sys
from array import array
from collections.abc import Callable, Iterator
from typing import Any

from dataset_rt import _native
from dataset_rt._loader import lifetimes
from dataset_rt._native import CachedSample

# Bytes of result memory per loader by default, shared evenly by its workers.
DEFAULT_RESULT_BYTES = 1 << 30
_PAGE = mmap.PAGESIZE
# Offsets per free message: one datagram, well under the socket's buffer.
_FREES_PER_MESSAGE = 4096
_BUFFER_TYPES = (bytes, bytearray, memoryview)


class BatchPickler(pickle.Pickler):
    """Pickles a worker's result; slot views become bytes (the one copy across processes), a
    memoryview of another format or shape a read-only memoryview of them over its bytes."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, memoryview):
            layout = view_layout(obj)
            if layout is None:
                return bytes, (obj.tobytes(),)
            return shaped_view, (obj.tobytes(), *layout)
        # A CachedSample pickles itself: its data as bytes (CachedSample.__reduce__).
        return NotImplemented


def view_layout(view: memoryview) -> tuple[str, tuple[int, ...], Any] | None:
    """How to give ``view``'s bytes back its format and shape: ``None`` for a flat ``B`` view
    (bytes as they are), else ``(format, shape, dtype)``, where ``dtype`` is ``None`` when
    ``memoryview.cast`` takes the format (Python's native single-character ones), else the numpy
    dtype of the format (byte orders, complex, structured formats, empty views), or ``None`` as a
    whole when numpy has none either: the view then arrives flat."""
    fmt, shape = view.format, view.shape or ()
    if fmt == "B" and len(shape) == 1:
        return None
    castable = _CASTABLE.get(fmt) if view.nbytes else False  # no cast to a shape with a 0
    if castable is None:
        try:
            probe: Any = memoryview(bytes(view.itemsize))
            probe.cast(fmt)
            castable = True
        except (TypeError, ValueError):
            castable = False
        _CASTABLE[fmt] = castable
    if castable:
        return fmt, shape, None
    try:
        import numpy

        dtype = numpy.asarray(view).dtype
    except Exception:  # a format numpy does not read either: flat bytes
        return None
    return fmt, shape, dtype


_CASTABLE: dict[str, bool] = {}


def shaped_view(data: Any, fmt: str, shape: tuple[int, ...], dtype: Any) -> memoryview:
    """A read-only memoryview of ``data`` (C-ordered bytes) with ``view_layout``'s format and
    shape."""
    if dtype is None:
        flat: Any = memoryview(data).toreadonly()
        return flat.cast(fmt, shape)  # type: ignore[no-any-return]
    import numpy

    array: Any = numpy.frombuffer(data, dtype).reshape(shape)
    return memoryview(array).toreadonly()


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


def _creating(error: OSError, capacity: int, step: str) -> OSError:
    """``error`` (from making a worker's result memory), saying what was being made, how large,
    and what to change: its errno and type are kept (``MemoryError`` stays an ``OSError``)."""
    limits = {
        errno.EFBIG: " (the process's RLIMIT_FSIZE is lower)",
        errno.ENOMEM: " (the process's RLIMIT_AS, or the machine's memory, is lower)",
        errno.EMFILE: " (the process's RLIMIT_NOFILE is reached)",
    }
    made = type(error)(
        error.errno,
        f"cannot {step} the loader's result memory for one worker, {capacity} bytes "
        f"(DataLoader.result_bytes split among the workers): {error.strerror}"
        f"{limits.get(error.errno or 0, '')}; lower result_bytes (0 pickles results instead) "
        "or raise the limit",
    )
    return made


class RegionOwner:
    """The training process's side of one worker's region: owns the memfd, maps each batch's
    ranges and sends back the ones nothing references any more."""

    def __init__(self, capacity: int, warm_batches: int = 2) -> None:
        self.capacity = capacity
        self.warm_batches = warm_batches
        try:
            self.fd = os.memfd_create("dataset-rt-results", os.MFD_CLOEXEC)
        except OSError as error:
            raise _creating(error, capacity, "create") from None
        try:
            os.ftruncate(self.fd, capacity)  # sparse: pages exist once written
            self._frees, self._worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self._frees.setblocking(False)
            # Mapped once for the pass (each mapping of a file holds a descriptor, so one per
            # batch could exhaust them). Shared and writable: numpy and torch hand out ordinary
            # writable arrays without a copy or a warning; a write lands in its batch's own
            # range, not reused while referenced (.lifetimes).
            self._map: mmap.mmap | None = mmap.mmap(self.fd, capacity)
        except OSError as error:
            self._close_partial()
            raise _creating(error, capacity, "size or map") from None
        except BaseException:
            self._close_partial()
            raise
        # Offsets of ranges no longer referenced; appended by finalizers, at any time.
        self.pending: list[int] = []

    def _close_partial(self) -> None:
        for end in ("_frees", "_worker_end"):
            sock = getattr(self, end, None)
            if sock is not None:
                sock.close()
        os.close(self.fd)

    def worker_args(self) -> tuple[_SharedFd, int, socket.socket, int]:
        return _SharedFd(self.fd), self.capacity, self._worker_end, self.warm_batches

    def started(self) -> None:
        """The worker has its copies of the descriptors."""
        self._worker_end.close()

    def load(
        self, ranges: list[tuple[int, int]], stream: io.BytesIO, shards: _native.OwnerRing
    ) -> Any:
        """Rebuilds a batch on its ranges. Each range gets a root array; every leaf is a view
        of it (a numpy view, a tensor or memoryview of one), so the root's death frees the range
        (:func:`.lifetimes.release_on_death`). A leaf the worker sent as a shard reference is a
        view of ``shards``' (the owner handle's) map of the file."""
        import numpy

        arena = self._map
        assert arena is not None, "the region was closed"
        roots = []
        for offset, length in ranges:
            root = numpy.frombuffer(arena, numpy.uint8, length, offset)
            lifetimes.release_on_death(root, self.pending.append, offset)
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
        shards: _native.OwnerRing,
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
            view = self._shard_views(pid[1])[0]
            return view if len(pid) == 2 else shaped_view(view, *pid[2:])
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
            return memoryview(part).toreadonly() if len(pid) == 4 else shaped_view(part, *pid[4:])
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
        shards: _native.WorkerRing | None = None,
    ) -> None:
        try:
            self.map = mmap.mmap(fd.fd, capacity)
        except OSError as error:
            raise _creating(error, capacity, "map") from None
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
        _RegionPickler(body, protocol=pickle.HIGHEST_PROTOCOL).dump(self.skeleton(result))
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

    def skeleton(self, result: Any) -> Any:
        """``result`` with each of its own buffers written to the region (or found in a shard
        map) and replaced by a :class:`_Ref`: the result itself, and what lies in it through
        lists, tuples, named tuples and the values of dicts (exact types): numpy arrays, CPU
        tensors, ``bytes``, ``bytearray``, ``memoryview``, ``CachedSample``. The containers
        on the way are new ones (sharing and cycles kept); everything else is the result's own
        object, pickled as pickle makes it: dict keys, sets, and what another object's pickled
        state holds (a numpy scalar's bytes, an object array's items, a dataclass's fields),
        whose reconstructors need exactly what they pickled. A buffer that does not fit stays
        as it is (pickled, one more copy)."""
        walk = _Walk(self)
        try:
            return walk.visit(result)
        except (_Cycle, RecursionError):
            # Pickled as it is (what was written is freed with the batch's other ranges).
            return result

    # ---- the leaves ----

    def put_sample(self, sample: CachedSample) -> tuple[Any, ...] | None:
        data = sample.data
        if type(data) is memoryview:
            spans = self.shard_spans([data])
            if spans is not None:
                return ("rs", spans, sample.metadata)
        got = self.put_bytes(data)
        return None if got is None else ("s", *got, sample.metadata)

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

    def put_view(self, view: memoryview) -> tuple[Any, ...] | None:
        """A memoryview: a reference when it lies in a shard map, else written; either way with
        its format and shape unless it is flat bytes."""
        layout = view_layout(view)
        spans = self.shard_spans([view])
        if spans is not None:
            return ("r", spans) if layout is None else ("r", spans, *layout)
        got = self.put_bytes(view)
        if got is None:
            return None
        return ("b", *got) if layout is None else ("b", *got, *layout)

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
            if any(v.format != "B" or v.ndim != 1 for v in views):
                return None  # each view keeps its own format and shape
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


_ATOMS = frozenset({int, float, str, bool, type(None), complex})
_BUSY = object()


class _Cycle(Exception):
    pass


class _Ref:
    """A buffer of a result placed by :meth:`RegionWriter.skeleton`: pickled as ``pid``, its
    descriptor (a persistent id)."""

    __slots__ = ("pid",)

    def __init__(self, pid: Any) -> None:
        self.pid = pid


class _Walk:
    """One walk of :meth:`RegionWriter.skeleton` (a class, not a closure: a closure that calls
    itself is a reference cycle, and would keep each batch's skeleton until a collection)."""

    __slots__ = ("memo", "ndarray", "tensor", "writer")

    def __init__(self, writer: RegionWriter) -> None:
        numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        self.writer = writer
        self.ndarray = getattr(numpy, "ndarray", None)
        self.tensor = getattr(torch, "Tensor", None)
        # id -> what replaces the object; the objects stay alive in the result meanwhile.
        self.memo: dict[int, Any] = {}

    def visit(self, obj: Any) -> Any:
        kind = type(obj)
        if kind in _ATOMS:
            return obj
        memo, writer, visit = self.memo, self.writer, self.visit
        key = id(obj)
        if key in memo:
            got = memo[key]
            if got is _BUSY:  # a tuple that holds itself (through a list or dict)
                raise _Cycle
            return got
        pid: Any = None
        if kind is list:
            if obj:
                first = type(obj[0])
                if first is CachedSample or first in _BUFFER_TYPES:
                    pid = writer.put_list(obj, first is CachedSample)
            if pid is None:
                items: list[Any] = []
                memo[key] = items  # before the items: a list may hold itself
                items.extend([x if type(x) in _ATOMS else visit(x) for x in obj])
                return items
        elif kind is dict:
            values: dict[Any, Any] = {}
            memo[key] = values
            for k, v in obj.items():
                values[k] = v if type(v) in _ATOMS else visit(v)
            return values
        elif kind is tuple or (issubclass(kind, tuple) and _plain_namedtuple(kind, obj)):
            memo[key] = _BUSY
            fields = [x if type(x) in _ATOMS else visit(x) for x in obj]
            new = tuple(fields) if kind is tuple else tuple.__new__(kind, fields)
            memo[key] = new
            return new
        elif kind is bytes or kind is bytearray:
            got = writer.put_bytes(obj)
            pid = None if got is None else ("b", *got)
        elif kind is memoryview:
            pid = writer.put_view(obj)
        elif kind is CachedSample:
            pid = writer.put_sample(obj)
        elif kind is self.ndarray:
            pid = writer.put_array(obj)
        elif kind is self.tensor:
            pid = writer.put_tensor(obj)
        else:
            return obj
        new = obj if pid is None else _Ref(pid)
        memo[key] = new
        return new


_NAMEDTUPLES: dict[type, bool] = {}


def _plain_namedtuple(kind: type, obj: Any) -> bool:
    """Whether ``obj`` is a ``collections.namedtuple`` whose pickled form is its fields alone
    (``cls.__new__(cls, *fields)``, which stores them as they come): nothing of the class
    changes how it pickles or builds, and the instance has no attributes of its own."""
    plain = _NAMEDTUPLES.get(kind)
    if plain is None:
        # The class namedtuple() made: its __new__ runs in a namespace of its own.
        base = next((c for c in kind.__mro__ if _namedtuple_new(vars(c).get("__new__"))), None)
        plain = (
            base is not None
            and kind.__new__ is base.__new__
            and getattr(kind, "__getnewargs__", None) is getattr(base, "__getnewargs__", 0)
            and kind.__reduce_ex__ is object.__reduce_ex__  # type: ignore[comparison-overlap]
            and kind.__reduce__ is object.__reduce__  # type: ignore[comparison-overlap]
            and getattr(kind, "__getstate__", None) is getattr(object, "__getstate__", None)
            and not hasattr(kind, "__setstate__")
            and kind not in copyreg.dispatch_table
        )
        _NAMEDTUPLES[kind] = plain
    return plain and not getattr(obj, "__dict__", None)


def _namedtuple_new(new: Any) -> bool:
    function = getattr(new, "__func__", new)  # a class's __new__ is a staticmethod there
    return str(getattr(function, "__globals__", {}).get("__name__", "")).startswith("namedtuple_")


class _RegionPickler(BatchPickler):
    """Pickles a result's skeleton (:meth:`RegionWriter.skeleton`): each :class:`_Ref` as its
    descriptor, everything else as :class:`BatchPickler` does."""

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _Ref else None


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
    on arrays, a collate registered by :func:`register_tensor_stacking_collate` on tensors, as
    ``dataset_rt.torch.default_collate`` is): inside a worker, each sample's result is copied
    into its row of the batch in result memory as soon as the transform returns it, and dropped.
    The worker then holds one sample's result instead of the whole batch's (less heap), and the
    copy reads it while it is still in the CPU's cache. The value is the stack's. From the first
    sample whose result differs from the first one (type, dtype, shape), or when the region has
    no room, the rest goes to ``collate`` as before, the rows already written among the items:
    the same values and errors as without the rows."""
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


# The collate functions that stack a batch of equal tensors as ``torch.stack`` does (and so may
# be replaced by :func:`stack_as_transformed`'s rows): registered by the module that defines
# them (``dataset_rt.torch`` registers its ``default_collate`` on import), compared by identity.
_TENSOR_STACKING_COLLATES: list[Callable[[list[Any]], Any]] = []


def register_tensor_stacking_collate(collate_fn: Callable[[list[Any]], Any]) -> None:
    """Declares that ``collate_fn`` stacks a batch of equal plain CPU tensors into one tensor
    exactly as ``torch.stack`` does (its values and its errors), so that a worker may write the
    rows into result memory as the transform returns them (:func:`stack_as_transformed`). Only
    this function object is declared: a wrapper of it is not."""
    if not any(collate_fn is known for known in _TENSOR_STACKING_COLLATES):
        _TENSOR_STACKING_COLLATES.append(collate_fn)


def _is_torch_collate(collate_fn: Any) -> bool:
    return any(collate_fn is known for known in _TENSOR_STACKING_COLLATES)
