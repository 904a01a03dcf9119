"""The shared-memory loader against torch's DataLoader and its peers, with worker processes.
One script, one run, every figure a median over ``--repeats`` rounds.

Workloads (batches of 64, shuffled, the page cache warm):

- ``decode``: PNG images (128x128 RGB, ~33 KB, made with Pillow at bench time); the transform,
  run in the loader's workers, decodes one with Pillow into a numpy array and returns the sum of
  its pixels (an int: decoding is the work, nothing large is shipped back);
- ``4KiB`` / ``128KiB``: the training process needs the raw bytes (GPU decoding, say): each
  loader hands it every payload and the loop body reads ``len()`` and the first byte;
- ``arrays``: decoded arrays: each payload is a raw 3x224x224 uint8 image (150,528 bytes); the
  transform views it with numpy and flips it (a copy: a cheap stand-in for decoding), and the
  loader collates the 64 arrays into one batch array (tensor); the loop reads one element.

Contenders (a contender's key names its ``num_workers``):

- ``drt_w0`` / ``drt_w1`` / ``drt_w2``: ``dataset_rt.DataLoader``; with ``num_workers=0`` the
  training process reads the ring itself (the cache is uncompressed, so each slot entry is a
  reference and each ``sample.data`` a memoryview of the shard's map, no copy); with workers,
  results come back through the workers' result memory, except views of the shard maps, which
  come back as references (raw bytes: no copy);
- ``drt_w2_len``: 2 workers whose transform returns ``len()`` xor the first byte (an int), so
  the bytes stay in the workers: the ring's rate into worker processes;
- ``drt_lz4_w0`` / ``drt_lz4_w2`` (raw-bytes workloads): the same loader over a copy of the
  cache written with ``ShardCompression(algo="lz4", ratio=0.9)`` (the payloads compress to
  55-60%), so the producer verifies and decompresses every record on its ``producer_threads``
  threads (``--producer-threads``; default ``min(4, cores)``); ``drt_lz4_w0_t1``: one thread;
- ``torch_lz4_w2``: torch's 2-worker DataLoader over that LZ4 cache, each worker decompressing
  with the ``lz4`` package (``lz4.block.decompress``; no checksum check);
- ``torch_cache_wN``: ``torch.utils.data.DataLoader(num_workers=N, shuffle=True)`` over a
  map-style dataset that reads the very same DatasetRT cache: ``index.bin`` parsed with numpy,
  the shards memory-mapped once per worker, one ``bytes`` slice per sample (no checksum check,
  which DatasetRT does on every read);
- ``torch_files_w2``: the same over one file per sample (open + read per sample);
- ``streaming_w2``: MosaicML Streaming (MDS written locally, ``StreamingDataset`` in a torch
  ``DataLoader`` with 2 workers);
- ``litdata_w2``: LitData (``optimize()`` locally, ``StreamingDataset`` in its
  ``StreamingDataLoader`` with 2 workers);
- ``drt_np_w2`` (arrays only): ``dataset_rt.DataLoader``, 2 workers, numpy arrays,
  ``collate_fn=np.stack``; in the arrays workload ``drt_w2`` is ``dataset_rt.torch.DataLoader``
  (2 workers, tensors, its default collate, which stacks into the worker's result memory);
- ``torch_flat_w2`` (arrays only): torch's 2-worker DataLoader over a map-style dataset that
  ``np.memmap``s the flat file of the images (no ``bytes`` slice: the flip copies from the page
  cache), default collate (each batch through its own shared-memory file): the reference of the
  arrays ratios; ``torch_cache_w2`` there is the same transform over the DatasetRT cache;
- ``floor`` (decode only): the transform over an in-memory list of bytes in one process: the
  1-process decode rate that "ideal scaling" multiplies (ideal for N workers = min(N, cores) x
  it);
- ``floor_x2`` (decode only): the same batches decoded by a forked ``multiprocessing.Pool(2)``
  (``imap``, ints back): what 2 processes got from this shared machine in this run, the
  practical ideal for 2 workers.

Each contender runs in a fresh interpreter; a background thread of this process samples that
interpreter's whole process tree (training process, producer, workers) every 50 ms, summing RSS
(``/proc/PID/statm``; PSS from ``/proc/PID/smaps_rollup``, which costs ~13 ms per torch
process, only every second), and keeps the maxima. RSS counts shared pages (torch's libraries
in forked workers, the ring, the page cache of mapped files) once per process; PSS splits them.
In the child, one "epoch" is one ``iter(loader)`` (processes started for it, as torch does
without ``persistent_workers``); epochs repeat until ``--min-seconds`` are measured. The
headline is the steady rate: samples over the time between the arrivals of the batches at 20%
and 80% of an epoch (median over epochs, then over rounds); the rate over the whole epoch,
process start-up included, the time to the first batch and the teardown after the last one are
reported beside it. Every child imports torch (and, for the images, Pillow's PNG plugin) first,
as a training script does: forked workers inherit them.

    cd /tmp && PYTHONPATH=/tmp/bench_site python /work/main/bench/bench_loader.py
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import common
import numpy as np
import peers
import procs

BATCH = 64
WORKLOADS = {
    # name: (samples, payload size or None for the images)
    "decode": (int(os.environ.get("BENCH_LOADER_IMAGES", "3072")), None),
    "4KiB": (int(os.environ.get("BENCH_LOADER_4K", "16384")), 4 * common.KIB),
    "128KiB": (int(os.environ.get("BENCH_LOADER_128K", "2048")), 128 * common.KIB),
    "arrays": (int(os.environ.get("BENCH_LOADER_ARRAYS", "1024")), 3 * 224 * 224),
}
ARRAY_SHAPE = (3, 224, 224)
# Mean payload bytes per workload, filled from the data (the PNGs vary in size).
WORKLOADS_MEAN_BYTES: dict[str, float] = {}
IMAGE_SIDE = 128
# Run order within a round: the pairs that the targets compare run next to each other.
CONTENDERS = {
    "decode": [
        "floor",
        "floor_x2",
        "drt_w2",
        "torch_cache_w2",
        "drt_w1",
        "torch_cache_w1",
        "drt_w0",
        "torch_files_w2",
        "streaming_w2",
        "litdata_w2",
    ],
    "io": [
        "drt_w0",
        "drt_w0_plain",
        "torch_cache_w2",
        "torch_cache_w0",
        "drt_w2",
        "drt_w2_plain",
        "drt_w2_len",
        "torch_files_w2",
        "streaming_w2",
        "litdata_w2",
        "drt_lz4_w0",
        "torch_lz4_w2",
        "drt_lz4_w0_t1",
        "drt_lz4_w2",
    ],
    "arrays": [
        "torch_flat_w2",
        "drt_w2",
        "drt_np_w2",
        "torch_cache_w2",
    ],
}
LABELS = {
    "floor": "in-process decode loop (1 process)",
    "floor_x2": "decode in a 2-process Pool, no loader (measured 2-worker ideal)",
    "drt_w0": "DatasetRT loader, 0 workers (ring read in the trainer)",
    "drt_w1": "DatasetRT loader, 1 worker",
    "drt_w2": "DatasetRT loader, 2 workers",
    "drt_w2_len": "DatasetRT loader, 2 workers, ints back (bytes stay in workers)",
    "drt_w0_plain": "DatasetRT loader, 0 workers, read planner off (DATASET_RT_IO=plain)",
    "drt_w2_plain": "DatasetRT loader, 2 workers, read planner off (DATASET_RT_IO=plain)",
    "drt_lz4_w0": "DatasetRT loader, LZ4 cache, 0 workers",
    "drt_lz4_w0_t1": "DatasetRT loader, LZ4 cache, 0 workers, 1 producer thread",
    "drt_lz4_w2": "DatasetRT loader, LZ4 cache, 2 workers",
    "torch_lz4_w2": "torch DataLoader, 2 workers, LZ4 cache (lz4 package)",
    "torch_cache_w0": "torch DataLoader, 0 workers, DatasetRT cache (map-style)",
    "torch_cache_w1": "torch DataLoader, 1 worker, DatasetRT cache (map-style)",
    "torch_cache_w2": "torch DataLoader, 2 workers, DatasetRT cache (map-style)",
    "torch_files_w2": "torch DataLoader, 2 workers, file per sample",
    "streaming_w2": "MosaicML Streaming, 2 torch workers",
    "litdata_w2": "LitData, 2 workers",
}
# The arrays workload's own labels (its drt_w2 is the torch subclass).
LABELS_ARRAYS = {
    "drt_w2": "dataset_rt.torch.DataLoader, 2 workers, tensors, default collate",
    "drt_np_w2": "dataset_rt.DataLoader, 2 workers, numpy arrays, np.stack",
    "torch_flat_w2": "torch DataLoader, 2 workers, np.memmap of the flat file",
    "torch_cache_w2": "torch DataLoader, 2 workers, DatasetRT cache (map-style)",
}
# The reference every ratio is taken against (the arrays': torch over the flat file).
BASELINE = "torch_cache_w2"
BASELINE_ARRAYS = "torch_flat_w2"
# Payload copies, from the storage's page cache to what the training loop holds, counted from
# each code path (memcpy-like passes in user space and the kernel's copies through pipes).
COPIES_RAW = {
    "drt_w0": (
        "0: the Rust producer verifies the record's checksum and puts a reference to it in the "
        "ring slot; the loop gets memoryviews of its own map of the shard"
    ),
    "drt_w2": (
        "0: the producer writes references, the workers send them back (their results view "
        "their shard maps); the trainer: memoryviews of its own map of the shard"
    ),
    "drt_w2_len": "0 (references in the ring; the workers read views; ints cross the pipe)",
    "drt_lz4_w0": "1 (Rust producer: LZ4 decode -> buffer -> ring slot); 0 in Python",
    "drt_lz4_w0_t1": "1 (as drt_lz4_w0)",
    "drt_lz4_w2": "2: the producer's LZ4 decode -> slot; worker: slot -> its result memory",
    "torch_lz4_w2": "~6: as torch_cache_w2, the LZ4 decode instead of the mmap slice copy",
    "torch_cache_w0": "1 (mmap slice -> bytes, in the training process)",
    "torch_cache_w2": (
        "~6: worker: mmap slice -> bytes, pickle stream, pipe write; "
        "trainer: pipe read, BytesIO assembly, unpickle"
    ),
    "torch_files_w2": "~6: as torch_cache_w2, read() of the file instead of an mmap slice",
    "streaming_w2": "~6: MDS shard mmap/read -> bytes, then torch's worker queue (5)",
    "litdata_w2": "~6-7: chunk file read -> bytes (+ slice), then torch's worker queue (5)",
}
COPIES_NUM = {
    "drt_w0": 0,
    "drt_lz4_w0": 1,
    "drt_lz4_w0_t1": 1,
    "drt_lz4_w2": 2,
    "torch_lz4_w2": 6,
    "drt_w2": 0,
    "drt_w2_len": 0,
    "torch_cache_w0": 1,
    "torch_cache_w2": 6,
    "torch_files_w2": 6,
    "streaming_w2": 6,
    "litdata_w2": 6,
}
# The arrays workload: passes over each payload's 150,528 bytes, from the page cache to the
# batch the loop holds (the flip is the transform's work, which every contender does).
COPIES_ARRAYS = {
    "torch_flat_w2": (
        2,
        "worker: flip (memmap page cache -> array), torch.stack into the batch's new shared-"
        "memory file (the kernel zeroes its pages first); trainer: maps it, 0 copies",
    ),
    "torch_cache_w2": (3, "as torch_flat_w2, after an mmap slice -> bytes"),
    "drt_w2": (
        2,
        "producer: xxh3 checksum pass, a reference in the ring slot; worker: flip (its shard "
        "map -> array), torch.stack straight into its result memory; trainer: a view of it, "
        "0 copies",
    ),
    "drt_np_w2": (
        3,
        "producer: xxh3 checksum pass, a reference in the ring slot; worker: flip, np.stack, "
        "the stacked array -> its result memory; trainer: a view of it, 0 copies",
    ),
}
# The suffix of the DatasetRT contenders whose producer reads with the read planner off.
PLAIN = "_plain"
CHILD_TIMEOUT_S = 300
CHART = common.REPO_ROOT / "docs" / "benchmarks-loader.png"
STAMP_VERSION = 1


def workers_of(contender: str) -> int:
    return int(contender.rsplit("_w", 1)[1][0]) if "_w" in contender else 0


def kind_of(workload: str) -> str:
    return workload if workload in ("decode", "arrays") else "io"


def baseline_of(workload: str) -> str:
    return BASELINE_ARRAYS if workload == "arrays" else BASELINE


def label_of(workload: str, contender: str) -> str:
    if workload == "arrays" and contender in LABELS_ARRAYS:
        return LABELS_ARRAYS[contender]
    return LABELS[contender]


# --------------------------------------------------------------------------------------------
# Data: <data-dir>/loader/<workload>/{flat.bin, offsets.npy, drt/, files/, mds/, litdata/}


class Layout:
    def __init__(self, data_dir: Path, workload: str) -> None:
        self.workload = workload
        self.count, self.size = WORKLOADS[workload]
        self.root = data_dir / "loader" / workload
        self.flat = self.root / "flat.bin"
        self.offsets = self.root / "offsets.npy"

    def store(self, kind: str) -> Path:
        return self.root / kind

    def stamp_text(self, kind: str) -> str:
        return common.stamp_text(kind, STAMP_VERSION, self.count, self.size)

    def ready(self, kind: str) -> bool:
        stamp = self.root / f"{kind}.ok"
        return stamp.exists() and stamp.read_text() == self.stamp_text(kind)

    def mark(self, kind: str) -> None:
        (self.root / f"{kind}.ok").write_text(self.stamp_text(kind))

    def spans(self) -> tuple[list[int], list[int]]:
        offs = np.load(self.offsets)
        return offs[:-1].tolist(), offs[1:].tolist()

    def payloads(self) -> Iterator[bytes]:
        starts, ends = self.spans()
        with open(self.flat, "rb") as f:
            data = f.read()
        for s, e in zip(starts, ends, strict=True):
            yield data[s:e]

    def file_path(self, i: int) -> Path:
        ext = "png" if self.workload == "decode" else "bin"
        return self.store("files") / f"{i // 1000:04d}" / f"{i:07d}.{ext}"


def make_png(i: int) -> bytes:
    """A deterministic 128x128 RGB PNG: smooth waves plus noise (decodes in ~0.5 ms)."""
    from PIL import Image

    rng = np.random.default_rng(i)
    y, x = np.mgrid[0:IMAGE_SIDE, 0:IMAGE_SIDE].astype(np.float32)
    f = rng.uniform(0.02, 0.2, size=3)
    p = rng.uniform(0, 6.3, size=3)
    img = np.stack(
        [127 + 100 * np.sin(f[c] * x + p[c]) * np.cos(f[(c + 1) % 3] * y) for c in range(3)], -1
    )
    img += rng.normal(0, 6, img.shape)
    out = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(out, format="PNG")
    return out.getvalue()


def prepare(lay: Layout, kind: str) -> None:
    """Writes one contender's copy of the data (run in a subprocess)."""
    if kind == "flat":
        common.reset_dir(lay.root)
        if lay.size is None:
            from multiprocessing import Pool

            with Pool(2) as pool:
                items = pool.map(make_png, range(lay.count), chunksize=64)
        else:
            buf = common.payload_buffer(lay.count, lay.size, seed=lay.size)
            items = common.payload_list(buf, lay.size)
        offs = np.zeros(lay.count + 1, dtype=np.int64)
        offs[1:] = np.cumsum([len(x) for x in items])
        with open(lay.flat, "wb") as f:
            for x in items:
                f.write(x)
        np.save(lay.offsets, offs)
    elif kind in ("drt", "drt_lz4"):
        drt = common.import_dataset_rt()
        base = common.reset_dir(lay.store(kind))
        algo = "lz4" if kind == "drt_lz4" else "none"
        writer = drt.WriterConfig(
            show_progress=False,
            shard_compression=drt.ShardCompression(algo=algo, ratio=0.9 if algo == "lz4" else 1),
        )

        class Source:
            name = "bench"

            def __iter__(self) -> Iterable[Any]:
                for i, p in enumerate(lay.payloads()):
                    yield drt.CacheInput(data=p, metadata={"sample_id": i})

        with drt.DatasetRuntime(num_workers=2) as rt:
            result = rt.from_cache_sources(Source(), base, writer_config=writer)
            if not isinstance(result, drt.CacheSourcesDatasetSuccess):
                raise RuntimeError(result.message)
    elif kind == "files":
        common.reset_dir(lay.store("files"))
        for i, p in enumerate(lay.payloads()):
            path = lay.file_path(i)
            if i % 1000 == 0:
                path.parent.mkdir()
            path.write_bytes(p)
    elif kind == "mds":
        peers.write_mds(lay.store("mds"), lay.payloads())
    elif kind == "litdata":
        starts, ends = lay.spans()
        spans = [(s, e - s) for s, e in zip(starts, ends, strict=True)]
        peers.write_litdata(lay.store("litdata"), lay.flat, spans)
    else:
        raise ValueError(kind)
    lay.mark(kind)


