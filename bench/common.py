"""Shared helpers of the benchmarks: deterministic data, timing, memory, tables and results.

Every benchmark reports ratios measured side by side in one run, each figure the median of
several repeats, because the machines these run on are small and shared (noisy).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
# Generated data lives outside the repository and is reused between runs.
DATA_DIR = Path(os.environ.get("BENCH_DATA_DIR", "/tmp/bench_data"))

KIB = 1024
MIB = 1024 * 1024
# The two payload sizes every benchmark uses, and how many samples make ~256 MiB of each.
SIZES = {"4KiB": 4 * KIB, "128KiB": 128 * KIB}
DATASET_BYTES = int(os.environ.get("BENCH_DATASET_MIB", "256")) * MIB
REPEATS = int(os.environ.get("BENCH_REPEATS", "3"))


# --------------------------------------------------------------------------------------------
# The package under test


def cache_format(kind: str) -> int | None:
    """The storage format version a prepared store of ``kind`` is written in: DatasetRT's for
    its caches (so a new format rebuilds them instead of benchmarking an old one), else None."""
    if not kind.startswith("drt"):
        return None
    from dataset_rt import _native

    return int(_native.FORMAT_VERSION)


def stamp_text(kind: str, stamp_version: int, count: int, size: Any) -> str:
    """What a prepared store's ``.ok`` stamp holds: the layout it was prepared for and, for a
    DatasetRT cache, the format version it was written in."""
    return json.dumps(
        {"v": stamp_version, "count": count, "size": size, "format": cache_format(kind)}
    )


def import_dataset_rt() -> Any:
    """Imports dataset_rt, prints where from, and checks it is the expected (release) copy.

    Other work rebuilds ``dataset_rt/_native.abi3.so`` in the source tree with debug builds, so
    the benchmarks run against an installed release wheel (``PYTHONPATH=/tmp/bench_site``).
    ``BENCH_EXPECT_DATASET_RT`` names the directory dataset_rt must come from; when it is unset
    a copy imported from this repository's source tree is only warned about.
    """
    import dataset_rt

    where = Path(dataset_rt.__file__).resolve().parent
    print(f"# dataset_rt {dataset_rt.__version__} from {where}", file=sys.stderr)
    expected = os.environ.get("BENCH_EXPECT_DATASET_RT")
    if expected:
        want = Path(expected).resolve()
        if want not in (where, *where.parents):
            raise SystemExit(f"dataset_rt imported from {where}, expected it under {want}")
    elif REPO_ROOT in where.parents:
        print(
            "# WARNING: dataset_rt comes from the source tree; its _native may be a debug "
            "build (see docs/benchmarks.md)",
            file=sys.stderr,
        )
    return dataset_rt


def dataset_rt_origin() -> dict[str, Any]:
    import dataset_rt

    pkg = Path(dataset_rt.__file__).resolve().parent
    native = next(pkg.glob("_native*.so"), None)
    info: dict[str, Any] = {"version": dataset_rt.__version__, "path": str(pkg)}
    if native is not None:
        st = native.stat()
        info["native"] = str(native)
        info["native_size"] = st.st_size
        info["native_mtime"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(st.st_mtime))
    return info


# --------------------------------------------------------------------------------------------
# Data


def num_samples(size: int, total: int = DATASET_BYTES) -> int:
    return max(1, total // size)


def payload_buffer(count: int, size: int, seed: int = 0) -> np.ndarray:
    """``count * size`` deterministic bytes, moderately compressible (LZ4 keeps ~55-65%).

    64-byte blocks, half of them random and half one repeated random byte: LZ4 shrinks the runs
    and cannot shrink the random blocks, like typical mixed binary data.
    """
    rng = np.random.default_rng(seed)
    block = 64
    nb = count * size // block
    out = np.empty((nb, block), dtype=np.uint8)
    step = 1 << 16  # generate in pieces to keep the temporary arrays small
    for i in range(0, nb, step):
        j = min(nb, i + step)
        fresh = rng.integers(0, 256, size=(j - i, block), dtype=np.uint8)
        fill = rng.integers(0, 256, size=(j - i, 1), dtype=np.uint8)
        keep = rng.random(j - i) < 0.5
        out[i:j] = np.where(keep[:, None], fresh, fill)
    return out.reshape(-1)


def payload_list(buf: np.ndarray, size: int) -> list[bytes]:
    """The buffer cut into ``bytes`` objects of ``size`` (the in-memory "floor" dataset)."""
    mv = memoryview(buf)
    return [bytes(mv[i : i + size]) for i in range(0, len(buf), size)]


# --------------------------------------------------------------------------------------------
# Timing and memory


def median(values: Iterable[float]) -> float:
    v = [x for x in values if x is not None]
    return statistics.median(v) if v else float("nan")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median_time(fn: Callable[[], Any], repeats: int = REPEATS) -> tuple[float, list[float]]:
    """Median wall time of ``repeats`` calls of ``fn`` (and every time)."""
    times = [timed(fn)[0] for _ in range(repeats)]
    return median(times), times


def peak_rss_mib() -> float:
    """This process's peak resident set size (VmHWM), in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Restarts this process's peak-RSS count (VmHWM) from its current RSS (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def proc_status_mib() -> dict[str, float]:
    """Current RSS split into anonymous and file-backed pages, and the peak, in MiB."""
    out: dict[str, float] = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def memcpy_rate(nbytes: int = 256 * MIB, repeats: int = 5) -> float:
    """Bytes/s of a numpy copy between two large preallocated arrays (one core)."""
    src = np.frombuffer(np.random.default_rng(1).bytes(nbytes), dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    t, _ = median_time(lambda: np.copyto(dst, src), repeats)
    return nbytes / t


def page_cache_read_rate(path: Path, repeats: int = 3) -> float:
    """Bytes/s reading ``path`` through the (warm) page cache into one reused buffer."""
    size = path.stat().st_size
    chunk = 16 * MIB
    buf = bytearray(chunk)
    view = memoryview(buf)

    def read_all() -> int:
        n = 0
        with open(path, "rb", buffering=0) as f:
            while True:
                got = f.readinto(view)
                if not got:
                    return n
                n += got

    read_all()  # the first read warms the page cache; only the later ones are timed
    t, _ = median_time(read_all, repeats)
    return size / t


def disk_write_rate(directory: Path, nbytes: int = 1024 * MIB) -> float:
    """Bytes/s of one sequential buffered write of ``nbytes`` with ``fsync``, from Python."""
    chunk = bytearray(np.random.default_rng(2).bytes(64 * MIB))
    view = memoryview(chunk)
    path = directory / "disk_rate.tmp"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        t0 = time.perf_counter()
        left = nbytes
        while left > 0:
            part = view[: min(left, len(view))]
            while part:
                part = part[os.write(fd, part) :]
            left -= min(left, len(view))
        os.fsync(fd)
        dt = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink()
    return nbytes / dt


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def filesystem_of(path: Path) -> str:
    """``device type mountpoint`` of the filesystem holding ``path`` (from df)."""
    try:
        out = subprocess.run(
            ["df", "-T", str(path)], capture_output=True, text=True, check=True
        ).stdout.splitlines()[-1]
        dev, fstype, *_, mount = out.split()
        return f"{fstype} ({dev} on {mount})"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "unknown"


def reset_dir(path: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


# --------------------------------------------------------------------------------------------
# Reporting


def machine_info() -> dict[str, Any]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0.0
    with contextlib.suppress(ValueError, OSError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(mem, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "load_avg": os.getloadavg(),
    }


def fmt(value: Any, digits: int = 3) -> str:
    """Numbers for tables: 3 significant digits, thousands separated, '-' for missing."""
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value != value:  # NaN
        return "-"
    if isinstance(value, int) or abs(value) >= 10 ** (digits - 1):
        return f"{round(value):,}"
    return f"{value:.{digits}g}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = [
        "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |",
        "|" + "|".join("-" * (w + 2) for w in widths) + "|",
    ]
    for r in cells:
        lines.append("| " + " | ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) + " |")
    return "\n".join(lines)


def write_results(name: str, data: dict[str, Any]) -> Path:
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    print(f"# wrote {path}", file=sys.stderr)
    return path


# --------------------------------------------------------------------------------------------
# Charts (matplotlib is imported only when one is drawn: ``pip install '.[bench]'``)

RED, GREY, BLUE, GREEN = "#d62728", "#7f7f7f", "#1f77b4", "#2ca02c"


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend (raises ImportError without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def hbars(
    ax: Any, names: Sequence[str], values: Sequence[float], colors: Sequence[str]
) -> list[int]:
    """One horizontal bar per name, the first on top; returns the bars' y positions."""
    y = list(range(len(names)))
    ax.barh(y, values, color=colors)
    ax.set_yticks(y, names, fontsize=8)
    ax.invert_yaxis()
    return y


def machine_line(machine: dict[str, Any]) -> str:
    """``date, N cores (cpu)`` of a result's ``machine`` for a chart's title."""
    return f"{machine['date'][:10]}, {machine['cores']} cores ({machine['cpu']})"


def save_chart(fig: Any, path: Path, title: str, dpi: int) -> None:
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    print(f"# wrote {path}", file=sys.stderr)
