"""Writer soak: SIGKILL a multi-source write at random points and check what it leaves.

Each cycle starts a child process that writes several caches (several shards each) into a fresh
base directory and kills it with SIGKILL after a random delay drawn over the length of an
uninterrupted write. After every kill it checks that:

- every cache directory that exists is complete: it verifies and holds exactly the expected
  samples (a cache is published whole or not at all);
- nothing else is in the base directory but lock files and the killed writer's temporary
  directories, and no lock is still held;
- the next write of the same names succeeds, verifies and holds the expected samples, and
  afterwards no temporary directory is left (leftovers: 0).

Usage: python soak/writer_kill.py [--cycles 50] [--seed 0] [--workdir DIR]
Prints one summary line of figures; exits 1 when any check failed.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAMES = ("alpha", "beta", "gamma")
SAMPLES = 600
SHARD_SIZE = 1 << 18


def payload(name: str, i: int) -> bytes:
    """Sample ``i`` of cache ``name``: 1 to 8 KiB, partly compressible, reproducible."""
    digest = hashlib.blake2b(f"{name}/{i}".encode()).digest()
    return (digest + bytes(32)) * (16 + digest[0] % 112)


class Source:
    def __init__(self, name: str) -> None:
        self.name = name

    def __iter__(self) -> Iterator[object]:
        from dataset_rt import CacheInput

        for i in range(SAMPLES):
            yield CacheInput(payload(self.name, i), {"i": i, "name": self.name})


def write_all(base: Path) -> object:
    """Writes (or loads) every cache under ``base``; returns the result."""
    from dataset_rt import DatasetRuntime, ReaderConfig, ShardCompression, WriterConfig

    writer = WriterConfig(
        show_progress=False,
        shard_size_bytes=SHARD_SIZE,
        shard_compression=ShardCompression(algo="lz4", ratio=0.9),
    )
    with DatasetRuntime(num_workers=2) as runtime:
        return runtime.from_cache_sources(
            [Source(n) for n in NAMES],
            base,
            reader_config=ReaderConfig(shuffle=False),
            writer_config=writer,
        )


def child(base: Path) -> None:
    """The process that is killed: says when it starts writing, then writes."""
    print("started", flush=True)
    write_all(base)
    print("done", flush=True)


def check_cache(base: Path, name: str) -> str | None:
    """None when ``base/name`` verifies and holds exactly the expected samples; else why not."""
    from dataset_rt import DatasetRuntime, ReaderConfig, _native

    cache = base / name
    try:
        _native.verify_cache(str(cache))
    except Exception as error:
        return f"{cache} does not verify: {error}"

    class ByName:
        pass

    source = ByName()
    source.name = name  # type: ignore[attr-defined]
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.from_cache_sources(source, base, reader_config=ReaderConfig(shuffle=False))
        dataset = getattr(result, "dataset", None)
        if dataset is None:
            return f"{cache} does not load: {result}"
        samples = list(dataset)
    if len(samples) != SAMPLES:
        return f"{cache} holds {len(samples)} samples, expected {SAMPLES}"
    for i, sample in enumerate(samples):
        if bytes(sample.data) != payload(name, i) or sample.metadata != {"i": i, "name": name}:
            return f"{cache}: sample {i} differs from what was written"
    return None


def lock_is_free(path: Path) -> bool:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


@dataclass
class Figures:
    cycles: int = 0
    kills: int = 0
    finished_before_kill: int = 0
    caches_complete_at_kill: int = 0
    tmp_dirs_at_kill: int = 0
    caches_verified: int = 0
    leftovers: int = 0
    failures: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"writer soak: cycles {self.cycles}, kills {self.kills}, finished before the kill "
            f"{self.finished_before_kill}, caches complete at a kill {self.caches_complete_at_kill}"
            f", temporary dirs at a kill {self.tmp_dirs_at_kill} (removed by the next write), "
            f"caches verified {self.caches_verified}, leftovers: {self.leftovers}, "
            f"failures: {len(self.failures)}"
        )


def start_child(base: Path) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), "--child", str(base)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def wait_started(proc: subprocess.Popen[str]) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if line != "started":
        proc.kill()
        _, err = proc.communicate()
        raise RuntimeError(f"the writer did not start: {line!r} {err}")


def measure_write(workdir: Path) -> float:
    """Seconds an uninterrupted write takes in a child, from its start line to its done line."""
    base = workdir / "calibration"
    proc = start_child(base)
    wait_started(proc)
    started = time.monotonic()
    assert proc.stdout is not None
    done = proc.stdout.readline().strip()
    elapsed = time.monotonic() - started
    _, err = proc.communicate(timeout=300)
    if done != "done" or proc.returncode != 0:
        raise RuntimeError(f"the calibration write failed: {err}")
    shutil.rmtree(base)
    return elapsed


def one_cycle(workdir: Path, k: int, delay: float, figures: Figures) -> None:
    base = workdir / f"cycle-{k}"
    fail = figures.failures.append
    proc = start_child(base)
    try:
        wait_started(proc)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            figures.kills += 1
        else:
            figures.finished_before_kill += 1
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode not in (0, -signal.SIGKILL):
        fail(f"cycle {k}: the writer exited with {proc.returncode}: {err[-500:]}")

    # What the kill left: complete caches, lock files, the dead writer's temporary directories.
    if base.exists():
        for entry in sorted(base.iterdir()):
            if entry.name in NAMES:
                figures.caches_complete_at_kill += 1
                why = check_cache(base, entry.name)
                if why:
                    fail(f"cycle {k}, after the kill: {why}")
            elif entry.name.startswith(".") and entry.name.endswith(".lock"):
                if not lock_is_free(entry):
                    fail(f"cycle {k}: {entry} is still locked after the writer died")
            elif any(entry.name.startswith(f".{n}.tmp-") for n in NAMES):
                figures.tmp_dirs_at_kill += 1
            else:
                fail(f"cycle {k}: unexpected {entry} after the kill")

    # The next write of the same names succeeds and leaves nothing behind.
    result = write_all(base)
    kinds = [type(r).__name__ for r in result.results]  # type: ignore[attr-defined]
    if any(kind not in ("CacheWritten", "CacheLoaded") for kind in kinds):
        fail(f"cycle {k}: the next write failed: {result}")
    for name in NAMES:
        why = check_cache(base, name)
        if why:
            fail(f"cycle {k}, after the next write: {why}")
        else:
            figures.caches_verified += 1
    left = [e for e in base.iterdir() if ".tmp-" in e.name]
    figures.leftovers += len(left)
    if left:
        fail(f"cycle {k}: left after the next write: {[e.name for e in left]}")
    figures.cycles += 1
    shutil.rmtree(base)


def run_soak(cycles: int, seed: int, workdir: Path | None = None) -> Figures:
    """Runs the soak; returns its figures (``failures`` lists every failed check)."""
    rng = random.Random(seed)
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="dataset-rt-writer-soak-", dir=workdir) as tmp:
        work = Path(tmp)
        duration = measure_write(work)
        for k in range(cycles):
            one_cycle(work, k, rng.uniform(0.0, duration), figures)
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=None, help="where the caches go")
    parser.add_argument("--child", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child)
        return 0
    started = time.monotonic()
    figures = run_soak(args.cycles, args.seed, args.workdir)
    for failure in figures.failures:
        print(f"FAILED: {failure}", file=sys.stderr)
    print(f"{figures.line()} (seed {args.seed}, {time.monotonic() - started:.0f} s)")
    return 1 if figures.failures else 0


if __name__ == "__main__":
    sys.exit(main())