STORES = {
    "drt": "drt",
    "drt_lz4": "drt_lz4",
    "drt_np": "drt",
    "torch_cache": "drt",
    "torch_lz4": "drt_lz4",
    "torch_files": "files",
    "torch_flat": "flat",
    "streaming": "mds",
    "litdata": "litdata",
}


def store_of(contender: str) -> str | None:
    return STORES.get(contender.rsplit("_w", 1)[0])


def producer_threads_of(contender: str, default: int | None) -> int | None:
    """``_tN`` at the end of a DatasetRT contender's key: N producer threads."""
    head, _, threads = contender.rpartition("_t")
    return int(threads) if head.endswith(tuple(f"_w{n}" for n in range(10))) else default


# --------------------------------------------------------------------------------------------
# What runs in the loaders' processes (module level: picklable under any start method)


def decode(data: Any) -> int:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        return int(np.asarray(im.convert("RGB")).sum())


_FLOOR_BATCHES: list[list[bytes]] = []


def decode_floor_batch(i: int) -> list[int]:
    return [decode(x) for x in _FLOOR_BATCHES[i]]


def decode_sample(sample: Any) -> int:
    return decode(sample.data)


def len_sample(sample: Any) -> int:
    data = sample.data
    return len(data) ^ data[0]


def list_collate(batch: list[Any]) -> list[Any]:
    return batch


