"""In-process shuffled iteration: DatasetRT against its peers and the machine.

One run, one table. The same ~256 MiB of 4 KiB or 128 KiB payloads is stored once per contender
(under ``$BENCH_DATA_DIR/read``, reused between runs), the page cache is warm, and every
contender is iterated in its own fresh process (so peak RSS is its own), in rounds: each round
runs every contender once, and a figure is the median over ``--repeats`` rounds. In a process the
first pass is the warm-up (time to first sample is measured on it, from before the reader is
opened); the measured passes follow, each over every sample in a fresh shuffled order, the loop
body touching ``len()`` of each payload.

Contenders:

- ``floor``: a Python for-loop over an in-memory list of ``bytes`` (no storage at all);
- ``dataset_rt``: ``for sample in dataset`` with ``shuffle=True``, body ``len(sample.data)``,
  under the library's default ``ReaderConfig(verify=...)`` (``--policy`` picks another): the
  warm-up pass is the first epoch, the measured passes are epochs 2+;
- ``dataset_rt_batches``: the same reader through ``dataset.iter_batches(--batch-size)``, body
  ``len(x)`` for each payload ``x`` of ``batch.data`` (rates are still per sample);
- ``dataset_rt_spans``: the same batches taken without an object per sample: body, per batch, the
  payloads' lengths summed from ``batch.spans`` (``end - start`` of every payload, in numpy);
- ``flat_spans``: the reference for ``dataset_rt_spans``: the flat file's batches of the same size
  in a numpy permutation, lengths summed from the offsets array (nothing checked, nothing read);
- ``flat_view`` / ``flat_bytes``: one file of all payloads plus a numpy offsets index, ``mmap``,
  ``numpy`` permutation, a generator yielding ``memoryview`` slices (zero copy) or ``bytes``;
- ``flat_meta``: ``flat_view`` yielding what DatasetRT yields (an object with ``.data``, the
  ``memoryview``, and ``.metadata``, a dict of ``sample_id`` and ``label``): the Python cost of
  that output shape, without any storage logic;
- ``torch_files``: ``DataLoader(batch_size=None, num_workers=0, shuffle=True)`` over a map-style
  dataset of one file per sample (open + read per sample);
- ``torch_flat``: the same ``DataLoader`` over the flat mmap file (``bytes`` per sample: torch's
  default collate would turn a ``memoryview`` into a list of ints);
- ``streaming``: MosaicML Streaming, MDS written locally, ``StreamingDataset(local=...,
  shuffle=True, batch_size=1)``;
- ``litdata``: LitData ``optimize()`` locally, ``StreamingDataset(dir, shuffle=True)``.

The ceiling, measured in the same run: a numpy memcpy and a warm page-cache read of the flat file.

``--verify`` measures something else, alone: DatasetRT's read rate under each
``ReaderConfig(verify=...)`` policy ("always", "once", "never"), every policy in its own fresh
process per round, for epoch 1 (the first pass after opening: "once" verifies every record here)
and epochs 2+ (the median pass after it), with the rates as ratios to "never" in the same run. The
policies differ only in whether a record's checksum is computed, so "always" against "never"
isolates the checksum's cost.

``--first-sample N`` measures something else, alone: the time to the first sample of a shuffled
pass right after opening a cache of N 8-byte samples (written once under
``$BENCH_DATA_DIR/first_sample``), which is what the epoch order costs a pass before it can read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import common
import numpy as np
import peers

CONTENDERS = [
    "floor",
    "dataset_rt",
    "dataset_rt_batches",
    "dataset_rt_spans",
    "dataset_rt_plain",
    "dataset_rt_batches_plain",
    "flat_view",
    "flat_bytes",
    "flat_meta",
    "flat_spans",
    "torch_files",
    "torch_flat",
    "streaming",
    "streaming_pd",
    "litdata",
]
LABELS = {
    "floor": "floor (list of bytes)",
    "dataset_rt": "DatasetRT",
    "dataset_rt_batches": "DatasetRT iter_batches",
    "dataset_rt_spans": "DatasetRT iter_batches, spans",
    "dataset_rt_plain": "DatasetRT, read planner off (DATASET_RT_IO=plain)",
    "dataset_rt_batches_plain": "DatasetRT iter_batches, read planner off",
    "flat_view": "flat mmap, memoryview",
    "flat_bytes": "flat mmap, bytes copy",
    "flat_meta": "flat mmap, memoryview + metadata dict",
    "flat_spans": "flat mmap, batches of offsets",
    "torch_files": "torch DataLoader, file per sample",
    "torch_flat": "torch DataLoader, flat mmap",
    "streaming": "MosaicML Streaming (MDS), defaults",
    "streaming_pd": "MosaicML Streaming (MDS), predownload=2048",
    "litdata": "LitData",
}
# What each contender needs written (prepare step) besides the flat file.
STORES = {
    "dataset_rt": "drt",
    "dataset_rt_batches": "drt",
    "dataset_rt_spans": "drt",
    "dataset_rt_plain": "drt",
    "dataset_rt_batches_plain": "drt",
    "torch_files": "files",
    "streaming": "mds",
    "streaming_pd": "mds",
    "litdata": "litdata",
}
# The suffix of the DatasetRT contenders that read with the read planner off.
PLAIN = "_plain"
# Samples per pass of the contenders too slow for a whole pass (a shuffled prefix of the epoch).
PASS_CAP = {"streaming": 4096, "streaming_pd": 16384}
STAMP_VERSION = 1
MIN_MEASURE_S = float(os.environ.get("BENCH_MIN_MEASURE_S", "0.5"))
MIN_PASSES = 3
MAX_PASSES = 2000


# --------------------------------------------------------------------------------------------
# Data layout under <data-dir>/read/<size label>/


class Layout:
    def __init__(self, data_dir: Path, label: str) -> None:
        self.label = label
        self.size = common.SIZES[label]
        self.count = common.num_samples(self.size)
        self.root = data_dir / "read" / label
        self.flat = self.root / "flat.bin"
        self.offsets = self.root / "offsets.npy"

    def store(self, kind: str) -> Path:
        return self.root / kind

    def stamp(self, kind: str) -> Path:
        return self.root / f"{kind}.ok"

    def stamp_text(self, kind: str) -> str:
        return common.stamp_text(kind, STAMP_VERSION, self.count, self.size)

    def ready(self, kind: str) -> bool:
        s = self.stamp(kind)
        return s.exists() and s.read_text() == self.stamp_text(kind)

    def mark(self, kind: str) -> None:
        self.stamp(kind).write_text(self.stamp_text(kind))

    def flat_map(self) -> tuple[mmap.mmap, list[int], list[int]]:
        offs = np.load(self.offsets)
        with open(self.flat, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return mm, offs[:-1].tolist(), offs[1:].tolist()


def flat_payloads(lay: Layout) -> Iterable[tuple[int, memoryview]]:
    mm, starts, ends = lay.flat_map()
    mv = memoryview(mm)
    for i, (s, e) in enumerate(zip(starts, ends, strict=True)):
        yield i, mv[s:e]


def prepare(lay: Layout, kind: str) -> None:
    """Writes one contender's copy of the data (in a subprocess for the peers)."""
    if kind == "flat":
        lay.root.mkdir(parents=True, exist_ok=True)
        buf = common.payload_buffer(lay.count, lay.size, seed=lay.size)
        buf.tofile(lay.flat)
        np.save(lay.offsets, np.arange(lay.count + 1, dtype=np.int64) * lay.size)
    elif kind == "files":
        out = common.reset_dir(lay.store("files"))
        for i, p in flat_payloads(lay):
            d = out / f"{i // 1000:04d}"
            if i % 1000 == 0:
                d.mkdir()
            (d / f"{i:07d}.bin").write_bytes(p)
    elif kind == "drt":
        drt = common.import_dataset_rt()
        base = common.reset_dir(lay.store("drt"))

        class Source:
            name = "bench"

            def __iter__(self) -> Iterable[Any]:
                for i, p in flat_payloads(lay):
                    yield drt.CacheInput(data=p, metadata={"sample_id": i, "label": i % 1000})

        with drt.DatasetRuntime(num_workers=2) as rt:
            result = rt.from_cache_sources(
                Source(), base, writer_config=drt.WriterConfig(show_progress=False)
            )
            if not isinstance(result, drt.CacheSourcesDatasetSuccess):
                raise RuntimeError(result.message)
    elif kind == "mds":
        peers.write_mds(lay.store("mds"), (p for _, p in flat_payloads(lay)))
    elif kind == "litdata":
        spans = [(i * lay.size, lay.size) for i in range(lay.count)]
        peers.write_litdata(lay.store("litdata"), lay.flat, spans)
    else:
        raise ValueError(kind)
    lay.mark(kind)


