"""A cache of 100 million tiny samples: write, open, first shuffled sample, resume, metadata, RSS.

The cache is written by the normal writer (``from_cache_sources`` over a Python source of
``CacheInput(data=<the position as 8 little-endian bytes>, metadata={"label": position % 1000})``;
ids are the record positions) under a fresh temporary directory, and deleted at the end. Each
phase runs in its own process, so its peak RSS is its own:

- write: samples/s, and the CPU time of the thread that runs the source and the conversion, per
  sample (``time.thread_time``);
- read: ``from_cache_sources`` on the existing cache (open), then the first shuffled sample
  (``iter()`` + ``next()``) and its metadata (the first use of the metadata table, which reads
  and checks ``metadata.arrow``), then a resume at the epoch's last position, N - 1
  (``load_state_dict`` of a ``state_dict()`` with ``position`` set to N - 1, then ``iter()`` +
  ``next()``; the payload is checked to be the sample the ids say, and the epoch to end after it),
  then ``samples_metadata()``; the peak RSS (VmHWM) is read after the resume and again after
  ``samples_metadata()`` (Polars imported beforehand).

Run ``--samples 1000000`` first: the default, 100 million, writes about 13 GB and takes many
minutes on a small machine. ``--keep DIR`` writes the cache under DIR and keeps it there, and a
later run with the same ``--keep DIR`` and ``--samples`` skips the write and measures the read
on that cache again (its write figures are then absent).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import common

NAME = "scale"


class TinySource:
    """``count`` samples: the position as ``size`` little-endian bytes, and a ``label``."""

    def __init__(self, count: int, size: int, cache_input: Any) -> None:
        self.name = NAME
        self.count = count
        self.size = size
        self.cache_input = cache_input

    def __iter__(self) -> Iterator[Any]:
        make, size = self.cache_input, self.size
        for i in range(self.count):
            yield make(data=i.to_bytes(size, "little"), metadata={"label": i % 1000})


class NameOnly:
    """A source that only names its cache: loaded when it exists, never written."""

    name = NAME


def rss() -> dict[str, float]:
    status = common.proc_status_mib()
    return {
        "rss_mib": status.get("VmRSS", 0.0),
        "peak_rss_mib": status.get("VmHWM", 0.0),
        # File-backed pages are the cache's mapped files, which the kernel may drop at will.
        "rss_anon_mib": status.get("RssAnon", 0.0),
        "rss_file_mib": status.get("RssFile", 0.0),
    }


def child_write(base: Path, count: int, size: int, workers: int) -> dict[str, Any]:
    drt = common.import_dataset_rt()
    with drt.DatasetRuntime(num_workers=workers) as runtime:
        cpu0 = time.thread_time()
        t, result = common.timed(
            lambda: runtime.from_cache_sources(
                TinySource(count, size, drt.CacheInput),
                base,
                writer_config=drt.WriterConfig(show_progress=False),
            )
        )
        cpu = time.thread_time() - cpu0
    if not isinstance(result, drt.CacheSourcesDatasetSuccess):
        raise RuntimeError(f"writing failed: {result}")
    return {
        "write_s": t,
        "write_samples_per_s": count / t,
        "gil_thread_us_per_sample": cpu / count * 1e6,
        "cache_bytes": common.dir_bytes(base / NAME),
        **{f"write_{k}": v for k, v in rss().items()},
    }


def child_read(base: Path, count: int, size: int, workers: int) -> dict[str, Any]:
    drt = common.import_dataset_rt()
    import polars  # noqa: F401  (imported before timing: samples_metadata() would import it)

    out: dict[str, Any] = {}
    with drt.DatasetRuntime(num_workers=workers) as runtime:
        out["before_open_rss_mib"] = rss()["rss_mib"]
        common.reset_peak_rss()
        t, result = common.timed(
            lambda: runtime.from_cache_sources(
                NameOnly(), base, reader_config=drt.ReaderConfig(seed=0, shuffle=True)
            )
        )
        if not isinstance(result, drt.CacheSourcesDatasetSuccess):
            raise RuntimeError(f"opening failed: {result}")
        ds = result.dataset
        out["open_s"] = t
        out.update({f"after_open_{k}": v for k, v in rss().items()})
        assert len(ds) == count, (len(ds), count)

        def first() -> Any:
            return next(iter(ds))

        out["first_sample_s"], sample = common.timed(first)
        # The first use of the metadata table reads and checks all of metadata.arrow.
        out["first_metadata_s"], _ = common.timed(lambda: sample.metadata)
        check(sample, size)

        state = ds.state_dict()
        state["position"] = count - 1

        def resume() -> tuple[Any, Iterator[Any]]:
            ds.load_state_dict(state)
            it = iter(ds)
            return next(it), it

        out["resume_last_s"], (last, it) = common.timed(resume)
        check(last, size)
        if next(it, None) is not None:
            raise RuntimeError("the epoch did not end after position N - 1")
        out.update({f"after_resume_{k}": v for k, v in rss().items()})

        out["samples_metadata_s"], table = common.timed(ds.samples_metadata)
        if table.height != count:
            raise RuntimeError(f"samples_metadata() has {table.height} rows, not {count}")
        del table
        out.update({f"after_metadata_{k}": v for k, v in rss().items()})
    return out


def check(sample: Any, size: int) -> None:
    """The payload is the sample's position, which is also its id."""
    position = int.from_bytes(bytes(sample.data), "little")
    if len(sample.data) != size or sample.metadata["label"] != position % 1000:
        raise RuntimeError(f"unexpected sample {bytes(sample.data)!r} {sample.metadata}")