def flip_array(data: Any) -> Any:
    """The arrays workload's transform: a view of the raw image, flipped (one copy)."""
    return np.frombuffer(data, dtype=np.uint8).reshape(ARRAY_SHAPE)[:, ::-1, :].copy()


def flip_tensor(data: Any) -> Any:
    import torch

    return torch.from_numpy(flip_array(data))


def flip_sample_array(sample: Any) -> Any:
    return flip_array(sample.data)


def flip_sample_tensor(sample: Any) -> Any:
    return flip_tensor(sample.data)


class FlatArrays:
    """The reproducer's torch reference: the flat file of the images, ``np.memmap``ped once per
    worker, each item flipped into a tensor straight from the page cache."""

    def __init__(self, lay: Layout) -> None:
        self.flat = lay.flat
        self.count, self.size = lay.count, int(lay.size or 0)
        self.mm: Any = None

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> Any:
        if self.mm is None:
            self.mm = np.memmap(self.flat, dtype=np.uint8, mode="r", shape=(self.count, self.size))
        return flip_tensor(self.mm[i])

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "mm": None}


class CacheMapDataset:
    """Map-style dataset over a DatasetRT cache's own files: the library's own reading of the
    index and record headers (``_native.payload_spans``) gives each payload's (shard, start,
    end); shards are mmapped once per process."""

    def __init__(self, cache_dir: Path, transform: Callable[[bytes], Any] | None) -> None:
        from dataset_rt import _native

        self.cache_dir = cache_dir
        self.transform = transform
        rows = np.frombuffer(_native.payload_spans(cache_dir), dtype="<i8").reshape(-1, 4)
        shard_ids, starts, stored, raw = (rows[:, k] for k in range(4))
        # Decoded length of each LZ4 record, -1 for a raw one.
        self.raw = raw.tolist()
        self.shards = shard_ids.tolist()
        self.starts = starts.tolist()
        self.ends = (starts + stored).tolist()
        self._maps: dict[int, Any] = {}
        self._pid = -1

    def __len__(self) -> int:
        return len(self.starts)

    def _map(self, shard: int) -> Any:
        import mmap

        if self._pid != os.getpid():  # a worker: map the shards again in this process
            self._maps, self._pid = {}, os.getpid()
        mm = self._maps.get(shard)
        if mm is None:
            path = self.cache_dir / "shards" / f"{shard:06d}.bin"
            with open(path, "rb") as f:
                mm = self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return mm

    def __getitem__(self, i: int) -> Any:
        data = self._map(self.shards[i])[self.starts[i] : self.ends[i]]
        if self.raw[i] >= 0:
            import lz4.block

            data = lz4.block.decompress(data, uncompressed_size=self.raw[i])
        return data if self.transform is None else self.transform(data)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": {}, "_pid": -1}


