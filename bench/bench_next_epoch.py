"""First batch of the next epoch: seconds from ``iter(loader)`` to its first batch, from the
second epoch on, for DatasetRT's loader with and without ``persistent_workers`` and torch's
``DataLoader(persistent_workers=True)`` over the same payloads, side by side in one run.

Target (docs/benchmarks.md): <= 10 ms with persistent workers.

    python bench/bench_next_epoch.py [--samples 4096] [--size 4096] [--epochs 10] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import dataset_rt as drt
from dataset_rt.testing import make_source


def sample_len(sample: Any) -> int:
    return len(sample.data)


def bytes_len(data: bytes) -> int:
    return len(data)


class Payloads:
    """torch's map-style dataset over the same payloads, held in memory (its best case)."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = payloads

    def __len__(self) -> int:
        return len(self.payloads)

    def __getitem__(self, i: int) -> int:
        return bytes_len(self.payloads[i])


def first_batch_seconds(make_iter: Callable[[], Iterable[Any]], epochs: int) -> list[float]:
    """Per epoch after the first: seconds from iter() to the first batch (each epoch is then
    read to its end, so that the next one starts from an idle pipeline)."""
    times = []
    for epoch in range(epochs + 1):
        started = time.perf_counter()
        it = iter(make_iter())
        next(it)
        if epoch > 0:
            times.append(time.perf_counter() - started)
        for _ in it:
            pass
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--size", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args()
    payloads = [bytes([i % 251]) * args.size for i in range(args.samples)]
    with tempfile.TemporaryDirectory() as tmp:
        result = drt.DatasetRuntime(num_workers=2).from_cache_sources(
            make_source("next-epoch", payloads),
            Path(tmp),
            writer_config=drt.WriterConfig(show_progress=False),
        )
        assert result.dataset is not None
        dataset = result.dataset
        common = {"batch_size": args.batch_size, "num_workers": args.workers}
        rows: list[tuple[str, list[float]]] = []
        for persistent in (True, False):
            with drt.DataLoader(
                dataset, transform=sample_len, persistent_workers=persistent, **common
            ) as loader:
                rows.append(
                    (
                        f"dataset_rt.DataLoader(persistent_workers={persistent})",
                        first_batch_seconds(lambda loader=loader: loader, args.epochs),
                    )
                )
        import torch.utils.data

        torch_loader = torch.utils.data.DataLoader(
            Payloads(payloads), shuffle=True, persistent_workers=True, **common
        )
        rows.append(
            (
                "torch DataLoader(persistent_workers=True)",
                first_batch_seconds(lambda loader=torch_loader: loader, args.epochs),
            )
        )
    print(
        f"{args.samples} samples of {args.size} B, batch {args.batch_size}, "
        f"{args.workers} workers, epochs 2..{args.epochs + 1}"
    )
    print(f"{'loader':<48} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for name, times in rows:
        ms = [t * 1e3 for t in times]
        print(f"{name:<48} {statistics.median(ms):>10.2f} {min(ms):>8.2f} {max(ms):>8.2f}")


if __name__ == "__main__":
    main()