# --------------------------------------------------------------------------------------------
# Contenders, run in a worker process


def loop(obj: Iterable[Any], kind: str) -> tuple[int, int]:
    """One pass over ``obj``; the body touches ``len()`` of each payload (one loop per access
    kind, so that no contender pays for a generic accessor)."""
    n = b = 0
    if kind == "bytes":
        for x in obj:
            b += len(x)
            n += 1
    elif kind == "attr":
        for x in obj:
            b += len(x.data)
            n += 1
    elif kind == "batch":
        for batch in obj:
            for x in batch.data:
                b += len(x)
                n += 1
    elif kind == "spans":
        for batch in obj:
            spans = batch.spans
            b += int((spans[:, 2] - spans[:, 1]).sum())
            n += len(spans)
    else:
        for x in obj:
            b += len(x["data"])
            n += 1
    return n, b


def payload_len(x: Any, kind: str) -> int:
    if kind == "batch":
        return sum(len(p) for p in x.data)
    if kind == "spans":
        return int((x.spans[:, 2] - x.spans[:, 1]).sum())
    return len(x) if kind == "bytes" else len(x.data) if kind == "attr" else len(x["data"])


def item_samples(x: Any, kind: str) -> int:
    return len(x) if kind in ("batch", "spans") else 1


def contender(name: str, lay: Layout, args: argparse.Namespace) -> tuple[Callable[[], Any], str]:
    """Imports what ``name`` needs and returns (open, access kind): ``open()`` returns what one
    pass iterates (a fresh shuffled order each call); the first call also opens the reader."""
    if name == "floor":
        mm, starts, ends = lay.flat_map()
        data = [mm[s:e] for s, e in zip(starts, ends, strict=True)]
        mm.close()
        return (lambda: data), "bytes"
    holder: dict[str, Any] = {}
    if name.endswith(PLAIN):
        # The same reader with the read planner turned off: what the planner costs on warm
        # data. The variable is read once, when this fresh process first reads.
        os.environ["DATASET_RT_IO"] = "plain"
        name = name.removesuffix(PLAIN)
    if name in ("dataset_rt", "dataset_rt_batches", "dataset_rt_spans"):
        drt = common.import_dataset_rt()
        runtime = drt.DatasetRuntime(num_workers=args.workers)

        class NameOnly:
            name = "bench"

        # No --policy: the library's default, as a user gets it.
        policy = {"verify": args.policy} if args.policy else {}

        def open_drt() -> Any:
            if "ds" not in holder:
                result = runtime.from_cache_sources(
                    NameOnly(),
                    lay.store("drt"),
                    reader_config=drt.ReaderConfig(
                        seed=0, shuffle=True, prefetch_size=args.prefetch, **policy
                    ),
                    writer_config=drt.WriterConfig(show_progress=False),
                )
                if not isinstance(result, drt.CacheSourcesDatasetSuccess):
                    raise RuntimeError(result.message)
                holder["ds"] = result.dataset
            if name != "dataset_rt":
                return holder["ds"].iter_batches(args.batch_size)
            return holder["ds"]

        kinds = {"dataset_rt_batches": "batch", "dataset_rt_spans": "spans"}
        return open_drt, kinds.get(name, "attr")
    if name == "flat_spans":
        holder["epoch"] = 0

        class FlatBatch:
            __slots__ = ("spans",)

            def __init__(self, spans: Any) -> None:
                self.spans = spans

            def __len__(self) -> int:
                return len(self.spans)

        def open_flat_spans() -> Any:
            if "table" not in holder:
                offs = np.load(lay.offsets)
                # Columns as DatasetRT's spans: buffer (the one file), start, end.
                holder["table"] = np.stack(
                    [np.zeros(lay.count, dtype=np.int64), offs[:-1], offs[1:]], axis=1
                )
            perm = np.random.default_rng(holder["epoch"]).permutation(lay.count)
            holder["epoch"] += 1
            table, size = holder["table"], args.batch_size
            return (FlatBatch(table[perm[i : i + size]]) for i in range(0, lay.count, size))

        return open_flat_spans, "spans"
    if name in ("flat_view", "flat_bytes", "flat_meta"):
        holder["epoch"] = 0
        labels = [i % 1000 for i in range(lay.count)]

        class Sample:
            __slots__ = ("data", "metadata")

            def __init__(self, data: memoryview, metadata: dict[str, int]) -> None:
                self.data = data
                self.metadata = metadata

        def open_flat() -> Any:
            if "mm" not in holder:
                holder["mm"], holder["starts"], holder["ends"] = lay.flat_map()
                holder["mv"] = memoryview(holder["mm"])
            perm = np.random.default_rng(holder["epoch"]).permutation(lay.count).tolist()
            holder["epoch"] += 1
            starts, ends = holder["starts"], holder["ends"]
            src = holder["mm"] if name == "flat_bytes" else holder["mv"]

            def gen() -> Any:
                for i in perm:
                    yield src[starts[i] : ends[i]]

            def gen_meta() -> Any:
                for i in perm:
                    yield Sample(src[starts[i] : ends[i]], {"sample_id": i, "label": labels[i]})

            return gen_meta() if name == "flat_meta" else gen()

        return open_flat, "attr" if name == "flat_meta" else "bytes"
    if name in ("torch_files", "torch_flat"):
        import torch.utils.data as tud

        class FileDataset(tud.Dataset):  # type: ignore[type-arg]
            def __init__(self) -> None:
                root = lay.store("files")
                self.paths = [
                    str(root / f"{i // 1000:04d}" / f"{i:07d}.bin") for i in range(lay.count)
                ]

            def __len__(self) -> int:
                return len(self.paths)

            def __getitem__(self, i: int) -> bytes:
                with open(self.paths[i], "rb") as f:
                    return f.read()

        class FlatDataset(tud.Dataset):  # type: ignore[type-arg]
            def __init__(self) -> None:
                self.mm, self.starts, self.ends = lay.flat_map()

            def __len__(self) -> int:
                return len(self.starts)

            def __getitem__(self, i: int) -> bytes:
                return self.mm[self.starts[i] : self.ends[i]]

        def open_torch() -> Any:
            if "dl" not in holder:
                ds = FileDataset() if name == "torch_files" else FlatDataset()
                holder["dl"] = tud.DataLoader(ds, batch_size=None, shuffle=True, num_workers=0)
            return holder["dl"]

        return open_torch, "bytes"
    if name in ("streaming", "streaming_pd"):
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        # Streaming's default predownload is 8 * batch_size: 8 samples ahead at batch_size=1.
        extra = {"predownload": 2048} if name == "streaming_pd" else {}

        def open_streaming() -> Any:
            if "ds" not in holder:
                holder["ds"] = StreamingDataset(
                    local=str(lay.store("mds")),
                    remote=None,
                    shuffle=True,
                    batch_size=1,
                    **extra,
                )
            return holder["ds"]

        return open_streaming, "dict"
    if name == "litdata":
        from litdata import StreamingDataset as LitDataset

        def open_litdata() -> Any:
            if "ds" not in holder:
                holder["ds"] = LitDataset(str(lay.store("litdata")), shuffle=True)
            return holder["ds"]

        return open_litdata, "dict"
    raise ValueError(name)