class FilesDataset:
    def __init__(self, lay: Layout, transform: Callable[[bytes], Any] | None) -> None:
        self.paths = [str(lay.file_path(i)) for i in range(lay.count)]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Any:
        with open(self.paths[i], "rb") as f:
            data = f.read()
        return data if self.transform is None else self.transform(data)


def streaming_class(transform: Callable[[bytes], Any] | None) -> Any:
    from streaming import StreamingDataset

    class Streaming(StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: int) -> Any:
            data = super().__getitem__(i)["data"]
            return data if transform is None else transform(data)

    return Streaming


def litdata_class(transform: Callable[[bytes], Any] | None) -> Any:
    from litdata import StreamingDataset

    class LitData(StreamingDataset):  # type: ignore[misc]
        def __getitem__(self, i: Any) -> Any:
            data = super().__getitem__(i)["data"]
            return data if transform is None else transform(data)

    return LitData


# --------------------------------------------------------------------------------------------
# One contender, in a fresh interpreter


def open_loader(
    name: str, lay: Layout, producer_threads: int | None = None
) -> tuple[Any, Callable[[Any], Any]]:
    """Returns (loader, payload of one batch item). ``iter(loader)`` is one epoch;
    ``producer_threads`` applies to DatasetRT contenders without a ``_tN`` suffix."""
    decoding = lay.workload == "decode"
    workers = workers_of(name)
    if lay.workload == "arrays":
        return open_arrays_loader(name, lay, producer_threads)
    if name in ("floor", "floor_x2"):
        items = list(lay.payloads())
        batches = [items[i : i + BATCH] for i in range(0, len(items), BATCH)]

        class Floor:
            def __iter__(self) -> Iterator[list[int]]:
                for b in batches:
                    yield [decode(x) for x in b]

        class FloorPool:
            def __iter__(self) -> Iterator[list[int]]:
                from multiprocessing import get_context

                global _FLOOR_BATCHES
                _FLOOR_BATCHES = batches  # inherited by the forked pool
                with get_context("fork").Pool(2) as pool:
                    yield from pool.imap(decode_floor_batch, range(len(batches)))

        return (FloorPool() if name == "floor_x2" else Floor()), lambda x: x
    if name.startswith("drt_"):
        drt = common.import_dataset_rt()
        transform = decode_sample if decoding else len_sample if name == "drt_w2_len" else None
        loader = drt.DataLoader(
            drt_dataset(name, lay),
            batch_size=BATCH,
            num_workers=workers,
            transform=transform,
            producer_threads=producer_threads_of(name, producer_threads),
        )
        return loader, (lambda x: x) if transform else (lambda x: x.data)
    import torch.utils.data as tud

    fn = decode if decoding else None
    if name.startswith(("torch_cache", "torch_lz4", "torch_files")):
        ds = (
            FilesDataset(lay, fn)
            if name.startswith("torch_files")
            else CacheMapDataset(lay.store(store_of(name) or "drt") / "bench", fn)
        )
        loader = tud.DataLoader(
            ds,  # type: ignore[arg-type]
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
            collate_fn=list_collate,
        )
        return loader, lambda x: x
    if name.startswith("streaming"):
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        ds = streaming_class(fn)(
            local=str(lay.store("mds")), remote=None, shuffle=True, batch_size=BATCH
        )
        loader = tud.DataLoader(ds, batch_size=BATCH, num_workers=workers, collate_fn=list_collate)
        return loader, lambda x: x
    if name.startswith("litdata"):
        from litdata import StreamingDataLoader

        ds = litdata_class(fn)(str(lay.store("litdata")), shuffle=True)
        loader = StreamingDataLoader(
            ds, batch_size=BATCH, num_workers=workers, collate_fn=list_collate
        )
        return loader, lambda x: x
    raise ValueError(name)


