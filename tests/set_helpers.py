"""Sources for the cache-set tests: module-level classes, so that worker processes started with
``spawn`` can unpickle them, and a build script the kill tests run in a process of its own."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

from dataset_rt import CacheInput


def payload(part: int, i: int) -> bytes:
    return bytes((part * 31 + i * 7 + k) % 256 for k in range(64 + (i % 5) * 16))


class Part:
    """Part ``part`` of a test set: ``n`` samples; optionally raises at sample ``fail_at``,
    SIGKILLs its own process at sample ``kill_at``, raises ``SystemExit(3)`` at sample
    ``exit_at``, or sleeps ``delay`` seconds per sample."""

    def __init__(
        self,
        part: int,
        n: int,
        *,
        fail_at: int | None = None,
        kill_at: int | None = None,
        exit_at: int | None = None,
        delay: float = 0.0,
    ) -> None:
        self.part = part
        self.n = n
        self.fail_at = fail_at
        self.kill_at = kill_at
        self.exit_at = exit_at
        self.delay = delay

    def __iter__(self) -> Iterator[CacheInput]:
        for i in range(self.n):
            if i == self.fail_at:
                raise ValueError(f"part {self.part} cannot read sample {i}")
            if i == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if i == self.exit_at:
                raise SystemExit(3)
            if self.delay:
                time.sleep(self.delay)
            yield CacheInput(payload(self.part, i), {"sample_id": i, "part": self.part})


def _square(i: int) -> int:
    return i * i


class PoolPart:
    """A part that decodes with a process pool of its own, as users' parts do."""

    def __init__(self, part: int, n: int) -> None:
        self.part = part
        self.n = n

    def __iter__(self) -> Iterator[CacheInput]:
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(2) as pool:
            squares = pool.map(_square, range(self.n))
        for i, square in enumerate(squares):
            yield CacheInput(square.to_bytes(4, "little"), {"sample_id": i, "part": self.part})


def parts(count: int = 4, n: int = 40, **options: dict[str, object]) -> list[Part]:
    """``count`` parts of ``n`` samples; ``options["p2"] = {"fail_at": 3}`` changes part 2."""
    return [Part(p, n, **options.get(f"p{p}", {})) for p in range(count)]  # type: ignore[arg-type]


def build(base: str, processes: int, delay: float) -> None:
    """What the kill tests run in a process of their own: a set of 6 slow parts."""
    from dataset_rt import CacheSet, DatasetRuntime, WriterConfig

    slow = {f"p{p}": {"delay": delay} for p in range(6)}
    with DatasetRuntime(num_workers=2) as runtime:
        print("building", flush=True)
        try:
            runtime.from_cache_sources(
                CacheSet("s", parts(6, 30, **slow)),
                base,
                writer_config=WriterConfig(processes=processes, show_progress=False),
            )
        except KeyboardInterrupt:
            print("interrupted", flush=True)
            raise SystemExit(3) from None
    print("built", flush=True)


if __name__ == "__main__":
    import sys

    build(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