def worker(name: str, lay: Layout, args: argparse.Namespace) -> dict[str, Any]:
    open_fn, kind = contender(name, lay, args)
    cap = PASS_CAP.get(name)

    def one_pass() -> Iterable[Any]:
        obj = open_fn()
        return obj if cap is None else itertools.islice(obj, cap)

    if args.open_first:
        # Verification runs time epoch 1 alone: the dataset is opened before the clock starts.
        open_fn()
    # Peak RSS counts from here: the reader's memory, not the imports (nor the floor's list).
    peak_reset = common.reset_peak_rss()
    base = common.proc_status_mib()
    # Warm-up pass: opens the reader; the first sample is timed from before the open.
    t0 = time.perf_counter()
    ttfs = None
    n = b = 0
    for x in one_pass():
        if ttfs is None:
            ttfs = time.perf_counter() - t0
        b += payload_len(x, kind)
        n += item_samples(x, kind)
    warm = time.perf_counter() - t0
    passes, counts = [], [n]
    measured = 0.0
    while len(passes) < MAX_PASSES and (measured < MIN_MEASURE_S or len(passes) < MIN_PASSES):
        t = time.perf_counter()
        n, b = loop(one_pass(), kind)
        dt = time.perf_counter() - t
        passes.append(dt)
        counts.append(n)
        measured += dt
    end = common.proc_status_mib()
    return {
        "contender": name,
        "size": lay.label,
        "ttfs_s": ttfs,
        "warmup_s": warm,
        "pass_s": passes,
        "samples": counts,
        "bytes": b,
        "peak_rss_mib": end.get("VmHWM"),
        "setup_rss_mib": base.get("VmRSS"),
        "peak_reset": peak_reset,
        "end_rss_anon_mib": end.get("RssAnon"),
        "end_rss_file_mib": end.get("RssFile"),
    }


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
        # The last line of a traceback is the exception; keep it table-safe.
        tail = (proc.stderr or proc.stdout).strip().splitlines() or ["no output"]
        return None, f"exit {proc.returncode}: {tail[-1].strip()[-300:]}".replace("|", "/")
    return json.loads(lines[-1]), proc.stderr


