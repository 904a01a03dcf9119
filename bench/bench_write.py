"""Write throughput against the disk's sequential write rate, and cache open time.

Measured side by side in one run, each figure the median of ``--repeats`` rounds, every round
measuring the disk first and then each (size, compression) write:

- disk: a 1 GiB sequential write with large buffered ``os.write`` calls and ``fsync``, from
  Python, into the same directory the caches are written to, before and after each round's
  writes (the round's disk rate is their mean; write ratios are taken per round);
- source: iterating the Python source alone (``CacheInput`` objects, no writer), the writer's
  lower bound on this machine;
- DatasetRT: ``from_cache_sources`` writing ~256 MiB of 4 KiB or 128 KiB samples (metadata:
  ``sample_id``, ``label``), ``algo="none"`` vs ``algo="lz4", ratio=0.9``, until the cache is
  published and loaded (the writer fsyncs);
- open: ``from_cache_sources`` on an existing cache of 1 thousand to 10 million 8-byte samples
  (written once under ``$BENCH_DATA_DIR/open`` and reused), then the first sample (shuffled and
  in storage order), and ``samples_metadata()``.

The "GIL thread" column is the CPU time of the calling thread (``time.thread_time``) per sample:
iterating the source, converting each ``CacheInput`` and handing it to the writer. The pool's
encoding and disk writes run on other threads and are not in it; waiting is not CPU time.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common

OPEN_SIZES = [1_000, 100_000, 1_000_000, 10_000_000]
WRITE_CONFIGS = [("none", 1.0), ("lz4", 0.9)]


class PayloadSource:
    """A source of pre-built payloads with ``sample_id`` and ``label`` metadata."""

    def __init__(self, name: str, payloads: list[bytes], cache_input: Any) -> None:
        self.name = name
        self.payloads = payloads
        self.cache_input = cache_input

    def __iter__(self) -> Iterator[Any]:
        make = self.cache_input
        for i, p in enumerate(self.payloads):
            yield make(data=p, metadata={"sample_id": i, "label": i % 1000})


class TinySource:
    """``count`` samples of 8 bytes (the sample id) with ``sample_id`` and ``label``."""

    def __init__(self, name: str, count: int, cache_input: Any) -> None:
        self.name = name
        self.count = count
        self.cache_input = cache_input

    def __iter__(self) -> Iterator[Any]:
        make = self.cache_input
        for i in range(self.count):
            yield make(data=i.to_bytes(8, "little"), metadata={"sample_id": i, "label": i % 1000})


class NameOnly:
    """A source that only names its cache: loaded when it exists, never written."""

    def __init__(self, name: str) -> None:
        self.name = name


def open_cache(drt: Any, runtime: Any, base: Path, name: str, shuffle: bool = True) -> Any:
    result = runtime.from_cache_sources(
        NameOnly(name),
        base,
        reader_config=drt.ReaderConfig(seed=0, shuffle=shuffle),
        writer_config=drt.WriterConfig(show_progress=False),
    )
    if not isinstance(result, drt.CacheSourcesDatasetSuccess):
        raise RuntimeError(f"cannot open {base / name}: {result.message}")
    return result.dataset


def bench_throughput(drt: Any, runtime: Any, workdir: Path, repeats: int) -> dict[str, Any]:
    payloads: dict[str, list[bytes]] = {}
    for label, size in common.SIZES.items():
        buf = common.payload_buffer(common.num_samples(size), size, seed=size)
        payloads[label] = common.payload_list(buf, size)
        del buf
    disk: list[float] = []
    source: dict[str, list[float]] = {k: [] for k in common.SIZES}
    runs: dict[str, dict[str, list[float]]] = {}
    gil: dict[str, list[float]] = {}
    stored: dict[str, int] = {}
    for r in range(repeats):
        before = common.disk_write_rate(workdir)  # 1 GiB, fsync
        for label, items in payloads.items():
            src = PayloadSource("src", items, drt.CacheInput)
            cpu0 = time.thread_time()
            source[label].append(common.timed(lambda s=src: sum(1 for _ in s))[0])
            gil.setdefault(label, []).append((time.thread_time() - cpu0) / len(items))
            for algo, ratio in WRITE_CONFIGS:
                key = f"{label}/{algo}"
                base = common.reset_dir(workdir / "caches")
                config = drt.WriterConfig(
                    show_progress=False,
                    shard_compression=drt.ShardCompression(algo=algo, ratio=ratio),
                )
                cpu0 = time.thread_time()
                t, result = common.timed(
                    lambda base=base, config=config, items=items, algo=algo: (
                        runtime.from_cache_sources(
                            PayloadSource(f"w_{algo}", items, drt.CacheInput),
                            base,
                            writer_config=config,
                        )
                    )
                )
                gil.setdefault(key, []).append((time.thread_time() - cpu0) / len(items))
                if not isinstance(result, drt.CacheSourcesDatasetSuccess):
                    raise RuntimeError(result.message)
                runs.setdefault(key, {"seconds": []})["seconds"].append(t)
                stored[key] = common.dir_bytes(base / f"w_{algo}" / "shards")
                del result
                print(f"#   {key}: {t:.2f} s", file=sys.stderr)
        # The round's disk rate brackets its writes: the mean of a run before and one after.
        after = common.disk_write_rate(workdir)
        disk.append((before + after) / 2)
        print(
            f"# round {r + 1}: disk {before / common.MIB:,.0f} then "
            f"{after / common.MIB:,.0f} MiB/s",
            file=sys.stderr,
        )
    shutil.rmtree(workdir / "caches", ignore_errors=True)
    disk_rate = common.median(disk)
    rows = []
    for label, size in common.SIZES.items():
        n = len(payloads[label])
        raw = n * size
        t_src = common.median(source[label])
        src_rounds = [raw / x / d for x, d in zip(source[label], disk, strict=True)]
        gil_src = common.median(gil[label])

        rows.append(
            {
                "case": f"{label} source only",
                "size": label,
                "algo": "-",
                "samples": n,
                "seconds": t_src,
                "samples_per_s": n / t_src,
                "mib_per_s": raw / t_src / common.MIB,
                "ratio_to_disk": common.median(src_rounds),
                "ratio_to_disk_per_round": src_rounds,
                "gil_thread_us_per_sample": gil_src * 1e6,
            }
        )
        for algo, _ in WRITE_CONFIGS:
            key = f"{label}/{algo}"
            times = runs[key]["seconds"]
            t = common.median(times)
            # Side by side: each round's write rate over that round's disk rate, then the median.
            per_round = [raw / x / d for x, d in zip(times, disk, strict=True)]
            rows.append(
                {
                    "case": f"{label} {algo}",
                    "size": label,
                    "algo": algo,
                    "samples": n,
                    "seconds": t,
                    "all_seconds": runs[key]["seconds"],
                    "samples_per_s": n / t,
                    "mib_per_s": raw / t / common.MIB,
                    "stored_mib_per_s": stored[key] / t / common.MIB,
                    "stored_fraction": stored[key] / raw,
                    "ratio_to_disk": common.median(per_round),
                    "ratio_to_disk_per_round": per_round,
                    "gil_thread_us_per_sample": common.median(gil[key]) * 1e6,
                    "conversion_us_per_sample": (common.median(gil[key]) - gil_src) * 1e6,
                    "stored_ratio_to_disk": common.median(
                        stored[key] / x / d for x, d in zip(times, disk, strict=True)
                    ),
                }
            )
    return {
        "disk_mib_per_s": disk_rate / common.MIB,
        "disk_all_mib_per_s": [d / common.MIB for d in disk],
        "rows": rows,
    }


def ensure_open_cache(drt: Any, runtime: Any, base: Path, count: int) -> dict[str, Any]:
    name = f"open_{count}"
    if (base / name / "manifest.json").exists():
        return {"written_now": False}
    print(f"# writing the {count:,}-sample cache {base / name} (once)", file=sys.stderr)
    t, result = common.timed(
        lambda: runtime.from_cache_sources(
            TinySource(name, count, drt.CacheInput),
            base,
            writer_config=drt.WriterConfig(show_progress=False, prefetch_size=1024),
        )
    )
    if not isinstance(result, drt.CacheSourcesDatasetSuccess):
        raise RuntimeError(result.message)
    return {"written_now": True, "write_seconds": t, "write_samples_per_s": count / t}


def bench_open(drt: Any, runtime: Any, base: Path, repeats: int, max_n: int) -> dict[str, Any]:
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    for count in [n for n in OPEN_SIZES if n <= max_n]:
        info = ensure_open_cache(drt, runtime, base, count)
        name = f"open_{count}"
        opens, iters, nexts, first_ordered, meta, meta_native = [], [], [], [], [], []
        for _ in range(repeats):
            gc.collect()
            t, ds = common.timed(lambda name=name: open_cache(drt, runtime, base, name, True))
            opens.append(t)
            # First sample = iter() (computes the epoch order) + next() (reads the sample).
            t_iter, it = common.timed(lambda ds=ds: iter(ds))
            iters.append(t_iter)
            nexts.append(common.timed(lambda it=it: next(it))[0])
            del it, ds
            ds = open_cache(drt, runtime, base, name, False)
            first_ordered.append(common.timed(lambda ds=ds: next(iter(ds)))[0])
            meta.append(common.timed(ds.samples_metadata)[0])
            # The Rust part alone (the table's record batches as an Arrow C stream capsule),
            # without Polars importing it.
            meta_native.append(common.timed(ds._native.samples_metadata_stream)[0])
            del ds
        row = {
            "samples": count,
            "open_s": common.median(opens),
            "first_sample_shuffled_s": common.median(
                a + b for a, b in zip(iters, nexts, strict=True)
            ),
            "iter_shuffled_s": common.median(iters),
            "next_shuffled_s": common.median(nexts),
            "first_sample_ordered_s": common.median(first_ordered),
            "samples_metadata_s": common.median(meta),
            "samples_metadata_native_s": common.median(meta_native),
            "cache_mib": common.dir_bytes(base / name) / common.MIB,
            "all_open_s": opens,
            **info,
        }
        rows.append(row)
        print(
            f"# open {count:,}: {row['open_s'] * 1e3:.1f} ms, first sample "
            f"{row['first_sample_shuffled_s'] * 1e3:.1f} ms",
            file=sys.stderr,
        )
    return {"rows": rows}


def print_tables(res: dict[str, Any]) -> None:
    tp = res.get("throughput")
    if tp is None:
        print("\n(write throughput skipped)")
    else:
        print_throughput(res, tp)
    print_open(res)


def print_throughput(res: dict[str, Any], tp: dict[str, Any]) -> None:
    disks = ", ".join(f"{d:,.0f}" for d in tp["disk_all_mib_per_s"])
    print(
        f"\n### Write throughput (disk: {tp['disk_mib_per_s']:,.0f} MiB/s, median of {disks}; "
        f"{res['fs']})\n"
    )

    def ratio_cell(r: dict[str, Any]) -> str:
        rounds = r.get("ratio_to_disk_per_round") or []
        mid = common.fmt(r["ratio_to_disk"])
        if len(rounds) < 2:
            return mid
        return f"{mid} ({common.fmt(min(rounds))}-{common.fmt(max(rounds))})"

    print(
        common.markdown_table(
            [
                "case",
                "samples",
                "samples/s",
                "MiB/s",
                "stored/raw",
                "x disk rate (range)",
                "GIL thread µs/sample",
                "of which writer",
            ],
            [
                [
                    r["case"],
                    r["samples"],
                    r["samples_per_s"],
                    r["mib_per_s"],
                    r.get("stored_fraction"),
                    ratio_cell(r),
                    r["gil_thread_us_per_sample"],
                    r.get("conversion_us_per_sample"),
                ]
                for r in tp["rows"]
            ],
        )
    )


def print_open(res: dict[str, Any]) -> None:
    print("\n### Cache open (8-byte samples, sample_id + label)\n")
    print(
        common.markdown_table(
            [
                "samples",
                "open ms",
                "1st sample ms (shuffled)",
                "of which epoch order",
                "1st sample ms (ordered)",
                "samples_metadata() ms",
                "of which Rust export",
            ],
            [
                [
                    r["samples"],
                    r["open_s"] * 1e3,
                    r["first_sample_shuffled_s"] * 1e3,
                    r["iter_shuffled_s"] * 1e3,
                    r["first_sample_ordered_s"] * 1e3,
                    r["samples_metadata_s"] * 1e3,
                    r["samples_metadata_native_s"] * 1e3,
                ]
                for r in res["open"]["rows"]
            ],
        )
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=common.REPEATS)
    parser.add_argument("--data-dir", type=Path, default=common.DATA_DIR)
    parser.add_argument("--workers", type=int, default=2, help="DatasetRuntime(num_workers)")
    parser.add_argument("--max-open", type=int, default=OPEN_SIZES[-1])
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    drt = common.import_dataset_rt()
    workdir = args.data_dir / "write"
    workdir.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "machine": common.machine_info(),
        "dataset_rt": common.dataset_rt_origin(),
        "fs": common.filesystem_of(workdir),
        "data_dir": str(args.data_dir),
        "repeats": args.repeats,
        "workers": args.workers,
        "command": " ".join(sys.argv),
    }
    t0 = time.perf_counter()
    with drt.DatasetRuntime(num_workers=args.workers) as runtime:
        if not args.skip_throughput:
            res["throughput"] = bench_throughput(drt, runtime, workdir, args.repeats)
        res["open"] = bench_open(drt, runtime, args.data_dir / "open", args.repeats, args.max_open)
    res["seconds"] = time.perf_counter() - t0
    common.write_results("write", res)
    print_tables(res)
    return res


if __name__ == "__main__":
    main()
