"""Shuffled reads from a cold page cache: DatasetRT against the disk's own ceiling (issue 24).

The regime is a dataset larger than memory on a local disk: every read of a shuffled epoch is a
page-cache miss, and the rate is decided by how many reads are in flight, not by the CPU. It is
reproduced on any machine, whatever its memory, as follows.

- **Data.** The same samples are written twice, as a flat file (records back to back, plus an
  ``offsets.npy`` index) and as a DatasetRT cache without compression (``ShardCompression()``,
  algo ``"none"``), at 4 KiB and at 128 KiB, ``--gib`` GiB of each (default 4), under
  ``$BENCH_DATA_DIR/cold/<size>``; they are written once and reused by later runs (a stamp file
  records the layout and the storage format). Each record starts with a 32-byte header: a magic
  number, its index, its length and a digest of the rest (crc32 up to 16 KiB; above, the
  wrapping sum of its little-endian 64-bit words, which numpy computes ten times faster), so a
  reader can check every byte of a record without a table.
- **Eviction.** Before every contender, every file of that size (flat file, offsets, every file
  of the cache) is synced and evicted with ``posix_fadvise(POSIX_FADV_DONTNEED)``, and the
  eviction is checked with ``fincore`` (util-linux; ``mincore(2)`` through ctypes where it is
  missing). The pages still resident are reported, and a contender is not measured when more
  than ``--tolerance`` of the files' pages stayed resident (``--allow-resident`` measures
  anyway, for filesystems that cannot evict, such as tmpfs). After the contender, the pages of
  the data files (flat file or shards) that it brought in are counted again: "paged in / read" is
  their bytes over the payload bytes it read, the read-around the kernel did for it (it cannot
  exceed 1/share: at that value the whole file was read). A fault on a memory map reads around
  it up to the device's ``read_ahead_kb`` (reported in the header: 128 KiB by default, 8 MiB on
  some virtual disks) until the kernel sees that the map misses at random; ``pread`` of a
  random record reads the record only.
- **A small share.** Each contender reads K samples (``--samples``, default 20,000 at 4 KiB and
  2,000 at 128 KiB), spread evenly over the file, in a shuffled order, so that no page is read
  twice and nothing read before helps. A default K is lowered where the file is too small for it:
  to at most 1 sample in 16, and to samples at least 128 KiB apart (the kernel's default
  read-around of a fault on a memory map, which would otherwise bring in a later sample's pages
  and make a reader of maps look faster than the regime allows; a larger ``read_ahead_kb`` still
  does, which "paged in / read" shows). The share is the one DatasetRT
  reads under ``ReaderConfig(samples_per_epoch=K)`` (one sample every n/K, from an offset
  drawn from the seed, in a shuffled order: docs/determinism.md), and the flat-file readers take
  the same kind of share from numpy. Each contender in each round has its own seed, so a host
  that caches what was read before (a virtual disk's) does not serve it the samples of another.
- **Every sample is checked** by the loop that receives it: magic, index (against the index
  asked for where the reader says which it is: the flat-file readers, ``Batch.indices``; for the
  others, K distinct indices), length and digest. The check reads every byte of the payload.
- **The ceiling** is the disk itself: ``--threads`` (64) threads issuing ``pread`` of the flat
  file's records, each thread checking what it read. They are Rust threads
  (``io-depth-probe ceiling`` of ``bench/io_depth``, built with cargo on the first run), so no
  interpreter stands between them and the disk. The same reads from Python threads split over
  ``--ceiling-procs`` processes are a contender of their own (``ceiling_py``), and they are the
  ceiling instead with ``--python-ceiling`` or where cargo cannot build the probe; in one
  process the interpreter's lock bounds the rate of 4 KiB records before the disk does. The
  ceiling is measured in every round,
  before that round's contenders, because a virtual disk's rate varies by 2-3x from one second
  to the next; every figure to read is a ratio to the ceiling of its own round, and the table
  gives the median of those per-round ratios over ``--rounds`` rounds (default 3).

Contenders (each in a fresh interpreter; the clock runs from the first request, after the
reader is opened, to the last sample checked, so worker start-up is included; open time and
first sample are reported beside it):

- ``ceiling``: 64 Rust threads of ``pread`` over the flat file;
- ``ceiling_py``: 64 Python threads of ``os.pread`` over the flat file, in one process per core;
- ``torch_w2`` / ``torch_w8``: ``torch.utils.data.DataLoader`` with 2 and 8 workers over a
  map-style dataset that ``os.pread``s a record of the flat file, ``batch_size=64``, the share as
  its sampler, a list collate (skipped, with a note, when torch is not installed);
- ``drt_iter``: ``for sample in dataset`` over a dataset opened with ``ReaderConfig(seed=...,
  samples_per_epoch=K)`` (the library's default ``verify`` unless ``--policy``) and
  ``DatasetRuntime(num_workers=--workers)``, 2 by default as in the other benchmarks;
- ``drt_batches``: the same through ``dataset.iter_batches(64)``;
- ``drt_loader_w0`` / ``drt_loader_w2``: ``dataset_rt.DataLoader(dataset, 64, num_workers=0 or
  2)`` over the same dataset (its default ``producer_threads``).

The steady rate (samples between the arrivals at 10% and 90% of the pass, over the time between
them) leaves out start-up; the headline rate and the ratios use the whole pass.

    cd /tmp && PYTHONPATH=/tmp/bench_site python /work/main/bench/bench_cold.py --gib 4
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import importlib.util
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import common
import numpy as np

CONTENDERS = [
    "ceiling",
    "ceiling_py",
    "ceiling_layout",
    "torch_w2",
    "torch_w8",
    "drt_iter",
    "drt_batches",
    "drt_loader_w0",
    "drt_loader_w2",
]
LABELS = {
    "ceiling": "ceiling: {threads} threads of pread{ceiling_kind}",
    "ceiling_py": "{threads} Python threads of pread in {procs} processes",
    "ceiling_layout": "{threads} threads of pread (Rust) of the cache's own payload bytes",
    "torch_w2": "torch DataLoader, 2 workers, pread",
    "torch_w8": "torch DataLoader, 8 workers, pread",
    "drt_iter": "DatasetRT iter(dataset)",
    "drt_batches": "DatasetRT iter_batches({batch})",
    "drt_loader_w0": "DatasetRT DataLoader, 0 workers",
    "drt_loader_w2": "DatasetRT DataLoader, 2 workers",
}
TORCH = {"torch_w2": 2, "torch_w8": 8}
DEFAULT_SAMPLES = {"4KiB": 20_000, "128KiB": 2_000}
STAMP_VERSION = 1
MAGIC = 0x444C4F435F525444  # b"DTR_COLD" little-endian
HEADER = struct.Struct("<QQQQ")  # magic, index, length, digest of the rest
CRC_MAX = 16 * common.KIB  # records up to this size carry a crc32; larger ones a word sum
PAGE = os.sysconf("SC_PAGE_SIZE")
CACHE_NAME = "bench"  # the DatasetRT cache's name under <size>/drt
PROBE_DIR = Path(__file__).resolve().parent / "io_depth"
PROBE_BIN = PROBE_DIR / "target" / "release" / "io-depth-probe"


# --------------------------------------------------------------------------------------------
# Records


def digest(body: Any, size: int) -> int:
    """The digest a record of ``size`` bytes carries of its body (everything after the header)."""
    if size <= CRC_MAX:
        return zlib.crc32(body)
    return int(np.frombuffer(body, dtype="<u8").sum(dtype=np.uint64))


class CheckError(ValueError):
    pass


def check(data: Any, size: int, index: int | None = None) -> int:
    """Checks one payload (every byte of it) and returns the index it carries."""
    if len(data) != size:
        raise CheckError(f"payload of {len(data)} bytes, expected {size}")
    magic, got, length, dig = HEADER.unpack_from(data)
    if magic != MAGIC or length != size:
        raise CheckError(f"bad header (magic {magic:#x}, length {length}) for index {index}")
    if index is not None and got != index:
        raise CheckError(f"record {got} where {index} was asked for")
    if digest(memoryview(data)[HEADER.size :], size) != dig:
        raise CheckError(f"record {got}: digest mismatch")
    return int(got)


def make_records(first: int, count: int, size: int, seed: int) -> np.ndarray:
    """Records ``first .. first + count`` as one ``(count, size)`` uint8 array."""
    rng = np.random.default_rng([seed, first])
    out = np.frombuffer(bytearray(rng.bytes(count * size)), dtype=np.uint8).reshape(count, size)
    words = out.view("<u8")
    if size <= CRC_MAX:
        digests = np.array([zlib.crc32(row[HEADER.size :]) for row in out], dtype=np.uint64)
    else:
        digests = words[:, HEADER.size // 8 :].sum(axis=1, dtype=np.uint64)
    words[:, 0] = MAGIC
    words[:, 1] = np.arange(first, first + count, dtype=np.uint64)
    words[:, 2] = size
    words[:, 3] = digests
    return out


def share(n: int, k: int, seed: int) -> list[int]:
    """K of n sample indices, one every n/K from an offset drawn from ``seed`` (the share
    DatasetRT's ``samples_per_epoch=K`` reads), in a shuffled order."""
    rng = np.random.default_rng(seed)
    off = int(rng.integers(n))
    t = np.arange(k, dtype=np.int64)
    idx = ((t + 1) * n - off - 1) // k
    return rng.permutation(idx).tolist()


# --------------------------------------------------------------------------------------------
# Data layout under <data-dir>/cold/<size label>/


class Layout:
    def __init__(self, data_dir: Path, label: str, gib: float) -> None:
        self.label = label
        self.size = common.SIZES[label]
        self.gib = gib
        self.count = max(1, int(gib * 2**30) // self.size)
        self.root = data_dir / "cold" / label
        self.flat = self.root / "flat.bin"
        self.offsets = self.root / "offsets.npy"
        self.drt = self.root / "drt"
        # Each sample's payload in the cache's shards: (shard, offset, length, raw length).
        self.spans = self.root / "spans.npy"

    def stamp_text(self, kind: str) -> str:
        return common.stamp_text(kind, STAMP_VERSION, self.count, self.size)

    def ready(self, kind: str) -> bool:
        stamp = self.root / f"{kind}.ok"
        return stamp.exists() and stamp.read_text() == self.stamp_text(kind)

    def mark(self, kind: str) -> None:
        (self.root / f"{kind}.ok").write_text(self.stamp_text(kind))

    def files(self) -> list[Path]:
        """Every file a contender of this size may read."""
        out = [self.flat, self.offsets, self.spans]
        if self.drt.exists():
            out += sorted(p for p in self.drt.rglob("*") if p.is_file())
        return [p for p in out if p.exists()]

    def data_files(self) -> list[Path]:
        """The files that hold the payloads: the flat file and the cache's shards."""
        return [self.flat, *sorted(self.drt.rglob("shards/*.bin"))]

    def chunks(self) -> Iterator[tuple[int, memoryview]]:
        """The flat file's records in order, read a few MiB at a time."""
        per = max(1, 16 * common.MIB // self.size)
        with open(self.flat, "rb", buffering=0) as f:
            for first in range(0, self.count, per):
                n = min(per, self.count - first)
                buf = f.read(n * self.size)
                mv = memoryview(buf)
                for j in range(n):
                    yield first + j, mv[j * self.size : (j + 1) * self.size]


def prepare(lay: Layout, kind: str) -> None:
    """Writes the flat file or the DatasetRT cache (in a subprocess)."""
    if kind == "flat":
        lay.root.mkdir(parents=True, exist_ok=True)
        per = max(1, 64 * common.MIB // lay.size)
        with open(lay.flat, "wb") as f:
            for first in range(0, lay.count, per):
                f.write(make_records(first, min(per, lay.count - first), lay.size, lay.size))
            f.flush()
            os.fsync(f.fileno())
        np.save(lay.offsets, np.arange(lay.count + 1, dtype=np.int64) * lay.size)
    elif kind == "drt":
        drt = common.import_dataset_rt()
        base = common.reset_dir(lay.drt)
        writer = drt.WriterConfig(show_progress=False, shard_compression=drt.ShardCompression())

        class Source:
            name = CACHE_NAME

            def __iter__(self) -> Iterable[Any]:
                for i, p in lay.chunks():
                    yield drt.CacheInput(data=p, metadata={"sample_id": i})

        with drt.DatasetRuntime(num_workers=2) as rt:
            result = rt.from_cache_sources(Source(), base, writer_config=writer)
            if not isinstance(result, drt.CacheSourcesDatasetSuccess):
                raise RuntimeError(result.message)
    else:
        raise ValueError(kind)
    os.sync()
    lay.mark(kind)


# --------------------------------------------------------------------------------------------
# Eviction and residency


def read_ahead_kb(path: Path) -> int | None:
    """``read_ahead_kb`` of the block device holding ``path`` (its disk's, for a partition)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    for queue in (dev / "queue", dev / ".." / "queue"):
        with contextlib.suppress(OSError, ValueError):
            return int((queue / "read_ahead_kb").read_text())
    return None


def evict(paths: Iterable[Path]) -> None:
    """Writes back and drops every page of ``paths`` from the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fincore(paths: list[Path]) -> dict[str, int]:
    """Resident pages per file, from util-linux's ``fincore``."""
    out = subprocess.run(
        ["fincore", "--noheadings", "--raw", "--bytes", "--output", "PAGES,FILE", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    pages: dict[str, int] = {}
    for line in out.splitlines():
        n, _, name = line.partition(" ")
        pages[name] = int(n)
    missing = {str(p) for p in paths} - pages.keys()
    if missing:
        raise RuntimeError(f"fincore did not report {sorted(missing)[:3]}")
    return pages


_libc: Any = None


def resident_mincore(paths: list[Path]) -> dict[str, int]:
    """Resident pages per file, from ``mincore(2)`` on a shared read-only map of each."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
        _libc.mmap.argtypes += [ctypes.c_int, ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    pages: dict[str, int] = {}
    for p in paths:
        size = p.stat().st_size
        if size == 0:
            pages[str(p)] = 0
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, 0x1, 0x01, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {p}")
            try:
                vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore of {p}")
                pages[str(p)] = int((np.frombuffer(vec.raw, dtype=np.uint8) & 1).sum())
            finally:
                _libc.munmap(addr, size)
        finally:
            os.close(fd)
    return pages


def resident(paths: list[Path]) -> tuple[dict[str, int], str]:
    """Resident pages per file, and the tool that counted them."""
    if shutil.which("fincore"):
        with contextlib.suppress(subprocess.CalledProcessError, ValueError, RuntimeError):
            return resident_fincore(paths), "fincore"
    return resident_mincore(paths), "mincore"


def file_pages(paths: list[Path]) -> int:
    return sum((p.stat().st_size + PAGE - 1) // PAGE for p in paths)


def evict_checked(lay: Layout, tolerance: float) -> dict[str, Any]:
    """Evicts every file of ``lay`` (twice if the first try leaves too much) and reports the
    pages still resident; ``ok`` is whether they are within ``tolerance`` of all the pages."""
    files = lay.files()
    total = file_pages(files)
    limit = max(16, int(tolerance * total))
    for attempt in (1, 2):
        evict(files)
        pages, tool = resident(files)
        left = sum(pages.values())
        if left <= limit:
            break
        if attempt == 1:
            os.sync()
    worst = sorted(pages.items(), key=lambda kv: -kv[1])[:3]
    return {
        "resident_pages": left,
        "file_pages": total,
        "limit_pages": limit,
        "ok": left <= limit,
        "tool": tool,
        "worst": [(Path(k).name, v) for k, v in worst if v],
    }


# --------------------------------------------------------------------------------------------
# Contenders, run in a worker process


def steady_rate(stamps: list[float], counts: list[int]) -> float:
    """Samples/s between the arrivals at 10% and 90% of the pass (``stamps[i]``: when the
    ``counts[i]`` samples of item ``i`` arrived)."""
    total = sum(counts)
    if total < 10 or len(stamps) < 3:
        return float("nan")
    cum = np.cumsum(counts)
    a = int(np.searchsorted(cum, 0.1 * total))
    b = int(np.searchsorted(cum, 0.9 * total))
    if b <= a or stamps[b] <= stamps[a]:
        return float("nan")
    return float(cum[b] - cum[a]) / (stamps[b] - stamps[a])


class PreadDataset:
    """Map-style dataset for torch: one ``os.pread`` of the flat file per sample (the descriptor
    opened in each worker)."""

    def __init__(self, path: Path, offsets: np.ndarray) -> None:
        self.path = str(path)
        self.offsets = offsets
        self.fd: int | None = None

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> bytes:
        if self.fd is None:
            self.fd = os.open(self.path, os.O_RDONLY)
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        return os.pread(self.fd, end - start, start)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "fd": None}


def list_collate(batch: list[Any]) -> list[Any]:
    return batch


def read_with_threads(
    path: Path, offs: np.ndarray, idx: list[int], threads: int, size: int
) -> tuple[list[float], list[str]]:
    """``threads`` threads issuing ``os.pread`` of the records ``idx`` of the flat file, each
    record checked: the arrival time of every record, and the errors."""
    fd = os.open(path, os.O_RDONLY)
    it = iter(idx)  # next() on a list iterator is atomic under the GIL
    stamps: list[list[float]] = [[] for _ in range(threads)]
    errors: list[str] = []

    def reader(k: int) -> None:
        mine = stamps[k]
        try:
            for i in it:
                start = int(offs[i])
                data = os.pread(fd, int(offs[i + 1]) - start, start)
                check(data, size, i)
                mine.append(time.perf_counter())
        except Exception as e:
            errors.append(repr(e))

    pool = [threading.Thread(target=reader, args=(k,)) for k in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    os.close(fd)
    return [s for mine in stamps for s in mine], errors


def ceiling_part(
    path: Path, offs: np.ndarray, idx: list[int], threads: int, size: int, go: Any, out: Any
) -> None:
    """One process of the ceiling: waits for the others at ``go``, then reads its records."""
    go.wait()
    out.put(read_with_threads(path, offs, idx, threads, size))


def run_ceiling(lay: Layout, idx: list[int], threads: int, procs: int) -> dict[str, Any]:
    """``threads`` threads of ``os.pread`` in all, split over ``procs`` processes (forked from
    this fresh interpreter, which has no other thread), each reading every ``procs``-th record of
    the share: one interpreter's lock would otherwise bound the rate of small records."""
    import multiprocessing as mp

    t0 = time.perf_counter()
    offs = np.load(lay.offsets)
    open_s = time.perf_counter() - t0
    procs = max(1, min(procs, threads))
    ctx = mp.get_context("fork")
    go = ctx.Barrier(procs + 1)
    out = ctx.Queue()
    parts = [
        ctx.Process(
            target=ceiling_part,
            args=(lay.flat, offs, idx[p::procs], threads // procs, lay.size, go, out),
        )
        for p in range(procs)
    ]
    for part in parts:
        part.start()
    go.wait()
    t1 = time.perf_counter()
    results = [out.get() for _ in parts]
    arrivals = sorted(s for stamps, _ in results for s in stamps)
    t2 = arrivals[-1] if arrivals else time.perf_counter()
    for part in parts:
        part.join()
    errors = [e for _, errs in results for e in errs]
    if errors:
        raise CheckError(errors[0])
    return ceiling_result(open_s, [a - t1 for a in arrivals], t2 - t1, idx)


def ceiling_result(
    open_s: float, arrivals: list[float], pass_s: float, idx: list[int]
) -> dict[str, Any]:
    """A ceiling's answer from the seconds at which each record arrived (sorted, from the first
    request) and the pass's length."""
    return {
        "open_s": open_s,
        "pass_s": pass_s,
        "first_s": arrivals[0] if arrivals else None,
        "steady_samples_per_s": steady_rate(arrivals, [1] * len(arrivals)),
        "checked": len(arrivals),
        "distinct": len(set(idx)),
    }


def build_probe() -> tuple[Path | None, str]:
    """Builds ``bench/io_depth`` (the Rust ceiling) with cargo: its binary, or why there is none."""
    cargo = shutil.which("cargo")
    if cargo is None:
        return None, "cargo is not installed"
    # Its own target directory, whatever CARGO_TARGET_DIR says: the binary is looked for there.
    cmd = [cargo, "build", "--release", "--quiet", "--manifest-path", str(PROBE_DIR / "Cargo.toml")]
    cmd += ["--target-dir", str(PROBE_BIN.parent.parent)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"cargo build of bench/io_depth failed: {tail}"
    if not PROBE_BIN.exists():
        return None, f"cargo build of bench/io_depth made no {PROBE_BIN}"
    return PROBE_BIN, ""


def shard_files(lay: Layout) -> list[Path]:
    """The DatasetRT cache's shard files, in the order of their numbers."""
    cache = lay.drt / CACHE_NAME
    manifest = json.loads((cache / "manifest.json").read_text())
    return [cache / s["file"] for s in manifest["shards"]]


def ensure_spans(lay: Layout) -> None:
    """Saves where each sample's payload lies in the cache's shards (the project's own reading
    of its index and record headers), once: it reads every record header."""
    if lay.spans.exists():
        return
    from dataset_rt import _native

    rows = np.frombuffer(_native.payload_spans(lay.drt / CACHE_NAME), dtype="<i8").reshape(-1, 4)
    if len(rows) != lay.count:
        raise RuntimeError(f"{lay.drt}: expected {lay.count} payload spans, got {len(rows)}")
    if (rows[:, 3] >= 0).any():
        raise RuntimeError(f"{lay.drt}: some payloads are compressed, the benchmark writes raw")
    np.save(lay.spans, rows)


def run_ceiling_rust(
    lay: Layout, idx: list[int], threads: int, probe: Path, layout: bool = False
) -> dict[str, Any]:
    """``threads`` Rust threads of ``pread`` (``io-depth-probe ceiling``) over the records
    ``idx``, each checked as ``check`` does: the disk at that depth, with no interpreter between
    the threads and the reads. The records of the flat file, or with ``layout`` the very payload
    bytes inside the DatasetRT cache's shards (a payload of 4 KiB after its record header spans
    two pages there)."""
    t0 = time.perf_counter()
    at = np.asarray(idx, dtype=np.int64)
    if layout:
        spans = np.load(lay.spans)[at]
        plan = np.stack([spans[:, 0], at, spans[:, 1], spans[:, 2]], axis=1)
        files = shard_files(lay)
    else:
        offs = np.load(lay.offsets)
        plan = np.stack([np.zeros_like(at), at, offs[at], offs[at + 1] - offs[at]], axis=1)
        files = [lay.flat]
    open_s = time.perf_counter() - t0
    with tempfile.NamedTemporaryFile(suffix=".plan") as f:
        f.write(plan.astype("<u8").tobytes())
        f.flush()
        proc = subprocess.run(
            [str(probe), "ceiling", f.name, str(threads), *map(str, files)],
            capture_output=True,
            text=True,
        )
    if proc.returncode != 0:
        raise CheckError((proc.stderr.strip().splitlines() or ["no output"])[-1])
    arrivals = [float(x) for x in proc.stdout.split()]
    return ceiling_result(open_s, arrivals, arrivals[-1] if arrivals else 0.0, idx)


def run_torch(lay: Layout, idx: list[int], workers: int, batch: int) -> dict[str, Any]:
    import torch.utils.data as tud

    t0 = time.perf_counter()
    ds = PreadDataset(lay.flat, np.load(lay.offsets))
    loader = tud.DataLoader(
        ds,  # type: ignore[arg-type]
        batch_size=batch,
        sampler=idx,
        num_workers=workers,
        collate_fn=list_collate,
    )
    open_s = time.perf_counter() - t0
    size = lay.size
    stamps: list[float] = []
    counts: list[int] = []
    pos = 0
    t1 = time.perf_counter()
    for items in loader:
        for data in items:
            check(data, size, idx[pos])
            pos += 1
        stamps.append(time.perf_counter())
        counts.append(len(items))
    t2 = time.perf_counter()
    return {
        "open_s": open_s,
        "pass_s": t2 - t1,
        "first_s": stamps[0] - t1 if stamps else None,
        "steady_samples_per_s": steady_rate(stamps, counts),
        "checked": pos,
        "distinct": len(set(idx)),
    }


def run_drt(name: str, lay: Layout, k: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    drt = common.import_dataset_rt()
    size, batch = lay.size, args.batch_size
    t0 = time.perf_counter()
    runtime = drt.DatasetRuntime(num_workers=args.workers)

    class NameOnly:
        name = CACHE_NAME

    policy = {"verify": args.policy} if args.policy else {}
    result = runtime.from_cache_sources(
        NameOnly(),
        lay.drt,
        reader_config=drt.ReaderConfig(seed=seed, shuffle=True, samples_per_epoch=k, **policy),
        writer_config=drt.WriterConfig(show_progress=False),
    )
    if not isinstance(result, drt.CacheSourcesDatasetSuccess):
        raise RuntimeError(getattr(result, "message", repr(result)))
    dataset = result.dataset
    open_s = time.perf_counter() - t0
    seen: set[int] = set()
    stamps: list[float] = []
    counts: list[int] = []
    n = 0
    t1 = time.perf_counter()
    if name == "drt_iter":
        for sample in dataset:
            seen.add(check(sample.data, size))
            n += 1
            stamps.append(time.perf_counter())
            counts.append(1)
    elif name == "drt_batches":
        for b in dataset.iter_batches(batch):
            for data, i in zip(b.data, b.indices.tolist(), strict=True):
                seen.add(check(data, size, i))
                n += 1
            stamps.append(time.perf_counter())
            counts.append(len(b))
    else:
        workers = int(name.rsplit("_w", 1)[1])
        with drt.DataLoader(dataset, batch, num_workers=workers) as loader:
            for items in loader:
                for sample in items:
                    seen.add(check(sample.data, size))
                    n += 1
                stamps.append(time.perf_counter())
                counts.append(len(items))
    t2 = time.perf_counter()
    runtime.close()
    return {
        "open_s": open_s,
        "pass_s": t2 - t1,
        "first_s": stamps[0] - t1 if stamps else None,
        "steady_samples_per_s": steady_rate(stamps, counts),
        "checked": n,
        "distinct": len(seen),
    }


def worker(name: str, lay: Layout, k: int, seed: int, args: argparse.Namespace) -> dict[str, Any]:
    if name.startswith("torch"):
        import torch  # noqa: F401  (imported before the clock, as a training script has it)
    if name == "ceiling" and args.ceiling_bin:
        out = run_ceiling_rust(lay, share(lay.count, k, seed), args.threads, args.ceiling_bin)
    elif name == "ceiling_layout":
        idx = share(lay.count, k, seed)
        out = run_ceiling_rust(lay, idx, args.threads, args.ceiling_bin, layout=True)
    elif name in ("ceiling", "ceiling_py"):
        out = run_ceiling(lay, share(lay.count, k, seed), args.threads, args.ceiling_procs)
    elif name in TORCH:
        out = run_torch(lay, share(lay.count, k, seed), TORCH[name], args.batch_size)
    else:
        out = run_drt(name, lay, k, seed, args)
    if out["checked"] != k or out["distinct"] != k:
        raise CheckError(f"{out['checked']} samples checked, {out['distinct']} distinct, of {k}")
    return {"contender": name, "size": lay.label, "samples": k, "seed": seed, **out}


# --------------------------------------------------------------------------------------------
# The orchestrator


def run_sub(argv: list[str], timeout: float) -> tuple[dict[str, Any] | None, str]:
    """Runs this script in a fresh interpreter; the last stdout line is its JSON answer."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
        return None, f"exit {proc.returncode}: {tail[-1].strip()[-300:]}".replace("|", "/")
    return json.loads(lines[-1]), proc.stderr


def common_argv(args: argparse.Namespace, label: str) -> list[str]:
    return ["--size", label, "--gib", str(args.gib), "--data-dir", str(args.data_dir)]


def prepare_all(args: argparse.Namespace) -> dict[str, str]:
    errors: dict[str, str] = {}
    drt_needed = any(c.startswith("drt") for c in args.only)
    for label in args.sizes:
        lay = Layout(args.data_dir, label, args.gib)
        for kind in ["flat", "drt"] if drt_needed else ["flat"]:
            if lay.ready(kind):
                continue
            if kind != "flat" and not lay.ready("flat"):
                errors[f"{label}/{kind}"] = "no flat file to copy"
                continue
            print(f"# preparing {label}/{kind} ({lay.count:,} samples)", file=sys.stderr)
            t = time.perf_counter()
            out, err = run_sub(["--prepare", kind, *common_argv(args, label)], 7200)
            if out is None:
                errors[f"{label}/{kind}"] = err
                print(f"#   failed: {err}", file=sys.stderr)
            else:
                print(f"#   {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return errors


READ_AROUND = 128 * common.KIB  # the kernel's default read-ahead (read_ahead_kb)


def max_share(lay: Layout) -> int:
    """The most samples a default K takes of ``lay``: 1 in 16 at most, each at least the
    kernel's read-around away from the next."""
    return max(1, min(lay.count // 16, lay.count * lay.size // (lay.size + READ_AROUND)))


def samples_of(args: argparse.Namespace, lay: Layout) -> int:
    """K: as given by ``--samples`` (at most every sample), else the default within
    ``max_share``."""
    if lay.label in args.samples:
        return min(args.samples[lay.label], lay.count)
    return min(DEFAULT_SAMPLES[lay.label], max_share(lay))


def label_of(name: str, args: argparse.Namespace) -> str:
    kind = " (Rust)" if args.ceiling_bin else f" (Python, in {args.ceiling_procs} processes)"
    return LABELS[name].format(
        threads=args.threads, procs=args.ceiling_procs, batch=args.batch_size, ceiling_kind=kind
    )


def summarise(
    label: str, runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    lay = Layout(args.data_dir, label, args.gib)
    k = samples_of(args, lay)
    ceiling = runs.get("ceiling", [])
    rows: list[dict[str, Any]] = []
    for name, results in runs.items():
        row: dict[str, Any] = {"contender": name, "label": label_of(name, args)}
        ok = [r for r in results if "pass_s" in r]
        row["per_round_samples_per_s"] = [
            k / r["pass_s"] if "pass_s" in r else None for r in results
        ]
        row["failed_rounds"] = [r["error"] for r in results if "error" in r]
        row["resident_before_pages"] = [
            r.get("eviction", {}).get("resident_pages") for r in results
        ]
        if not ok:
            row["error"] = results[0]["error"] if results else "not run"
            rows.append(row)
            continue
        sps = common.median(k / r["pass_s"] for r in ok)
        ratios = [
            a / b
            for a, b in zip(
                row["per_round_samples_per_s"],
                [k / c["pass_s"] if "pass_s" in c else None for c in ceiling],
                strict=False,
            )
            if a and b
        ]
        row.update(
            {
                "samples_per_s": sps,
                "mb_per_s": sps * lay.size / 1e6,
                "x_ceiling": common.median(ratios) if ratios else None,
                "x_ceiling_per_round": ratios,
                "steady_samples_per_s": common.median(r["steady_samples_per_s"] for r in ok),
                "first_sample_ms": common.median(r["first_s"] * 1e3 for r in ok),
                "open_ms": common.median(r["open_s"] * 1e3 for r in ok),
                "paged_in_over_read": common.median(r["paged_in_over_read"] for r in ok),
                "checked": [r["checked"] for r in ok],
                "rounds": len(ok),
            }
        )
        rows.append(row)
    return {
        "size": label,
        "payload_bytes": lay.size,
        "samples": lay.count,
        "read_per_contender": k,
        "gib": lay.count * lay.size / 2**30,
        "rows": rows,
    }


def print_tables(res: dict[str, Any]) -> None:
    print(f"\n## Cold page cache: `{res['command']}`\n")
    m = res["machine"]
    print(
        f"{m['date']}, {m['cores']} cores ({m['cpu']}), {m['memory_gib']} GiB, data on "
        f"{res['fs']}, read_ahead_kb {res['read_ahead_kb']}; page cache evicted before each "
        f"contender ({res['residency_tool']}); "
        f"DatasetRT verify={res['verify']!r}, DatasetRuntime(num_workers={res['workers']}); "
        f"rounds: {res['rounds']}; ratios to the ceiling are taken per round, then the median."
    )
    for note in res["notes"]:
        print(f"\n- {note}")
    for t in res["tables"]:
        print(
            f"\n### {t['size']}: {t['read_per_contender']:,} of {t['samples']:,} samples "
            f"({t['read_per_contender'] / t['samples']:.1%}, of {t['gib']:.2f} GiB), shuffled, "
            "cold\n"
        )
        rows: list[list[Any]] = []
        for r in t["rows"]:
            resident = max((x for x in r["resident_before_pages"] if x is not None), default=None)
            if "error" in r:
                rows.append([r["label"], f"n/a: {r['error'][:100]}", *["-"] * 8, resident])
                continue
            per_round = " / ".join(common.fmt(x) for x in r["per_round_samples_per_s"])
            rows.append(
                [
                    r["label"],
                    r["samples_per_s"],
                    r["mb_per_s"],
                    r["x_ceiling"],
                    per_round,
                    " / ".join(f"{x:.2f}" for x in r["x_ceiling_per_round"]),
                    r["steady_samples_per_s"],
                    r["first_sample_ms"],
                    r["open_ms"],
                    r["paged_in_over_read"],
                    resident,
                ]
            )
        print(
            common.markdown_table(
                [
                    "contender",
                    "samples/s",
                    "MB/s",
                    "x ceiling",
                    "samples/s per round",
                    "x ceiling per round",
                    "steady samples/s",
                    "1st sample ms",
                    "open ms",
                    "paged in / read",
                    "resident before (pages)",
                ],
                rows,
            )
        )


def parse_samples(items: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        label, _, k = item.partition("=")
        if label not in common.SIZES or not k.isdigit() or int(k) < 1:
            raise argparse.ArgumentTypeError(
                f"--samples takes SIZE=K (SIZE in 4KiB 128KiB): {item}"
            )
        out[label] = int(k)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="GiB of samples per size")
    parser.add_argument("--rounds", type=int, default=common.REPEATS)
    parser.add_argument("--data-dir", type=Path, default=common.DATA_DIR)
    parser.add_argument("--sizes", nargs="+", default=list(common.SIZES), choices=common.SIZES)
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    parser.add_argument(
        "--samples",
        nargs="+",
        default=[],
        metavar="SIZE=K",
        help="samples each contender reads (default 4KiB=20000 128KiB=2000, lowered for small "
        "files to 1 in 16 and 128 KiB apart; a given K is taken as is)",
    )
    parser.add_argument("--threads", type=int, default=64, help="threads of the pread ceiling")
    parser.add_argument(
        "--ceiling-procs",
        type=int,
        default=os.cpu_count() or 1,
        help="processes the ceiling's threads are split over (default: one per core)",
    )
    parser.add_argument(
        "--python-ceiling",
        action="store_true",
        help="take the Python threads as the ceiling instead of the Rust probe (bench/io_depth)",
    )
    parser.add_argument("--ceiling-bin", default="", help=argparse.SUPPRESS)
    parser.add_argument("--workers", type=int, default=2, help="DatasetRuntime(num_workers)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument(
        "--policy",
        choices=["always", "once", "never"],
        help="ReaderConfig(verify=) of the DatasetRT contenders (default: the library's default)",
    )
    parser.add_argument("--seed", type=int, default=0, help="base of the per-run seeds")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.001,
        help="share of the files' pages that may stay resident after eviction (at least 16)",
    )
    parser.add_argument(
        "--allow-resident",
        action="store_true",
        help="measure even where eviction failed (tmpfs, tests); the table says how much stayed",
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per contender run")
    parser.add_argument("--results", default="cold", help="name of the JSON in bench/results")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", choices=["flat", "drt"], help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=common.SIZES, help=argparse.SUPPRESS)
    parser.add_argument("--k", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--run-seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        args.samples = parse_samples(args.samples)
    except argparse.ArgumentTypeError as e:
        parser.error(str(e))

    if args.prepare:
        prepare(Layout(args.data_dir, args.size, args.gib), args.prepare)
        print(json.dumps({"ok": True}))
        return {}
    if args.worker:
        lay = Layout(args.data_dir, args.size, args.gib)
        print(json.dumps(worker(args.worker, lay, args.k, args.run_seed, args)))
        return {}

    drt = common.import_dataset_rt()
    t0 = time.perf_counter()
    notes: list[str] = []
    only = list(args.only)
    if "ceiling" not in only:
        only.insert(0, "ceiling")  # every ratio needs the ceiling of its round
    if not args.python_ceiling:
        probe, why = build_probe()
        if probe is None:
            notes.append(
                f"the Rust ceiling is not built ({why}): the Python threads are the ceiling"
            )
        args.ceiling_bin = str(probe or "")
    if not args.ceiling_bin and "ceiling_py" in only:
        only.remove("ceiling_py")  # it is the ceiling itself
    if not args.ceiling_bin and "ceiling_layout" in only:
        only.remove("ceiling_layout")
        notes.append("no Rust probe: the ceiling over the cache's own payload bytes was skipped")
    if importlib.util.find_spec("torch") is None and any(c in TORCH for c in only):
        only = [c for c in only if c not in TORCH]
        notes.append("torch is not installed: its DataLoader contenders were skipped")
    args.only = only
    for label in args.sizes:
        lay = Layout(args.data_dir, label, args.gib)
        k = samples_of(args, lay)
        if label not in args.samples and k < DEFAULT_SAMPLES[label]:
            notes.append(
                f"{label}: K lowered from {DEFAULT_SAMPLES[label]:,} to {k:,} "
                f"({lay.count:,} samples: 1 in 16 at most, 128 KiB apart at least)"
            )
    errors = prepare_all(args)
    if "ceiling_layout" in only:
        for label in args.sizes:
            if errors.get(f"{label}/drt"):
                continue
            try:
                ensure_spans(Layout(args.data_dir, label, args.gib))
            except Exception as e:  # reported in that contender's rows
                errors[f"{label}/spans"] = f"payload spans: {e!r}"
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {c: [] for c in only} for s in args.sizes
    }
    tools: set[str] = set()
    for r in range(args.rounds):
        for si, label in enumerate(args.sizes):
            lay = Layout(args.data_dir, label, args.gib)
            k = samples_of(args, lay)
            for ci, name in enumerate(only):
                store = "drt" if name.startswith("drt") or name == "ceiling_layout" else "flat"
                err = errors.get(f"{label}/flat") or errors.get(f"{label}/{store}")
                if name == "ceiling_layout":
                    err = err or errors.get(f"{label}/spans")
                if err:
                    runs[label][name].append({"error": f"writing its data failed: {err}"})
                    continue
                seed = args.seed + 1000 * r + 100 * si + ci
                ev = evict_checked(lay, args.tolerance)
                tools.add(ev["tool"])
                if not ev["ok"] and not args.allow_resident:
                    msg = (
                        f"eviction failed: {ev['resident_pages']:,} of {ev['file_pages']:,} pages "
                        f"resident (limit {ev['limit_pages']:,}; {ev['worst']})"
                    )
                    runs[label][name].append({"error": msg, "eviction": ev})
                    print(f"#   {label} {name}: NOT MEASURED, {msg}", file=sys.stderr)
                    continue
                argv_w = ["--worker", name, *common_argv(args, label), "--k", str(k)]
                argv_w += ["--run-seed", str(seed), "--threads", str(args.threads)]
                argv_w += ["--ceiling-procs", str(args.ceiling_procs)]
                argv_w += ["--ceiling-bin", args.ceiling_bin] if args.ceiling_bin else []
                argv_w += ["--workers", str(args.workers), "--batch-size", str(args.batch_size)]
                argv_w += ["--policy", args.policy] if args.policy else []
                out, err = run_sub(argv_w, args.timeout)
                if out is None:
                    runs[label][name].append({"error": err, "eviction": ev})
                    print(f"#   {label} {name}: FAILED {err}", file=sys.stderr)
                    continue
                data_files = lay.data_files() if store == "drt" else [lay.flat]
                if store == "drt":
                    data_files = [p for p in data_files if p != lay.flat]
                after, _ = resident(data_files)
                out["paged_in_over_read"] = sum(after.values()) * PAGE / (k * lay.size)
                out["eviction"] = ev
                runs[label][name].append(out)
                print(
                    f"# round {r + 1} {label} {name}: {k / out['pass_s']:,.0f} samples/s, "
                    f"{k * lay.size / out['pass_s'] / 1e6:,.0f} MB/s, "
                    f"{ev['resident_pages']} pages resident before, "
                    f"paged in {out['paged_in_over_read']:.2f}x what was read",
                    file=sys.stderr,
                )
    res: dict[str, Any] = {
        "machine": common.machine_info(),
        "dataset_rt": common.dataset_rt_origin(),
        "fs": common.filesystem_of(args.data_dir),
        "data_dir": str(args.data_dir),
        "command": " ".join(["python", *sys.argv] if argv is None else ["bench_cold.py", *argv]),
        "gib": args.gib,
        "rounds": args.rounds,
        "threads": args.threads,
        "workers": args.workers,
        "batch_size": args.batch_size,
        "verify": args.policy or drt.ReaderConfig().verify,
        "residency_tool": "/".join(sorted(tools)) or "none",
        "read_ahead_kb": read_ahead_kb(args.data_dir),
        "prepare_errors": errors,
        "notes": notes,
        "tables": [summarise(s, runs[s], args) for s in args.sizes],
        "raw": runs,
        "seconds": time.perf_counter() - t0,
    }
    common.write_results(args.results, res)
    print_tables(res)
    return res


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