def drt_dataset(name: str, lay: Layout) -> Any:
    drt = common.import_dataset_rt()

    class NameOnly:
        name = "bench"

    with drt.DatasetRuntime(num_workers=1) as rt:
        result = rt.from_cache_sources(
            NameOnly(),
            lay.store(store_of(name) or "drt"),
            reader_config=drt.ReaderConfig(seed=0, shuffle=True),
            writer_config=drt.WriterConfig(show_progress=False),
        )
    if not isinstance(result, drt.CacheSourcesDatasetSuccess):
        raise RuntimeError(result.message)
    return result.dataset


def open_arrays_loader(
    name: str, lay: Layout, producer_threads: int | None
) -> tuple[Any, Callable[[Any], Any]]:
    """The arrays workload: every loader yields one (64, 3, 224, 224) uint8 array per batch."""
    import torch.utils.data as tud

    workers = workers_of(name)
    threads = producer_threads_of(name, producer_threads)
    if name == "drt_w2":
        from dataset_rt.torch import DataLoader as TorchSubclass

        loader: Any = TorchSubclass(
            drt_dataset(name, lay),
            batch_size=BATCH,
            num_workers=workers,
            transform=flip_sample_tensor,
            producer_threads=threads,
        )
    elif name == "drt_np_w2":
        drt = common.import_dataset_rt()
        loader = drt.DataLoader(
            drt_dataset(name, lay),
            batch_size=BATCH,
            num_workers=workers,
            transform=flip_sample_array,
            collate_fn=np.stack,
            producer_threads=threads,
        )
    elif name.startswith("torch_flat"):
        loader = tud.DataLoader(
            FlatArrays(lay),  # type: ignore[arg-type]
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
        )
    elif name.startswith("torch_cache"):
        loader = tud.DataLoader(
            CacheMapDataset(lay.store("drt") / "bench", flip_tensor),  # type: ignore[arg-type]
            batch_size=BATCH,
            shuffle=True,
            num_workers=workers,
        )
    else:
        raise ValueError(f"{name} does not run the arrays workload")
    return loader, lambda x: x


def io_counters() -> dict[str, int]:
    """``/proc/self/io``: ``rchar``/``wchar`` count bytes through read()/write()-family calls
    (files and pipes, not mmap) of this process plus its children once reaped (the producer,
    the workers after each epoch): per sample, the syscall traffic of the whole tree."""
    out = {}
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            key, _, value = line.partition(":")
            out[key] = int(value)
    except OSError:
        pass
    return out


def cpu_of_tree() -> float:
    """User + system CPU seconds of this process and its reaped children (the producer and the
    workers of every finished epoch: both loaders wait for them when a pass ends)."""
    import resource

    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def steady_rate(stamps: list[float], sizes: list[int]) -> float:
    """Samples/s between the arrivals of the batches at 20% and 80% of the epoch: the pipeline
    holds as many batches in flight at both ends of that window, so neither the start-up nor the
    batches prefetched while the first one was awaited inflate it."""
    if len(stamps) < 6:
        k, m = 0, len(stamps) - 1
    else:
        k, m = len(stamps) // 5, len(stamps) - 1 - len(stamps) // 5
    if m <= k:
        return float("nan")
    return sum(sizes[k + 1 : m + 1]) / max(stamps[m] - stamps[k], 1e-9)