def prepare_all(args: argparse.Namespace, contenders: list[str]) -> dict[str, str]:
    """Writes every missing store; returns {"<size>/<kind>": error} for those that failed."""
    errors: dict[str, str] = {}
    kinds = ["flat", *sorted({STORES[c] for c in contenders if c in STORES})]
    for label in args.sizes:
        lay = Layout(args.data_dir, label)
        for kind in kinds:
            if lay.ready(kind):
                continue
            print(f"# preparing {label}/{kind}", file=sys.stderr)
            t = time.perf_counter()
            out, err = run_sub(
                ["--prepare", kind, "--size", label, "--data-dir", str(args.data_dir)], 1800
            )
            if out is None:
                errors[f"{label}/{kind}"] = err
                print(f"#   failed: {err}", file=sys.stderr)
            else:
                print(f"#   {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return errors


def summarise(
    runs: dict[str, list[dict[str, Any]]], errors: dict[str, str], lay: Layout
) -> dict[str, Any]:
    rows = []
    for name, results in runs.items():
        row: dict[str, Any] = {"contender": name, "label": LABELS[name], "size": lay.label}
        ok = [r for r in results if "error" not in r]
        if not ok:
            row["error"] = results[0]["error"] if results else "not run"
            rows.append(row)
            continue
        # One figure per process (median of its passes), then the median over the rounds.
        per_round = [common.median(r["pass_s"]) for r in ok]
        t = common.median(per_round)
        n = ok[0]["samples"][-1]
        row.update(
            {
                "samples": n,
                "expected_samples": lay.count,
                "pass_s": t,
                "samples_per_s": n / t,
                "mib_per_s": n * lay.size / t / common.MIB,
                "ttfs_s": common.median(r["ttfs_s"] for r in ok),
                # The warm-up pass, open included: DatasetRT's first epoch (it verifies each
                # record under "always" and "once"; the measured passes are epochs 2+).
                "first_pass_samples_per_s": common.median(
                    r["samples"][0] / r["warmup_s"] for r in ok
                ),
                "peak_rss_mib": common.median(r["peak_rss_mib"] for r in ok),
                "rss_added_mib": common.median(r["peak_rss_mib"] - r["setup_rss_mib"] for r in ok),
                "end_rss_file_mib": common.median(r["end_rss_file_mib"] for r in ok),
                "rounds": len(ok),
                # Aligned with the rounds (None where that round failed), for per-round ratios.
                "per_round_samples_per_s": [
                    None if "error" in r else r["samples"][-1] / common.median(r["pass_s"])
                    for r in results
                ],
            }
        )
        rows.append(row)
    by = {r["contender"]: r for r in rows}

    def per_round(r: dict[str, Any], ref: str) -> list[float]:
        """(this / ref) in each round where both ran: side by side, minutes apart at most."""
        other = by.get(ref, {}).get("per_round_samples_per_s") or []
        pairs = zip(r["per_round_samples_per_s"], other, strict=False)
        return [a / b for a, b in pairs if a and b]

    def ratio(r: dict[str, Any], ref: str) -> float | None:
        """Median over the rounds of (this / ref)."""
        values = per_round(r, ref)
        return common.median(values) if values else None

    for r in rows:
        if "samples_per_s" not in r:
            continue
        r["vs_floor"] = ratio(r, "floor")
        r["vs_dataset_rt"] = ratio(r, "dataset_rt")
        r["dataset_rt_speedup"] = 1 / r["vs_dataset_rt"] if r["vs_dataset_rt"] else None
        speedups = [1 / x for x in per_round(r, "dataset_rt")]
        r["dataset_rt_speedup_rounds"] = speedups
        # Warm data: the planner's cost, against the same reader with it off, round by round.
        r["vs_planner_off"] = ratio(r, r["contender"] + PLAIN)
    return {"size": lay.label, "samples": lay.count, "bytes": lay.count * lay.size, "rows": rows}


def speedup_cell(r: dict[str, Any]) -> str:
    """DatasetRT's speed over this contender: the median, and the range over the rounds."""
    mid, rounds = r.get("dataset_rt_speedup"), r.get("dataset_rt_speedup_rounds") or []
    if mid is None:
        return "-"
    if r["contender"] == "dataset_rt" or len(rounds) < 2:
        return common.fmt(mid)
    return f"{common.fmt(mid)} ({common.fmt(min(rounds))}-{common.fmt(max(rounds))})"


def print_table(res: dict[str, Any]) -> None:
    ceil = res["ceiling"]
    print(
        f"\n### Machine ceiling: memcpy {ceil['memcpy_gib_per_s']:.2f} GiB/s, warm page-cache "
        f"read {ceil['page_cache_gib_per_s']:.2f} GiB/s\n"
    )
    print(
        f"DatasetRT reads with verify={res['verify']!r}; its measured passes are epochs 2+, "
        "its first pass (open included) is the 1st-pass column."
    )
    for table in res["tables"]:
        size = common.SIZES[table["size"]]
        print(f"\n### {table['size']} samples ({table['samples']:,} samples, shuffled)\n")
        rows: list[list[Any]] = []
        for r in table["rows"]:
            if "error" in r:
                rows.append([r["label"], f"n/a: {r['error'][:120]}", *["-"] * 8])
                continue
            rows.append(
                [
                    r["label"],
                    r["samples_per_s"],
                    r["mib_per_s"],
                    r["first_pass_samples_per_s"],
                    r["ttfs_s"] * 1e3,
                    r["peak_rss_mib"],
                    r["rss_added_mib"],
                    r.get("vs_floor"),
                    speedup_cell(r),
                    r["samples"],
                ]
            )
        for key, what in (("memcpy", "memcpy"), ("page_cache", "page-cache read")):
            rate = ceil[f"{key}_gib_per_s"] * 2**30
            rows.append([f"ceiling: {what}", rate / size, rate / common.MIB, *["-"] * 7])
        print(
            common.markdown_table(
                [
                    "contender",
                    "samples/s",
                    "MiB/s",
                    "1st pass samples/s",
                    "1st sample ms",
                    "peak RSS MiB",
                    "RSS added MiB",
                    "x floor",
                    "DatasetRT x (range)",
                    "samples/pass",
                ],
                rows,
            )
        )
        for r in table["rows"]:
            if r.get("vs_planner_off"):
                print(
                    f"\n{r['label']}: {r['vs_planner_off']:.3f}x the same reader with the read "
                    "planner off (median of per-round ratios)"
                )


def first_sample(n: int, data_dir: Path, repeats: int, workers: int) -> dict[str, Any]:
    """Open, then the first shuffled sample (wall and CPU time), then the sample at the middle
    of a resumed pass: median of ``repeats`` rounds in this process (warm page cache, a fresh
    open and seed each)."""
    drt = common.import_dataset_rt()

    class Eights:
        # The format version in the name: a new format writes a new cache, not reads the old.
        name = f"first_sample_{n}_v{common.cache_format('drt')}"

        def __iter__(self) -> Any:
            return (drt.CacheInput(i.to_bytes(8, "little")) for i in range(n))

    base = data_dir / "first_sample"
    base.mkdir(parents=True, exist_ok=True)
    quiet = drt.WriterConfig(show_progress=False)
    t0 = time.perf_counter()
    with drt.DatasetRuntime(num_workers=workers) as runtime:
        write_s = time.perf_counter() - t0
        opens, firsts, resumes, cpu, anon = [], [], [], [], []
        for r in range(repeats):
            t1 = time.perf_counter()
            result = runtime.from_cache_sources(
                Eights(), base, reader_config=drt.ReaderConfig(seed=r), writer_config=quiet
            )
            t2 = time.perf_counter()
            dataset = result.dataset
            c2 = time.process_time()
            anon_before = common.proc_status_mib().get("RssAnon", 0.0)
            next(iter(dataset))
            t3 = time.perf_counter()
            cpu.append(time.process_time() - c2)
            anon.append(common.proc_status_mib().get("RssAnon", 0.0) - anon_before)
            state = {**dataset.state_dict(), "position": n // 2}
            dataset.load_state_dict(state)
            t4 = time.perf_counter()
            next(iter(dataset))
            t5 = time.perf_counter()
            opens.append(t2 - t1)
            firsts.append(t3 - t2)
            resumes.append(t5 - t4)
            if r == 0:
                write_s = t2 - t0
    return {
        "samples": n,
        "first_open_s (writes the cache if missing)": write_s,
        "open_ms": common.median(opens) * 1e3,
        "first_shuffled_sample_ms": common.median(firsts) * 1e3,
        "first_shuffled_sample_min_ms": min(firsts) * 1e3,
        # CPU time of every thread of the process: what the work costs, whatever the load.
        "first_shuffled_sample_cpu_ms": common.median(cpu) * 1e3,
        "first_sample_resumed_mid_epoch_ms": common.median(resumes) * 1e3,
        # Anonymous memory the first pass added (the order, the read window): MiB.
        "first_pass_anon_growth_mib": common.median(anon),
        "all_first_shuffled_sample_ms": [x * 1e3 for x in firsts],
        "peak_rss_mib": common.peak_rss_mib(),
    }


POLICIES = ["always", "once", "never"]


def verify_policies(args: argparse.Namespace) -> dict[str, Any]:
    """Rates of DatasetRT under each verification policy, epoch 1 and epochs 2+, and their
    ratios to "never" in the same round (median over the rounds)."""
    common.import_dataset_rt()
    errors = prepare_all(args, ["dataset_rt"])
    if errors:
        raise RuntimeError(f"writing the data failed: {errors}")
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {p: [] for p in POLICIES} for s in args.sizes
    }
    for r in range(args.repeats):
        for label in args.sizes:
            for policy in POLICIES:
                argv_w = ["--worker", "dataset_rt", "--size", label, "--policy", policy]
                argv_w += ["--open-first"]
                argv_w += ["--data-dir", str(args.data_dir), "--workers", str(args.workers)]
                argv_w += ["--prefetch", str(args.prefetch)]
                out, err = run_sub(argv_w, args.timeout)
                if out is None:
                    raise RuntimeError(f"{label} verify={policy}: {err}")
                runs[label][policy].append(out)
                print(
                    f"# round {r + 1} {label} verify={policy}: epoch 1 "
                    f"{out['samples'][0] / out['warmup_s']:,.0f} samples/s, epochs 2+ "
                    f"{out['samples'][-1] / common.median(out['pass_s']):,.0f} samples/s",
                    file=sys.stderr,
                )
    tables = []
    for label in args.sizes:
        rates: dict[str, dict[str, float]] = {}
        for policy, results in runs[label].items():
            rates[policy] = {
                "epoch1_samples_per_s": common.median(
                    x["samples"][0] / x["warmup_s"] for x in results
                ),
                "epoch2_samples_per_s": common.median(
                    x["samples"][-1] / common.median(x["pass_s"]) for x in results
                ),
            }
        # Ratios per round (the policies of a round ran back to back), then their median.
        for policy in POLICIES:
            pairs = list(zip(runs[label][policy], runs[label]["never"], strict=True))
            rates[policy]["epoch1_vs_never"] = common.median(
                (x["samples"][0] / x["warmup_s"]) / (n["samples"][0] / n["warmup_s"])
                for x, n in pairs
            )
            rates[policy]["epoch2_vs_never"] = common.median(
                (x["samples"][-1] / common.median(x["pass_s"]))
                / (n["samples"][-1] / common.median(n["pass_s"]))
                for x, n in pairs
            )
        tables.append({"size": label, "samples": runs[label]["never"][0]["samples"][-1], **rates})
    return {
        "machine": common.machine_info(),
        "dataset_rt": common.dataset_rt_origin(),
        "repeats": args.repeats,
        "workers": args.workers,
        "prefetch": args.prefetch,
        "command": " ".join(sys.argv),
        "verify": tables,
        "raw": runs,
    }


def print_verify_table(res: dict[str, Any]) -> None:
    print(f"\n{res['command']}")
    print("| size | verify | epoch 1 samples/s | vs never | epochs 2+ samples/s | vs never |")
    print("|---|---|---:|---:|---:|---:|")
    for t in res["verify"]:
        for policy in POLICIES:
            p = t[policy]
            print(
                f"| {t['size']} | {policy} | {p['epoch1_samples_per_s']:,.0f} | "
                f"{p['epoch1_vs_never']:.3f} | {p['epoch2_samples_per_s']:,.0f} | "
                f"{p['epoch2_vs_never']:.3f} |"
            )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=common.REPEATS)
    parser.add_argument("--data-dir", type=Path, default=common.DATA_DIR)
    parser.add_argument("--sizes", nargs="+", default=list(common.SIZES), choices=common.SIZES)
    parser.add_argument("--only", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    parser.add_argument("--workers", type=int, default=2, help="DatasetRuntime(num_workers)")
    parser.add_argument("--prefetch", type=int, default=64, help="ReaderConfig.prefetch_size")
    parser.add_argument(
        "--batch-size",
        type=int,
        default=256,
        help="dataset_rt_batches, dataset_rt_spans and flat_spans: samples per batch",
    )
    parser.add_argument("--timeout", type=float, default=300, help="seconds per contender run")
    parser.add_argument("--worker", choices=CONTENDERS, help=argparse.SUPPRESS)
    parser.add_argument("--prepare", help=argparse.SUPPRESS)
    parser.add_argument("--size", choices=common.SIZES, help=argparse.SUPPRESS)
    parser.add_argument(
        "--first-sample",
        type=int,
        metavar="N",
        help="only time the first shuffled sample after opening N 8-byte samples",
    )
    parser.add_argument(
        "--verify",
        action="store_true",
        help="only compare DatasetRT's ReaderConfig(verify=) policies, epoch 1 and epochs 2+",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        help="ReaderConfig(verify=) of the DatasetRT contenders (default: the library's default)",
    )
    parser.add_argument("--open-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.verify:
        out = verify_policies(args)
        common.write_results("read_verify", out)
        print_verify_table(out)
        return out

    if args.first_sample:
        out = first_sample(args.first_sample, args.data_dir, args.repeats, args.workers)
        print(json.dumps(out, indent=1))
        return out

    if args.prepare:
        prepare(Layout(args.data_dir, args.size), args.prepare)
        print(json.dumps({"ok": True}))
        return {}
    if args.worker:
        print(json.dumps(worker(args.worker, Layout(args.data_dir, args.size), args)))
        return {}

    common.import_dataset_rt()
    t0 = time.perf_counter()
    errors = prepare_all(args, args.only)
    res: dict[str, Any] = {
        "machine": common.machine_info(),
        "dataset_rt": common.dataset_rt_origin(),
        "fs": common.filesystem_of(args.data_dir),
        "data_dir": str(args.data_dir),
        "repeats": args.repeats,
        "workers": args.workers,
        "prefetch": args.prefetch,
        "python": sys.executable,
        "command": " ".join(sys.argv),
        "prepare_errors": errors,
        # DatasetRT's verification policy: --policy, else the library's default.
        "verify": args.policy or common.import_dataset_rt().ReaderConfig().verify,
    }
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        s: {c: [] for c in args.only} for s in args.sizes
    }
    memcpy, page = [], []
    for r in range(args.repeats):
        memcpy.append(common.memcpy_rate())
        page.append(common.page_cache_read_rate(Layout(args.data_dir, args.sizes[0]).flat))
        print(
            f"# round {r + 1}: memcpy {memcpy[-1] / 2**30:.2f} GiB/s, page cache "
            f"{page[-1] / 2**30:.2f} GiB/s",
            file=sys.stderr,
        )
        for label in args.sizes:
            for name in args.only:
                store = STORES.get(name, "flat")
                if f"{label}/{store}" in errors or f"{label}/flat" in errors:
                    err = errors.get(f"{label}/{store}") or errors[f"{label}/flat"]
                    runs[label][name].append({"error": f"writing its data failed: {err}"})
                    continue
                argv_w = ["--worker", name, "--size", label, "--data-dir", str(args.data_dir)]
                argv_w += ["--workers", str(args.workers), "--prefetch", str(args.prefetch)]
                argv_w += ["--batch-size", str(args.batch_size)]
                argv_w += ["--policy", args.policy] if args.policy else []
                out, err = run_sub(argv_w, args.timeout)
                if out is None:
                    runs[label][name].append({"error": err})
                    print(f"#   {label} {name}: FAILED {err}", file=sys.stderr)
                    continue
                runs[label][name].append(out)
                sps = out["samples"][-1] / common.median(out["pass_s"])
                print(
                    f"#   {label} {name}: {sps:,.0f} samples/s, first sample "
                    f"{out['ttfs_s'] * 1e3:.1f} ms",
                    file=sys.stderr,
                )
    res["ceiling"] = {
        "memcpy_gib_per_s": common.median(memcpy) / 2**30,
        "page_cache_gib_per_s": common.median(page) / 2**30,
        "memcpy_all": [x / 2**30 for x in memcpy],
        "page_cache_all": [x / 2**30 for x in page],
    }
    res["tables"] = [summarise(runs[s], errors, Layout(args.data_dir, s)) for s in args.sizes]
    res["raw"] = runs
    res["seconds"] = time.perf_counter() - t0
    common.write_results("read", res)
    print_table(res)
    return res


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
