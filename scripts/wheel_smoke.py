"""Smoke suite of an installed dataset-rt wheel: write, read, the loader with workers, the CLI.

Run by scripts/wheel_test.py with a virtualenv's Python, from a directory outside the source
tree: python wheel_smoke.py WORKDIR. Needs only the wheel and its dependencies. Raises (exit 1)
on the first check that fails, saying which.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dataset_rt
from dataset_rt import (
    CacheLoaded,
    CacheSourcesDatasetSuccess,
    CacheWritten,
    DataLoader,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
)
from dataset_rt.testing import corrupt_byte, make_source

N = 50


def check(condition: bool, what: str) -> None:
    if not condition:
        raise SystemExit(f"wheel smoke FAILED: {what}")


def payload(i: int) -> bytes:
    return f"<sample {i:03d}>".encode() * (1 + i % 7)


def load(base: Path, seed: int = 3):  # type: ignore[no-untyped-def]
    source = make_source(
        "smoke", [(payload(i), {"sample_id": i, "label": f"l{i % 3}"}) for i in range(N)]
    )
    return DatasetRuntime(num_workers=2).from_cache_sources(
        source,
        base,
        reader_config=ReaderConfig(seed=seed, shuffle=True),
        writer_config=WriterConfig(
            show_progress=False, shard_compression=ShardCompression(algo="lz4", ratio=1.0)
        ),
    )


def cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "dataset-rt"
    return subprocess.run(
        [str(script), *map(str, args)], capture_output=True, text=True, timeout=120, check=False
    )


def main() -> None:
    work = Path(sys.argv[1])
    prefix = Path(sys.prefix).resolve()
    module = Path(dataset_rt.__file__).resolve()
    native = Path(dataset_rt._native.__file__).resolve()
    check(sys.prefix != sys.base_prefix, f"{sys.executable} is not a virtualenv's Python")
    check(module.is_relative_to(prefix), f"dataset_rt is imported from {module}, not {prefix}")
    check(native.name == "_native.abi3.so", f"the extension module is {native}")
    print(
        f"Python {sys.version.split()[0]}: dataset_rt {dataset_rt.__version__} from {module.parent}"
    )

    # Write, then read back: every sample once, with its bytes and metadata.
    result = load(work)
    check(isinstance(result, CacheSourcesDatasetSuccess), f"first load: {result!r}")
    check(isinstance(result.results[0], CacheWritten), f"first load wrote nothing: {result!r}")
    dataset = result.dataset
    order = []
    for sample in dataset:
        i = sample.metadata["sample_id"]
        check(bytes(sample.data) == payload(i), f"sample {i}: wrong bytes")
        check(sample.metadata["label"] == f"l{i % 3}", f"sample {i}: wrong metadata")
        order.append(i)
    check(sorted(order) == list(range(N)), f"read {len(order)} samples, not 0..{N - 1} once each")
    check(order != list(range(N)), "shuffle=True read the samples in written order")
    reopened = load(work)
    check(isinstance(reopened.results[0], CacheLoaded), f"second load: {reopened!r}")
    check([s.metadata["sample_id"] for s in reopened.dataset] == order, "same seed, other order")
    print(f"write and read: {N} samples, reproducible shuffled order")

    # The shared-memory loader with worker processes: the in-process order, batched.
    dataset.set_epoch(0)
    expected = [s.metadata["sample_id"] for s in dataset]
    with DataLoader(dataset, batch_size=8, num_workers=2) as loader:
        batches = list(loader)
    got = [s.metadata["sample_id"] for batch in batches for s in batch]
    check([len(b) for b in batches] == [8] * 6 + [2], f"batch sizes {[len(b) for b in batches]}")
    check(got == expected, "the loader's order differs from the dataset's")
    check(
        all(bytes(s.data) == payload(s.metadata["sample_id"]) for b in batches for s in b),
        "the loader returned wrong bytes",
    )
    leftover = [n for n in os.listdir("/dev/shm") if n.startswith(f"dataset-rt-{os.getpid()}-")]
    check(not leftover, f"the loader left shared memory behind: {leftover}")
    print(f"loader: {len(batches)} batches from 2 workers")

    # The console script.
    cache = work / "smoke"
    out = cli("inspect", "--json", cache)
    check(out.returncode == 0, f"dataset-rt inspect: {out.returncode}: {out.stderr}")
    check(json.loads(out.stdout)["num_samples"] == N, f"dataset-rt inspect: {out.stdout}")
    out = cli("verify", cache)
    check(out.returncode == 0, f"dataset-rt verify: {out.returncode}: {out.stderr}")
    check(f"OK: {N} samples" in out.stdout, f"dataset-rt verify: {out.stdout}")
    out = cli("head", "-n", "2", cache)
    check(out.returncode == 0, f"dataset-rt head: {out.returncode}: {out.stderr}")
    check(out.stdout.count("record ") == 2, f"dataset-rt head -n 2: {out.stdout}")
    (shard,) = (cache / "shards").iterdir()
    corrupt_byte(shard, -1)
    out = cli("verify", cache)
    check(out.returncode == 1, f"dataset-rt verify of a corrupt cache: exit {out.returncode}")
    check("FAILED" in out.stderr, f"dataset-rt verify of a corrupt cache: {out.stderr}")
    print("CLI: inspect, verify, head; verify catches a corrupt shard")
    print("wheel smoke passed")


if __name__ == "__main__":
    main()