def child(
    name: str, lay: Layout, min_seconds: float, max_epochs: int, producer_threads: int | None
) -> dict[str, Any]:
    # A training process has torch loaded: so does every contender's (same imports, same
    # inherited pages in forked workers).
    import torch  # noqa: F401

    decoding = lay.workload == "decode"
    arrays = lay.workload == "arrays"
    if decoding:
        from PIL import PngImagePlugin  # noqa: F401
    if name.endswith(PLAIN):
        # The same loader with the read planner off (the producer inherits the variable):
        # what the planner costs on warm data.
        os.environ["DATASET_RT_IO"] = "plain"
        name = name.removesuffix(PLAIN)

    loader, payload = open_loader(name, lay, producer_threads)
    epochs = []
    measured = 0.0
    io0 = io_counters()
    cpu0 = cpu_of_tree()
    while len(epochs) < max_epochs and (measured < min_seconds or not epochs):
        n = nbytes = check = 0
        stamps: list[float] = []
        sizes: list[int] = []
        t0 = time.perf_counter()
        for batch in loader:
            stamps.append(time.perf_counter())
            sizes.append(len(batch))
            if decoding:
                for x in batch:
                    check += x
                    n += 1
            elif arrays:
                n += len(batch)
                nbytes += batch.nbytes
                check ^= int(batch[0][0][0][0])
            else:
                for x in batch:
                    d = payload(x)
                    if isinstance(d, int):
                        check ^= d
                    else:
                        nbytes += len(d)
                        check ^= d[0]
                    n += 1
        t_end = time.perf_counter()
        epochs.append(
            {
                "samples": n,
                "batches": len(stamps),
                "bytes": nbytes,
                "first_batch_s": stamps[0] - t0,
                "epoch_s": t_end - t0,
                # from the last batch's arrival to the end of the for loop: the loader's
                # teardown (plus the loop body over one batch)
                "last_batch_to_end_s": t_end - stamps[-1],
                "epoch_samples_per_s": n / (t_end - t0),
                "steady_samples_per_s": steady_rate(stamps, sizes),
                "check": check,
            }
        )
        measured += t_end - t0
    io1 = io_counters()
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    cpu1 = cpu_of_tree()
    total = sum(e["samples"] for e in epochs)
    return {
        "contender": name,
        "workload": lay.workload,
        "epochs": epochs,
        "tree_read_bytes_per_sample": (io1.get("rchar", 0) - io0.get("rchar", 0)) / total,
        "tree_write_bytes_per_sample": (io1.get("wchar", 0) - io0.get("wchar", 0)) / total,
        "cpu_s_per_sample": (cpu1 - cpu0) / total,
    }


# --------------------------------------------------------------------------------------------
# The orchestrator: fresh interpreters (procs.run_child samples their process trees)


