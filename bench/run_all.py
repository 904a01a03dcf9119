"""Runs every benchmark, writes bench/results/*.json and a markdown summary, and draws the chart.

    PYTHONPATH=/tmp/bench_site python bench/run_all.py     # or: make bench

See docs/benchmarks.md for the setup (a release build of dataset_rt, the peers installed by
``pip install '.[bench]'``) and for how to read the figures.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import common

CHART = common.REPO_ROOT / "docs" / "benchmarks-read.png"


def run(script: str, extra: list[str]) -> None:
    cmd = [sys.executable, str(common.BENCH_DIR / script), *extra]
    print(f"$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)


def draw_chart(read: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    tables = read["tables"]
    fig, axes = plt.subplots(1, len(tables), figsize=(7 * len(tables), 5.5), squeeze=False)
    ceil = read["ceiling"]
    colors_of = {"dataset_rt": common.RED, "floor": common.GREY}
    for ax, table in zip(axes[0], tables, strict=True):
        rows = [r for r in table["rows"] if "samples_per_s" in r]
        values = [r["samples_per_s"] for r in rows]
        colors = [colors_of.get(r["contender"], common.BLUE) for r in rows]
        y = common.hbars(ax, [r["label"] for r in rows], values, colors)
        ax.set_xscale("log")
        size = common.SIZES[table["size"]]
        for key, style, what in (
            ("memcpy_gib_per_s", "--", "memcpy"),
            ("page_cache_gib_per_s", ":", "page-cache read"),
        ):
            rate = ceil[key] * 2**30 / size
            ax.axvline(rate, color="black", linestyle=style, linewidth=1, label=f"{what} ceiling")
        for i, v in zip(y, values, strict=True):
            ax.text(v, i, f" {v:,.0f}", va="center", fontsize=7)
        ax.set_xlabel("samples/s (log scale)")
        ax.set_title(f"{table['size']} samples, shuffled, in-process")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=2)
        failed = [r["label"] for r in table["rows"] if "samples_per_s" not in r]
        if failed:
            ax.annotate(
                "not measured: " + ", ".join(failed),
                (0, -0.2),
                xycoords="axes fraction",
                fontsize=7,
            )
    title = (
        f"DatasetRT read benchmark, {common.machine_line(read['machine'])}, "
        f"median of {read['repeats']} rounds"
    )
    common.save_chart(fig, path, title, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=common.REPEATS)
    parser.add_argument("--skip-write", action="store_true")
    parser.add_argument("--skip-read", action="store_true")
    parser.add_argument("--skip-cold", action="store_true")
    parser.add_argument("--skip-build", action="store_true")
    parser.add_argument(
        "--cold-gib", type=float, default=4.0, help="bench_cold.py --gib (GiB per size, x2 copies)"
    )
    parser.add_argument("--chart", type=Path, default=CHART)
    args = parser.parse_args()
    common.import_dataset_rt()  # fail early, and say which copy is measured
    t0 = time.perf_counter()
    rep = ["--repeats", str(args.repeats)]
    if not args.skip_write:
        run("bench_write.py", rep)
    if not args.skip_build:
        # Parallel builds: cache sets by N processes and Ray Data, LitData, Streaming.
        run("bench_build.py", [])
    if not args.skip_read:
        run("bench_read.py", rep)
    run("bench_loader.py", rep)  # the shared-memory loader; draws docs/benchmarks-loader.png
    if not args.skip_cold:
        # Reads from a cold page cache: writes 2 copies of --cold-gib GiB per size once.
        run("bench_cold.py", ["--rounds", str(args.repeats), "--gib", str(args.cold_gib)])
    read_json = common.RESULTS_DIR / "read.json"
    if read_json.exists():
        try:
            draw_chart(json.loads(read_json.read_text()), args.chart)
        except ImportError as e:
            print(f"# no chart: {e} (pip install matplotlib)", file=sys.stderr)
    print(f"\n# all benchmarks: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
