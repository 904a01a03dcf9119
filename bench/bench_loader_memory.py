"""Memory while an epoch runs: the summed PSS of the training process and all its descendants,
DatasetRT's loader against ``torch.utils.data.DataLoader`` with the same ``num_workers`` over
the same cache.

The workloads, their data and the contenders are ``bench_loader.py``'s (batches of 64, shuffled,
the page cache warm, torch imported first in every training process):

- ``128KiB``: raw bytes to the training loop. ``drt_w2`` is ``dataset_rt.DataLoader`` with 2
  workers (the payloads reach the loop as views of the workers' result memory);
  ``torch_cache_w2`` is torch's 2-worker ``DataLoader`` over a map-style dataset that maps the
  very same DatasetRT cache (payloads pickled back through pipes);
- ``arrays``: each 150,528-byte payload flipped into a 3x224x224 uint8 tensor, 64 collated into
  a batch. ``drt_w2`` is ``dataset_rt.torch.DataLoader`` (its default collate stacks into the
  worker's result memory); ``torch_cache_w2`` is torch's, same transform, same cache, its default
  collate (each batch through its own shared-memory file). ``torch_flat_w2`` and ``drt_np_w2``
  can be added with ``--contenders``.

Each contender runs in a fresh interpreter that says on stdout when each epoch starts and ends.
Meanwhile this process reads ``/proc/PID/smaps_rollup`` of that interpreter and of every process
below it (producer, workers), back to back, and keeps the largest sum among the samples taken
inside an epoch, with its anonymous / file-backed / shared-memory split and the training
process's own share. PSS divides each page among the processes mapping it, so the sum counts
every page of the tree once: the libraries forked workers share, the ring, result memory,
torch's shared-memory batches, and the pages of the cache's shards that the tree maps (both
loaders map them). A sample costs ~13 ms per process that imported torch, so an epoch gets a
few dozen samples: the peak is the largest sampled sum, not the exact maximum. PSS counts only
mapped pages: shared memory that only a file descriptor keeps (torch's batches waiting in its
queues travel as descriptors) is in no process's PSS. The ``system Shmem +`` column is the growth
of the whole system's shared memory (``/proc/meminfo``) from before the first epoch to its
largest sample in an epoch, which counts those too, and also other jobs' segments, which come
and go: a rough figure. Rounds alternate
the contenders; figures are medians over rounds, and the ratio (DatasetRT / torch) is also
taken within each round, then the median (paired).

    PYTHONPATH=$PWD python bench/bench_loader_memory.py --data-dir /tmp/bench_data
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import bench_loader
import common
import procs

WORKLOADS = ["128KiB", "arrays"]
CONTENDERS = ["drt_w2", "torch_cache_w2"]
# What every ratio is taken against: torch's DataLoader, same num_workers, same cache.
BASELINE = "torch_cache_w2"
# Between two samples of the tree (a sample itself takes ~13 ms per torch process).
SAMPLE_GAP_S = 0.01
# The training process before its first epoch, loader built: what both contenders start from.
IDLE_S = 0.5
CHILD_TIMEOUT_S = 300


def child(name: str, lay: bench_loader.Layout, epochs: int) -> dict[str, Any]:
    """One contender: ``epochs`` epochs, each announced on stdout (``PHASE epoch``) and closed
    (``PHASE between``), the loop reading every batch as ``bench_loader.py``'s does."""
    import torch  # noqa: F401  (a training process has it loaded; forked workers inherit it)

    def phase(name: str) -> None:
        print(f"PHASE {name}", flush=True)

    loader, payload = bench_loader.open_loader(name, lay)
    arrays = lay.workload == "arrays"
    phase("idle")
    time.sleep(IDLE_S)
    runs = []
    for _ in range(epochs):
        phase("epoch")
        n = check = 0
        t0 = time.perf_counter()
        for batch in loader:
            if arrays:
                n += len(batch)
                check ^= int(batch[0][0][0][0])
            else:
                for x in batch:
                    check ^= payload(x)[0]
                    n += 1
        runs.append({"samples": n, "epoch_s": time.perf_counter() - t0, "check": check})
        phase("between")
    close = getattr(loader, "close", None)
    if callable(close):
        close()
    return {"contender": name, "workload": lay.workload, "epochs": runs}