def prepare_all(args: argparse.Namespace) -> dict[str, str]:
    errors: dict[str, str] = {}
    for wl in args.workloads:
        lay = Layout(args.data_dir, wl)
        contenders = [
            c for c in CONTENDERS[kind_of(wl)] if args.contenders is None or c in args.contenders
        ]
        # The stores of the contenders that run (all of them by default), in a fixed order.
        needed = {store_of(c) for c in contenders}
        kinds = ["flat"] + [k for k in ("drt", "drt_lz4", "files", "mds", "litdata") if k in needed]
        for kind in kinds:
            if lay.ready(kind):
                continue
            if kind != "flat" and not lay.ready("flat"):
                errors[f"{wl}/{kind}"] = "no source data"
                continue
            print(f"# preparing {wl}/{kind}", file=sys.stderr, flush=True)
            t = time.perf_counter()
            cmd = [
                sys.executable,
                str(Path(__file__).resolve()),
                "--prepare",
                kind,
                "--workloads",
                wl,
                "--data-dir",
                str(args.data_dir),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                tail = " | ".join(proc.stderr.strip().splitlines()[-3:])[-500:]
                errors[f"{wl}/{kind}"] = f"exit {proc.returncode}: {tail}"
                print(f"#   failed: {tail}", file=sys.stderr)
            else:
                print(f"#   {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return errors


def warm_page_cache(root: Path) -> int:
    n = 0
    buf = bytearray(16 * common.MIB)
    for p in root.rglob("*"):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while got := f.readinto(buf):
                    n += got
    return n


def copies_of(workload: str, name: str) -> tuple[int | None, str | None]:
    name = name.removesuffix(PLAIN)
    if workload == "decode":
        return None, None
    if workload == "arrays":
        return COPIES_ARRAYS.get(name, (None, None))
    return COPIES_NUM.get(name), COPIES_RAW.get(name)


def summarise(
    workload: str, runs: dict[str, list[dict[str, Any]]], prep_errors: dict[str, str]
) -> dict[str, Any]:
    count, size = WORKLOADS[workload]
    rows: list[dict[str, Any]] = []
    for name, results in runs.items():
        row: dict[str, Any] = {"contender": name, "label": label_of(workload, name)}
        ok = [r for r in results if "error" not in r]
        if not ok:
            store = store_of(name)
            row["error"] = prep_errors.get(f"{workload}/{store}") or (
                results[0]["error"] if results else "not run"
            )
            rows.append(row)
            continue
        per_round = [common.median(e["steady_samples_per_s"] for e in r["epochs"]) for r in ok]
        rate = common.median(per_round)
        mean_bytes = size if size is not None else WORKLOADS_MEAN_BYTES.get(workload, 0)
        row.update(
            {
                "samples_per_s": rate,
                "mb_per_s": rate * mean_bytes / 1e6,
                "last_batch_to_end_s": common.median(
                    common.median(e["last_batch_to_end_s"] for e in r["epochs"]) for r in ok
                ),
                "epoch_samples_per_s": common.median(
                    common.median(e["epoch_samples_per_s"] for e in r["epochs"]) for r in ok
                ),
                "first_batch_s": common.median(
                    common.median(e["first_batch_s"] for e in r["epochs"]) for r in ok
                ),
                "epochs_per_round": [len(r["epochs"]) for r in ok],
                "per_round_samples_per_s": per_round,
                "peak_tree_rss_mib": common.median(r["peak_tree_rss_mib"] for r in ok),
                "peak_tree_pss_mib": common.median(r["peak_tree_pss_mib"] for r in ok),
                "max_processes": max(r["max_processes"] for r in ok),
                "sampler_cpu_share": common.median(
                    r["sampler_cpu_s"] / r["child_wall_s"] for r in ok
                ),
                "tree_read_bytes_per_sample": common.median(
                    r["tree_read_bytes_per_sample"] for r in ok
                ),
                "shm_left": sorted({n for r in ok for n in r["shm_left"]}),
                "copies": copies_of(workload, name)[0],
                "copies_how": copies_of(workload, name)[1],
                "cpu_us_per_sample": common.median(r.get("cpu_s_per_sample", 0.0) for r in ok)
                * 1e6,
                "rounds": len(ok),
                "failed_rounds": [r["error"] for r in results if "error" in r],
            }
        )
        rows.append(row)
    by = {r["contender"]: r for r in rows}
    baseline = baseline_of(workload)
    base = by.get(baseline, {}).get("samples_per_s")
    base_rounds = by.get(baseline, {}).get("per_round_samples_per_s", [])
    for r in rows:
        if "samples_per_s" in r and base:
            r["x_torch_w2"] = r["samples_per_s"] / base
            # The same ratio taken in each round (neighbours in time), then the median.
            pairs = zip(r["per_round_samples_per_s"], base_rounds, strict=False)
            r["x_torch_w2_paired"] = common.median(a / b for a, b in pairs)
        plain = by.get(r["contender"] + PLAIN, {}).get("per_round_samples_per_s")
        if "samples_per_s" in r and plain:
            # Warm data: the planner's cost, against the same loader with it off, per round.
            pairs = zip(r["per_round_samples_per_s"], plain, strict=False)
            r["vs_planner_off"] = common.median(a / b for a, b in pairs)
    out: dict[str, Any] = {
        "workload": workload,
        "samples": count,
        "size": size,
        "baseline": baseline,
        "rows": rows,
    }
    if workload == "decode" and "samples_per_s" in by.get("floor", {}):
        floor = by["floor"]["samples_per_s"]
        pool = by.get("floor_x2", {}).get("samples_per_s")
        cores = os.cpu_count() or 1
        out["floor_x2_over_floor"] = pool / floor if pool else None
        for r in rows:
            w = workers_of(r["contender"])
            if "samples_per_s" not in r or r["contender"].startswith("floor"):
                continue
            # Ideal: the 1-process rate times min(workers, cores); for 2 workers also the rate
            # 2 plain processes reached in this run (what the shared machine gave 2 processes).
            r["ideal_samples_per_s"] = floor * max(1, min(w, cores))
            r["of_ideal"] = r["samples_per_s"] / r["ideal_samples_per_s"]
            if w >= 2 and pool:
                r["of_measured_2proc"] = r["samples_per_s"] / pool
    elif workload != "arrays":
        drt0 = by.get("drt_w0", {}).get("samples_per_s")
        if drt0 and base:
            out["target_raw_bytes_x"] = drt0 / base
    return out


def print_tables(tables: list[dict[str, Any]]) -> None:
    for t in tables:
        decoding = t["workload"] == "decode"
        what = (
            f"{t['samples']} PNG images {IMAGE_SIDE}x{IMAGE_SIDE}, decoded in the transform"
            if decoding
            else f"{t['samples']} raw 3x224x224 uint8 images, flipped into a batch array"
            if t["workload"] == "arrays"
            else f"{t['samples']} samples of {t['workload']}, raw bytes to the training loop"
        )
        print(f"\n### {t['workload']}: {what}\n")
        baseline = t.get("baseline", BASELINE)
        headers = ["contender", "samples/s", "MB/s", f"x {baseline}", "epoch samples/s"]
        headers += (
            ["of N x 1-proc", "of 2-proc pool"]
            if decoding
            else ["copies/sample", "read() B/sample"]
        )
        headers += ["CPU us/sample", "first batch ms", "teardown ms", "peak ΣRSS MiB"]
        headers += ["peak ΣPSS MiB", "procs"]
        rows = []
        for r in t["rows"]:
            if "error" in r:
                rows.append([r["label"], f"failed: {r['error'][:80]}"] + ["-"] * (len(headers) - 2))
                continue
            row = [r["label"], r["samples_per_s"], r["mb_per_s"], r.get("x_torch_w2")]
            row.append(r["epoch_samples_per_s"])
            if decoding:
                row.append(f"{r['of_ideal']:.0%}" if "of_ideal" in r else "-")
                pool = r.get("of_measured_2proc")
                row.append(f"{pool:.0%}" if pool else "-")
            else:
                row += [r.get("copies"), r["tree_read_bytes_per_sample"]]
            row += [
                r.get("cpu_us_per_sample"),
                r["first_batch_s"] * 1e3,
                r["last_batch_to_end_s"] * 1e3,
                r["peak_tree_rss_mib"],
                r["peak_tree_pss_mib"],
                r["max_processes"],
            ]
            rows.append(row)
        print(common.markdown_table(headers, rows))
        if not decoding and "target_raw_bytes_x" in t:
            print(
                f"\nRaw bytes to the training loop: DatasetRT num_workers=0 is "
                f"{t['target_raw_bytes_x']:.2f}x torch's DataLoader with 2 workers (target >= 5x)."
            )
        for r in t["rows"]:
            if r.get("vs_planner_off"):
                print(
                    f"\n{r['label']}: {r['vs_planner_off']:.3f}x the same loader with the read "
                    "planner off (median of per-round ratios)"
                )


def draw_chart(data: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    tables = data["tables"]
    fig, axes = plt.subplots(
        2, len(tables), figsize=(6.5 * len(tables), 9), squeeze=False, height_ratios=[3, 2]
    )
    for col, t in enumerate(tables):
        rows = [r for r in t["rows"] if "samples_per_s" in r]
        names = [r["contender"] for r in rows]
        colors = [
            common.RED
            if n.startswith("drt")
            else common.GREY
            if n.startswith("floor")
            else common.BLUE
            if n.startswith("torch")
            else common.GREEN
            for n in names
        ]
        ax = axes[0][col]
        rates = [r["samples_per_s"] for r in rows]
        y = common.hbars(ax, names, rates, colors)
        for i, r in zip(y, rows, strict=True):
            x = r.get("x_torch_w2")
            extra = f"  {x:.2f}x" if x else ""
            if "of_ideal" in r:
                extra += f", {r['of_ideal']:.0%} of N x 1-proc"
            if r.get("of_measured_2proc"):
                extra += f", {r['of_measured_2proc']:.0%} of pool"
            ax.text(
                r["samples_per_s"], i, f" {r['samples_per_s']:,.0f}{extra}", va="center", fontsize=7
            )
        if t["workload"] in ("decode", "arrays"):
            ax.set_xlim(0, max(rates) * 1.6)
            ax.set_xlabel("samples/s (steady, median of rounds)")
        else:
            ax.set_xscale("log")
            ax.set_xlim(min(rates) / 2, max(rates) * 12)
            ax.set_xlabel("samples/s (steady, median of rounds, log scale)")
        title = (
            "decode-bound: PNG decode in the transform"
            if t["workload"] == "decode"
            else "decoded arrays: 3x224x224 uint8 flipped, batch arrays"
            if t["workload"] == "arrays"
            else f"I/O-bound: {t['workload']}, raw bytes to the loop"
        )
        ax.set_title(title, fontsize=10)
        if t["workload"] == "decode":
            floor = next((r["samples_per_s"] for r in rows if r["contender"] == "floor"), None)
            if floor:
                cores = data["machine"]["cores"] or 1
                ax.axvline(
                    floor * min(2, cores),
                    color="black",
                    linestyle="--",
                    linewidth=1,
                    label="2 x the 1-process rate",
                )
                ax.legend(fontsize=7, loc="lower right")
        ax2 = axes[1][col]
        common.hbars(ax2, names, [r["peak_tree_pss_mib"] for r in rows], colors)
        ax2.set_xlabel("peak memory of the process tree, ΣPSS (MiB)")
    title = (
        f"DatasetRT shared-memory loader, {common.machine_line(data['machine'])}, "
        f"batch {BATCH}, median of {data['repeats']} rounds"
    )
    common.save_chart(fig, path, title, dpi=100)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=common.REPEATS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--contenders", nargs="+", default=None, help="a subset, by key")
    parser.add_argument("--data-dir", type=Path, default=common.DATA_DIR)
    parser.add_argument("--min-seconds", type=float, default=1.0)
    parser.add_argument("--max-epochs", type=int, default=8)
    parser.add_argument(
        "--producer-threads",
        type=int,
        default=None,
        help="DataLoader(producer_threads=) of the DatasetRT contenders (default: the loader's)",
    )
    parser.add_argument("--chart", type=Path, default=CHART)
    parser.add_argument("--prepare-only", action="store_true", help="write the data and stop")
    parser.add_argument(
        "--from-json", type=Path, help="print the tables and draw the chart of a saved run"
    )
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.prepare:
        prepare(Layout(args.data_dir, args.workloads[0]), args.prepare)
        print("RESULT {}")
        return None
    if args.child:
        lay = Layout(args.data_dir, args.workloads[0])
        try:
            res = child(args.child, lay, args.min_seconds, args.max_epochs, args.producer_threads)
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        print("RESULT " + json.dumps(res), flush=True)
        return None

    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print_tables(saved["tables"])
        draw_chart(saved, args.chart)
        return saved

    drt = common.import_dataset_rt()
    print(f"# dataset_rt.__file__ = {drt.__file__}", file=sys.stderr)
    print(f"# PYTHONPATH = {os.environ.get('PYTHONPATH', '')}", file=sys.stderr)
    t_start = time.perf_counter()
    prep_errors = prepare_all(args)
    for wl in args.workloads:
        lay = Layout(args.data_dir, wl)
        if lay.ready("flat"):
            starts, ends = lay.spans()
            WORKLOADS_MEAN_BYTES[wl] = float(np.mean(np.subtract(ends, starts)))
    warmed = warm_page_cache(args.data_dir / "loader")
    print(f"# page cache warmed: {warmed / common.MIB:.0f} MiB", file=sys.stderr)
    t_prep = time.perf_counter() - t_start
    if args.prepare_only:
        print(json.dumps(prep_errors or "prepared"))
        return None
    load_before = os.getloadavg()

    plan = {
        wl: [c for c in CONTENDERS[kind_of(wl)] if args.contenders is None or c in args.contenders]
        for wl in args.workloads
    }
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        wl: {c: [] for c in cs} for wl, cs in plan.items()
    }
    for rnd in range(args.repeats):
        for wl, cs in plan.items():
            for c in cs:
                store = store_of(c)
                if store and not Layout(args.data_dir, wl).ready(store):
                    continue
                t = time.perf_counter()
                res = procs.run_child(
                    Path(__file__).resolve(),
                    [
                        "--child",
                        c,
                        "--workloads",
                        wl,
                        "--data-dir",
                        str(args.data_dir),
                        "--min-seconds",
                        str(args.min_seconds),
                        "--max-epochs",
                        str(args.max_epochs),
                        *(
                            []
                            if args.producer_threads is None
                            else ["--producer-threads", str(args.producer_threads)]
                        ),
                    ],
                    CHILD_TIMEOUT_S,
                )
                runs[wl][c].append(res)
                if "error" in res:
                    msg = f"FAILED {res['error'][:300]}"
                else:
                    rate = common.median(e["steady_samples_per_s"] for e in res["epochs"])
                    msg = f"{rate:,.0f} samples/s, {len(res['epochs'])} epochs"
                print(
                    f"# round {rnd + 1} {wl:>6} {c:<15} {msg} ({time.perf_counter() - t:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    tables = [summarise(wl, runs[wl], prep_errors) for wl in args.workloads]
    data = {
        "benchmark": "loader",
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": common.machine_info(),
        "dataset_rt": common.dataset_rt_origin(),
        "batch_size": BATCH,
        "repeats": args.repeats,
        "min_seconds": args.min_seconds,
        "producer_threads": args.producer_threads,
        "prepare_s": t_prep,
        "load_avg_before": load_before,
        "total_s": time.perf_counter() - t_start,
        "prepare_errors": prep_errors,
        "tables": tables,
        "runs": runs,
    }
    print_tables(tables)
    common.write_results("loader", data)
    try:
        draw_chart(data, args.chart)
    except ImportError as e:
        print(f"# no chart: {e} (pip install matplotlib)", file=sys.stderr)
    print(f"\n# loader benchmark: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