def run_child(phase: str, base: Path, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        phase,
        "--dir",
        str(base),
        "--samples",
        str(args.samples),
        "--payload-bytes",
        str(args.payload_bytes),
        "--workers",
        str(args.workers),
    ]
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True)
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=100_000_000)
    parser.add_argument("--payload-bytes", type=int, default=8, help="8 to 16")
    parser.add_argument("--workers", type=int, default=2, help="DatasetRuntime(num_workers)")
    parser.add_argument(
        "--tmp", type=Path, default=Path("/tmp"), help="where the temporary directory goes"
    )
    parser.add_argument(
        "--keep",
        type=Path,
        help="write the cache under this directory and keep it; reuse it when it is there",
    )
    parser.add_argument("--child", choices=["write", "read"], help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 8 <= args.payload_bytes <= 16:
        parser.error("--payload-bytes must be 8 to 16 (the position takes 8)")
    if args.samples < 1:
        parser.error("--samples must be at least 1")
    if args.child:
        run = child_write if args.child == "write" else child_read
        res = run(args.dir, args.samples, args.payload_bytes, args.workers)
        json.dump(res, sys.stdout)
        return res

    common.import_dataset_rt()
    if args.keep is None:
        base = Path(tempfile.mkdtemp(prefix="dataset_rt_scale_", dir=args.tmp))
    else:
        base = args.keep
        base.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {
        "machine": common.machine_info(),
        "dataset_rt": common.dataset_rt_origin(),
        "fs": common.filesystem_of(args.tmp),
        "samples": args.samples,
        "payload_bytes": args.payload_bytes,
        "workers": args.workers,
        "command": " ".join(sys.argv),
    }
    t0 = time.perf_counter()
    try:
        if args.keep is not None and (base / NAME).exists():
            print(f"# reusing the cache under {base}", file=sys.stderr)
            res["cache_bytes"] = common.dir_bytes(base / NAME)
        else:
            print(f"# writing {args.samples:,} samples under {base}", file=sys.stderr)
            res["write"] = run_child("write", base, args)
            res["cache_bytes"] = res["write"]["cache_bytes"]
            print(
                f"# written in {res['write']['write_s']:.1f} s "
                f"({res['cache_bytes'] / 2**30:.2f} GiB)",
                file=sys.stderr,
            )
        res["read"] = run_child("read", base, args)
    finally:
        if args.keep is None:
            shutil.rmtree(base, ignore_errors=True)
    res["seconds"] = time.perf_counter() - t0
    common.write_results(f"scale_{args.samples}", res)
    print_table(res)
    return res


def print_table(res: dict[str, Any]) -> None:
    r = res["read"]
    print(
        f"\n### {res['samples']:,} samples of {res['payload_bytes']} bytes "
        f"({res['cache_bytes'] / 2**30:.2f} GiB on {res['fs']})\n"
    )
    w = res.get("write")
    written = (
        [
            ["write, samples/s", w["write_samples_per_s"]],
            ["write, s", w["write_s"]],
            ["write, GIL thread µs/sample", w["gil_thread_us_per_sample"]],
            ["write, peak RSS MiB", w["write_peak_rss_mib"]],
        ]
        if w
        else []
    )
    print(
        common.markdown_table(
            ["what", "value"],
            [
                *written,
                ["open, ms", r["open_s"] * 1e3],
                ["first shuffled sample, ms", r["first_sample_s"] * 1e3],
                ["its metadata (first use of the table), ms", r["first_metadata_s"] * 1e3],
                ["resume at N - 1 (load_state_dict + iter + next), ms", r["resume_last_s"] * 1e3],
                ["RSS before open, MiB", r["before_open_rss_mib"]],
                ["RSS after open, MiB (anonymous)", r["after_open_rss_anon_mib"]],
                ["peak RSS after open + first + resume, MiB", r["after_resume_peak_rss_mib"]],
                [
                    "of which now anonymous / file-backed, MiB",
                    f"{r['after_resume_rss_anon_mib']:,.0f} / "
                    f"{r['after_resume_rss_file_mib']:,.0f}",
                ],
                ["samples_metadata(), ms", r["samples_metadata_s"] * 1e3],
                ["peak RSS after samples_metadata(), MiB", r["after_metadata_peak_rss_mib"]],
            ],
        )
    )


if __name__ == "__main__":
    main()