def system_shmem() -> int:
    """Bytes of shared memory in the whole system (``/proc/meminfo``'s ``Shmem``), mapped or
    not: it also sees a segment only a file descriptor keeps, which no process's PSS counts."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The largest summed PSS seen in a phase, with its parts, and the extremes of the system's
    shared memory."""

    def __init__(self) -> None:
        self.total = 0
        self.shmem_max = 0
        self.shmem_min: int | None = None
        self.parts: dict[str, int] = dict.fromkeys(procs.PSS_PARTS, 0)
        self.trainer = 0
        self.processes = 0
        self.samples = 0

    def add(self, root: int, by_pid: dict[int, dict[str, int]], shmem: int) -> None:
        self.samples += 1
        self.shmem_max = max(self.shmem_max, shmem)
        self.shmem_min = shmem if self.shmem_min is None else min(self.shmem_min, shmem)
        total = sum(p["Pss"] for p in by_pid.values())
        if total > self.total:
            self.total = total
            self.parts = {k: sum(p[k] for p in by_pid.values()) for k in procs.PSS_PARTS}
            self.trainer = by_pid.get(root, {}).get("Pss", 0)
            self.processes = sum(1 for p in by_pid.values() if p["Pss"])

    def as_mib(self) -> dict[str, Any]:
        return {
            "pss_mib": self.total / common.MIB,
            **{f"{k.lower()}_mib": v / common.MIB for k, v in self.parts.items() if k != "Pss"},
            "trainer_pss_mib": self.trainer / common.MIB,
            "processes": self.processes,
            "samples": self.samples,
            "system_shmem_max_mib": self.shmem_max / common.MIB,
            "system_shmem_min_mib": (self.shmem_min or 0) / common.MIB,
        }


