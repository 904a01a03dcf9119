"""Building a cache in parallel: a cache set written by 1 and N processes and by Ray Data, against
LitData's ``optimize`` and MosaicML Streaming's ``MDSWriter``, in one run.

Two sources, each split into the same parts for every contender:

- CPU-bound: synthetic 64x64 RGB images encoded as PNG by Pillow in the source (about 1 ms a
  sample, ~12 KB each), with ``sample_id`` and ``label``;
- I/O-bound: raw 128 KiB payloads that cost the source nothing (64 distinct payloads, reused).

Contenders, each timed from the call until its output is complete on disk:

- DatasetRT, ``CacheSet`` + ``WriterConfig(processes=1)`` and ``processes=N`` (N defaults to the
  machine's cores), until the set is published and loaded;
- DatasetRT through Ray Data (``dataset_rt.ray.write_cache_set``) on a local cluster of N CPUs
  started before the clock (one row per sample index; ``to_input`` makes the sample in the task,
  one block per part);
- LitData ``optimize(num_workers=N)`` (each sample made by its ``fn``), when ``litdata`` imports;
- MosaicML Streaming's ``MDSWriter``, one process, when ``streaming`` imports.

Also measured in the same run: the source alone (the same parts iterated, nothing written) in one
process and in N ``spawn`` processes, which is what N processes can gain on this machine at
best; the disk's sequential write rate (a buffered write with ``fsync`` into the same
directory); and, for each contender, the machine's CPU use while it ran
(busy cores, from ``/proc/stat``: 2.0 is both cores of a 2-core machine, whoever used them),
and the cores the contender itself used (CPU time of this process and its waited-for children
over the wall time; Ray's workers are not its children, so Ray's row counts only the driver).
A machine busier than the contender's own share was running other work meanwhile.

The machine is shared and its speed drifts, so every contender runs in each of ``--rounds``
rounds (3 by default), each round measures the disk again, and a target is the median of its
per-round ratios (a ratio is only taken between contenders of one round).

    PYTHONPATH=/tmp/bench_site python bench/bench_build.py
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common

IMAGE_SIDE = 64
RAW_SIZE = 128 * 1024
_RAW_POOL: list[bytes] = []


def png_sample(index: int) -> bytes:
    """Image ``index``: seeded noise, encoded as PNG (the CPU-bound source's work)."""
    import numpy as np
    from PIL import Image

    pixels = np.random.default_rng(index).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG", compress_level=6)
    return out.getvalue()


def raw_sample(index: int) -> bytes:
    """Payload ``index``: one of 64 distinct 128 KiB payloads, made once per process."""
    if not _RAW_POOL:
        import numpy as np

        rng = np.random.default_rng(7)
        _RAW_POOL.extend(rng.bytes(RAW_SIZE) for _ in range(64))
    return _RAW_POOL[index % len(_RAW_POOL)]


SAMPLE: dict[str, Callable[[int], bytes]] = {"cpu": png_sample, "io": raw_sample}


class Part:
    """Part ``part`` of a source: samples ``start .. start + count`` made by ``kind``'s function
    as they are iterated (picklable: spawn workers get it)."""

    def __init__(self, kind: str, start: int, count: int) -> None:
        self.kind = kind
        self.start = start
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        from dataset_rt import CacheInput

        make = SAMPLE[self.kind]
        for i in range(self.start, self.start + self.count):
            yield CacheInput(make(i), {"sample_id": i, "label": i % 10})


def row_to_input(row: dict[str, Any]) -> Any:
    """Ray Data: one row (``kind``, ``i``) to its sample, made in the Ray task."""
    from dataset_rt import CacheInput

    i = int(row["i"])
    return CacheInput(SAMPLE[row["kind"]](i), {"sample_id": i, "label": i % 10})


def litdata_cpu(i: int) -> dict[str, Any]:
    return {"data": png_sample(i), "label": i % 10}


def litdata_io(i: int) -> dict[str, Any]:
    return {"data": raw_sample(i), "label": i % 10}


# --------------------------------------------------------------------------------------------
# Measuring


def cpu_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def own_cpu_seconds() -> float:
    """CPU time of this process and of its children that were waited for."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def measure(run: Callable[[], None]) -> tuple[float, float, float]:
    """Seconds ``run`` takes; the machine's busy cores meanwhile (everything running on it);
    and the cores this process and its waited-for children used (Ray's workers are not)."""
    busy0, total0 = cpu_ticks()
    own0 = own_cpu_seconds()
    t0 = time.perf_counter()
    run()
    seconds = time.perf_counter() - t0
    own = (own_cpu_seconds() - own0) / seconds
    busy1, total1 = cpu_ticks()
    cores = os.cpu_count() or 1
    busy = (busy1 - busy0) / max(1, total1 - total0) * cores
    return seconds, busy, own


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Peers print progress bars: into /dev/null with them (file descriptors, for children)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


# --------------------------------------------------------------------------------------------
# Contenders


def dataset_rt_set(drt: Any, kind: str, parts: list[Part], out: Path, processes: int) -> None:
    with drt.DatasetRuntime(num_workers=os.cpu_count() or 2) as runtime:
        result = runtime.from_cache_sources(
            drt.CacheSet("build", parts),
            out,
            writer_config=drt.WriterConfig(processes=processes, show_progress=False),
        )
    if not isinstance(result, drt.CacheSourcesDatasetSuccess):
        raise RuntimeError(result.message)


def drain(part: Part) -> int:
    """Iterates ``part`` and drops what it makes: the source's own work, with nothing written."""
    return sum(1 for _ in part)


def source_alone(parts: list[Part], processes: int) -> None:
    """The reference for the processes' scaling: the same parts iterated with nothing written,
    in this process (1) or in ``processes`` fresh ``spawn`` processes that take the parts in
    turn, as the cache set's workers do (their start is on the clock)."""
    if processes == 1:
        for part in parts:
            drain(part)
        return
    from multiprocessing import get_context

    with get_context("spawn").Pool(processes) as pool:
        pool.map(drain, parts, chunksize=1)


def ray_set(drt: Any, kind: str, parts: list[Part], out: Path) -> None:
    import ray

    from dataset_rt.ray import write_cache_set

    rows = [{"kind": kind, "i": i} for p in parts for i in range(p.start, p.start + p.count)]
    ds = ray.data.from_items(rows, override_num_blocks=len(parts))
    results = write_cache_set(
        ds, "build", out, row_to_input, writer_config=drt.WriterConfig(show_progress=False)
    )
    if type(results[-1]).__name__ != "CacheWritten":
        raise RuntimeError(f"Ray build failed: {results[-1]}")


def litdata_optimize(kind: str, total: int, out: Path, workers: int) -> None:
    from litdata import optimize

    fn = litdata_cpu if kind == "cpu" else litdata_io
    with quiet():
        optimize(
            fn=fn,
            inputs=list(range(total)),
            output_dir=str(out),
            num_workers=workers,
            chunk_bytes="64MB",
        )


def streaming_mds(kind: str, total: int, out: Path) -> None:
    from streaming import MDSWriter

    make = SAMPLE[kind]
    columns = {"data": "bytes", "label": "int"}
    with quiet(), MDSWriter(out=str(out), columns=columns, size_limit=64 * common.MIB) as w:
        for i in range(total):
            w.write({"data": make(i), "label": i % 10})


def start_ray(cpus: int, temp: Path) -> bool:
    try:
        import ray
        import ray.data
    except ImportError:
        return False
    paths = [str(common.BENCH_DIR), str(common.REPO_ROOT), *sys.path]
    env = {"PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    with quiet():
        ray.init(
            num_cpus=cpus,
            include_dashboard=False,
            log_to_driver=False,
            _temp_dir=str(temp),
            runtime_env={"env_vars": env},
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
    return True


def importable(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def bench_source(
    drt: Any, kind: str, parts: int, per_part: int, n: int, work: Path, ray_on: bool
) -> list[dict[str, Any]]:
    total = parts * per_part
    split = [Part(kind, p * per_part, per_part) for p in range(parts)]
    contenders: list[tuple[str, Callable[[Path], None]]] = [
        ("the source alone, 1 process", lambda out: source_alone(split, 1)),
        (f"the source alone, {n} processes", lambda out: source_alone(split, n)),
        ("DatasetRT, 1 process", lambda out: dataset_rt_set(drt, kind, split, out, 1)),
        (f"DatasetRT, {n} processes", lambda out: dataset_rt_set(drt, kind, split, out, n)),
    ]
    if ray_on:
        contenders.append(
            (f"DatasetRT, Ray Data ({n} CPUs)", lambda out: ray_set(drt, kind, split, out))
        )
    if importable("litdata"):
        contenders.append(
            (f"LitData optimize, {n} workers", lambda out: litdata_optimize(kind, total, out, n))
        )
    if importable("streaming"):
        contenders.append(
            ("Streaming MDSWriter, 1 process", lambda out: streaming_mds(kind, total, out))
        )
    rows = []
    for label, run in contenders:
        out = common.reset_dir(work / "out")
        os.sync()
        try:
            seconds, busy, own = measure(lambda run=run, out=out: run(out))
        except Exception as error:  # a peer that fails is reported, not fatal
            print(f"# {kind} {label}: failed: {error!r}", file=sys.stderr)
            rows.append({"source": kind, "label": label, "error": repr(error)})
            continue
        nbytes = common.dir_bytes(out)
        row = {
            "source": kind,
            "label": label,
            "samples": total,
            "seconds": seconds,
            "samples_per_s": total / seconds,
            "output_mib": nbytes / common.MIB,
            "mib_per_s": nbytes / common.MIB / seconds,
            "busy_cores": busy,
            "own_cores": own,
        }
        rows.append(row)
        print(
            f"# {kind} {label}: {row['samples_per_s']:,.0f} samples/s, "
            f"{row['mib_per_s']:,.1f} MiB/s, {busy:.2f} cores busy, {own:.2f} its own",
            file=sys.stderr,
        )
        shutil.rmtree(out, ignore_errors=True)
    return rows


def ratio(rows: list[dict[str, Any]], a: str, b: str) -> float | None:
    by = {r["label"]: r for r in rows if "samples_per_s" in r}
    if a not in by or b not in by:
        return None
    return float(by[a]["samples_per_s"] / by[b]["samples_per_s"])


def targets(
    rows: list[dict[str, Any]], disk_mib_per_s: float, n: int
) -> list[tuple[str, float | None, float | None]]:
    """The targets' ratios in one round, from its ``rows`` and disk rate (a ratio with no need
    is a reference)."""
    cpu = [r for r in rows if r["source"] == "cpu"]
    io_rows = [r for r in rows if r["source"] == "io"]
    one, many = "DatasetRT, 1 process", f"DatasetRT, {n} processes"
    alone = ("the source alone, 1 process", f"the source alone, {n} processes")
    ray_label, lit = f"DatasetRT, Ray Data ({n} CPUs)", f"LitData optimize, {n} workers"
    many_io = next((r for r in io_rows if r["label"] == many and "mib_per_s" in r), None)
    return [
        (f"CPU-bound: {n} processes / 1 process", ratio(cpu, many, one), 1.8),
        (
            f"CPU-bound: the source alone, {n} processes / 1 process (the machine's own scaling)",
            ratio(cpu, alone[1], alone[0]),
            None,
        ),
        (f"CPU-bound: {n} processes / LitData {n} workers", ratio(cpu, many, lit), 2.0),
        (f"I/O-bound: {n} processes / 1 process", ratio(io_rows, many, one), 1.0),
        (
            f"I/O-bound: {n} processes MiB/s / disk sequential write",
            many_io["mib_per_s"] / disk_mib_per_s if many_io else None,
            0.8,
        ),
        (f"CPU-bound: Ray Data / {n} processes", ratio(cpu, ray_label, many), 0.8),
        (f"I/O-bound: Ray Data / {n} processes", ratio(io_rows, ray_label, many), 0.8),
    ]


def median_targets(res: dict[str, Any], n: int) -> list[dict[str, Any]]:
    """Each target's ratio in every round, and their median: the machine is shared, so a ratio
    is only taken between contenders of the same round."""
    per_round = [
        targets([r for r in res["rows"] if r["round"] == k], disk, n)
        for k, disk in enumerate(res["disk_mib_per_s"])
    ]
    out = []
    for i, (name, _, need) in enumerate(per_round[0]):
        values = [v for t in per_round if (v := t[i][1]) is not None]
        median = statistics.median(values) if values else None
        out.append({"target": name, "rounds": values, "measured": median, "needed": need})
    return out


def median_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per (source, contender): the medians over the rounds it completed."""
    keys = ["seconds", "samples_per_s", "output_mib", "mib_per_s", "busy_cores", "own_cores"]
    grouped: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in res["rows"]:
        grouped.setdefault((r["source"], r["label"]), []).append(r)
    out = []
    for (source, label), rows in grouped.items():
        done = [r for r in rows if "samples_per_s" in r]
        row: dict[str, Any] = {"source": source, "label": label, "rounds": len(done)}
        if done:
            row["samples"] = done[0]["samples"]
            row.update({k: statistics.median(r[k] for r in done) for k in keys})
        out.append(row)
    return out


def met(value: float | None, need: float | None) -> str:
    return "-" if value is None or need is None else ("yes" if value >= need else "no")


def print_tables(res: dict[str, Any]) -> None:
    rounds = len(res["disk_mib_per_s"])
    for kind, title in (("cpu", "CPU-bound source (PNG)"), ("io", "I/O-bound source (raw)")):
        rows = [r for r in median_rows(res) if r["source"] == kind]
        if not rows:
            continue
        print(f"\n### {title}, medians of {rounds} round(s)\n")
        print(
            common.markdown_table(
                [
                    "contender",
                    "rounds",
                    "samples",
                    "s",
                    "samples/s",
                    "MiB out",
                    "MiB/s",
                    "machine busy cores",
                    "own cores",
                ],
                [
                    [
                        r["label"],
                        r["rounds"],
                        r.get("samples"),
                        r.get("seconds"),
                        r.get("samples_per_s"),
                        r.get("output_mib"),
                        r.get("mib_per_s"),
                        r.get("busy_cores"),
                        r.get("own_cores"),
                    ]
                    for r in rows
                ],
            )
        )
    disks = ", ".join(f"{d:,.0f}" for d in res["disk_mib_per_s"])
    print(f"\nDisk sequential write (fsync), each round: {disks} MiB/s\n")
    print(
        common.markdown_table(
            ["target (median of per-round ratios)", "each round", "measured", "needed", "met"],
            [
                [
                    t["target"],
                    " ".join(f"{v:.2f}" for v in t["rounds"]),
                    t["measured"],
                    t["needed"],
                    met(t["measured"], t["needed"]),
                ]
                for t in res["targets"]
            ],
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = os.cpu_count() or 2
    parser.add_argument("--processes", type=int, default=cores, help="N (default: the cores)")
    parser.add_argument("--parts", type=int, default=8, help="parts of each source")
    parser.add_argument("--cpu-samples", type=int, default=8000, help="PNG samples in all")
    parser.add_argument("--io-mib", type=int, default=1024, help="MiB of raw samples in all")
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of every contender; targets are medians of the per-round ratios",
    )
    parser.add_argument("--no-ray", action="store_true", help="leave Ray Data out")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    drt = common.import_dataset_rt()
    n = args.processes
    work = common.reset_dir(common.DATA_DIR / "build")
    ray_on = not args.no_ray and start_ray(n, common.reset_dir(work / "ray"))
    io_per_part = max(1, args.io_mib * common.MIB // RAW_SIZE // args.parts)
    res: dict[str, Any] = {
        "machine": common.machine_info(),
        "fs": common.filesystem_of(work),
        "dataset_rt": common.dataset_rt_origin(),
        "processes": n,
        "parts": args.parts,
        "rounds": args.rounds,
        "disk_mib_per_s": [],
        "rows": [],
    }
    for k in range(args.rounds):
        disk = common.disk_write_rate(work) / common.MIB
        res["disk_mib_per_s"].append(disk)
        print(f"# round {k + 1}/{args.rounds}, disk: {disk:,.0f} MiB/s", file=sys.stderr)
        for kind, per_part in (("cpu", args.cpu_samples // args.parts), ("io", io_per_part)):
            rows = bench_source(drt, kind, args.parts, per_part, n, work, ray_on)
            res["rows"] += [{**r, "round": k} for r in rows]
    res["targets"] = median_targets(res, n)
    if ray_on:
        import ray

        ray.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    common.write_results("build", res)
    print_tables(res)


if __name__ == "__main__":
    main()