def run_contender(name: str, workload: str, args: argparse.Namespace) -> dict[str, Any]:
    """Runs one contender in a fresh interpreter and samples its process tree's PSS."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        name,
        "--workloads",
        workload,
        "--data-dir",
        str(args.data_dir),
        "--epochs",
        str(args.epochs),
    ]
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        phase = ["start"]
        result: list[dict[str, Any]] = []

        def read(stream: Any) -> None:
            for line in stream:
                if line.startswith("PHASE "):
                    phase[0] = line.split()[1]
                elif line.startswith("RESULT "):
                    result.append(json.loads(line[len("RESULT ") :]))

        reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
        reader.start()
        peaks = {"idle": Peak(), "epoch": Peak()}
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        while proc.poll() is None:
            if time.monotonic() > deadline:
                proc.kill()
                break
            now = phase[0]
            if now in peaks:
                pids = procs.tree(proc.pid, all_threads=True)
                by_pid = {pid: procs.pss_parts_of(pid) for pid in pids}
                shmem = system_shmem()
                # A sample that straddles the phase's end belongs to neither side.
                if phase[0] == now:
                    peaks[now].add(proc.pid, by_pid, shmem)
            time.sleep(SAMPLE_GAP_S)
        proc.wait()
        reader.join(5)
        err.seek(0)
        stderr = err.read()
    if proc.returncode != 0 or not result:
        tail = " | ".join(stderr.strip().splitlines()[-4:])[-600:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    if not peaks["epoch"].samples:
        return {"error": "no PSS sample fell inside an epoch: raise --epochs"}
    return {
        **result[0],
        "epoch_peak": peaks["epoch"].as_mib(),
        "idle_peak": peaks["idle"].as_mib(),
    }


def summarise(workload: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    rows = []
    base_runs = [r for r in runs.get(BASELINE, []) if "error" not in r]
    base = common.median(r["epoch_peak"]["pss_mib"] for r in base_runs) if base_runs else None
    for name, results in runs.items():
        ok = [r for r in results if "error" not in r]
        row: dict[str, Any] = {
            "contender": name,
            "label": bench_loader.label_of(workload, name),
            "failed_rounds": [r["error"] for r in results if "error" in r],
        }
        if not ok:
            rows.append(row)
            continue
        peaks = [r["epoch_peak"] for r in ok]
        for key in (*[k for k in peaks[0] if k.endswith("_mib")], "processes", "samples"):
            row[key] = common.median(p[key] for p in peaks)
        row["idle_pss_mib"] = common.median(r["idle_peak"]["pss_mib"] for r in ok)
        # The system's shared memory at its epoch peak over its least before the first epoch
        # (other jobs' segments come and go: a rough figure).
        row["shmem_growth_mib"] = common.median(
            r["epoch_peak"]["system_shmem_max_mib"] - r["idle_peak"]["system_shmem_min_mib"]
            for r in ok
        )
        row["epoch_s"] = common.median(e["epoch_s"] for r in ok for e in r["epochs"])
        row["per_round_pss_mib"] = [p["pss_mib"] for p in peaks]
        if base:
            row["x_torch"] = row["pss_mib"] / base
            paired = [
                a["epoch_peak"]["pss_mib"] / b["epoch_peak"]["pss_mib"]
                for a, b in zip(results, runs[BASELINE], strict=False)
                if "error" not in a and "error" not in b
            ]
            row["x_torch_paired"] = common.median(paired) if paired else None
        rows.append(row)
    return {"workload": workload, "baseline": BASELINE, "rows": rows}


def print_tables(tables: list[dict[str, Any]]) -> None:
    headers = [
        "contender",
        "peak ΣPSS MiB",
        f"x {BASELINE}",
        "paired x",
        "anon",
        "file",
        "shmem",
        "trainer",
        "before 1st epoch",
        "procs",
        "system Shmem +",
        "samples",
        "epoch ms",
    ]
    for t in tables:
        print(f"\n### {t['workload']}: summed PSS of the process tree during an epoch (MiB)\n")
        rows = []
        for r in t["rows"]:
            if "pss_mib" not in r:
                failed = "; ".join(r["failed_rounds"])[:80] or "not run"
                rows.append([r["label"], f"failed: {failed}"] + ["-"] * (len(headers) - 2))
                continue
            rows.append(
                [
                    r["label"],
                    r["pss_mib"],
                    r.get("x_torch"),
                    r.get("x_torch_paired"),
                    r["pss_anon_mib"],
                    r["pss_file_mib"],
                    r["pss_shmem_mib"],
                    r["trainer_pss_mib"],
                    r["idle_pss_mib"],
                    r["processes"],
                    r["shmem_growth_mib"],
                    r["samples"],
                    r["epoch_s"] * 1e3,
                ]
            )
        print(common.markdown_table(headers, rows))


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument(
        "--contenders",
        nargs="+",
        default=CONTENDERS,
        help=f"bench_loader.py keys with 2 workers (default: {' '.join(CONTENDERS)})",
    )
    parser.add_argument("--data-dir", type=Path, default=common.DATA_DIR)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per contender and round")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        try:
            lay = bench_loader.Layout(args.data_dir, args.workloads[0])
            res = child(args.child, lay, args.epochs)
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        print("RESULT " + json.dumps(res), flush=True)
        return None

    common.import_dataset_rt()
    t_start = time.perf_counter()
    contenders = [BASELINE, *(c for c in args.contenders if c != BASELINE)]
    for wl in args.workloads:
        known = bench_loader.CONTENDERS[bench_loader.kind_of(wl)]
        unknown = [c for c in contenders if c not in known]
        if unknown:
            parser.error(f"{wl} has no contender {', '.join(unknown)}; it has {', '.join(known)}")
    prep = argparse.Namespace(
        workloads=args.workloads, contenders=contenders, data_dir=args.data_dir
    )
    prep_errors = bench_loader.prepare_all(prep)
    if prep_errors:
        raise SystemExit(f"preparing the data failed: {prep_errors}")
    for wl in args.workloads:
        bench_loader.warm_page_cache(bench_loader.Layout(args.data_dir, wl).root)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        wl: {c: [] for c in contenders} for wl in args.workloads
    }
    for rnd in range(args.rounds):
        for wl in args.workloads:
            for c in contenders:
                t = time.perf_counter()
                res = run_contender(c, wl, args)
                runs[wl][c].append(res)
                msg = (
                    f"FAILED {res['error'][:300]}"
                    if "error" in res
                    else f"peak ΣPSS {res['epoch_peak']['pss_mib']:,.0f} MiB "
                    f"({res['epoch_peak']['samples']} samples)"
                )
                print(
                    f"# round {rnd + 1} {wl:>6} {c:<15} {msg} ({time.perf_counter() - t:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    tables = [summarise(wl, runs[wl]) for wl in args.workloads]
    data = {
        "benchmark": "loader_memory",
        "command": " ".join([sys.executable, *sys.argv]),
        "machine": common.machine_info(),
        "dataset_rt": common.dataset_rt_origin(),
        "rounds": args.rounds,
        "epochs": args.epochs,
        "load_avg": os.getloadavg(),
        "total_s": time.perf_counter() - t_start,
        "tables": tables,
        "runs": runs,
    }
    print_tables(tables)
    common.write_results("loader_memory", data)
    print(f"\n# loader memory benchmark: {time.perf_counter() - t_start:.0f} s", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
