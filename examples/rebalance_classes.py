"""Rebalance classes by editing the ``weight`` column of ``samples_metadata()``.

The digits that ship with scikit-learn are packed into an imbalanced cache: digit ``d`` keeps
only the first ``(d + 1) / 10`` of its images, so there are ten times as many 9s as 0s. Each
sample then gets the weight ``1 / (images of its class)``: every class weighs the same in all,
and an epoch of ``L`` samples is expected to hold ``L / 10`` of each class (rare images repeat,
common ones are left out).

Epochs are drawn by systematic sampling in storage order (see docs/determinism.md): every
sample's count is within one of its expected share, and so is the total of any group of samples
that lie together in storage. The cache is therefore written sorted by label, which makes each
class one contiguous block: every epoch delivers each class ``floor`` or ``ceil`` of
``L / 10`` times, within one. (Interleaved classes are balanced on average over epochs, but one
epoch's class totals can then stray by more than one.)

The script counts the labels that ``dataset_rt.DataLoader`` delivers in a few epochs, before
and after the reweighting, prints them beside the expectation and exits 1 if a rebalanced count
is off by one or more.

    python examples/rebalance_classes.py                   # 5 epochs
    python examples/rebalance_classes.py --small           # 2 epochs
    python examples/rebalance_classes.py --report r.json   # also write the counts as JSON
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
from digits_cache import NUM_CLASSES, DigitsSource, load_digits, open_digits

from dataset_rt import CachedSample, DataLoader, Dataset, DatasetRuntime, ReaderConfig


def imbalanced_indices() -> list[int]:
    """Digit d keeps the first (d + 1) / 10 of its images; the result is sorted by label."""
    _, labels = load_digits()
    kept = []
    for digit in range(NUM_CLASSES):
        of_digit = [i for i, label in enumerate(labels) if label == digit]
        kept.extend(of_digit[: len(of_digit) * (digit + 1) // NUM_CLASSES])
    return kept


def label_of(sample: CachedSample) -> int:
    return int(sample.metadata["label"])


def count_labels(dataset: Dataset, epochs: range) -> list[dict[int, int]]:
    """The labels the loader delivers in each epoch."""
    counts = []
    with DataLoader(dataset, batch_size=64, transform=label_of) as loader:
        for epoch in epochs:
            loader.set_epoch(epoch)
            counts.append(dict(Counter(label for batch in loader for label in batch)))
    return counts


def class_weights(table: pl.DataFrame) -> pl.DataFrame:
    """Each sample weighs 1 / (samples of its label): the classes weigh the same in all."""
    return table.with_columns((1.0 / pl.len().over("label")).alias("weight"))


def run(workdir: Path, epochs: int) -> dict[str, Any]:
    with DatasetRuntime(num_workers=2) as runtime:
        dataset = open_digits(
            runtime,
            workdir,
            DigitsSource("digits_imbalanced", imbalanced_indices()),
            ReaderConfig(seed=3, shuffle=True),
        )
        table = dataset.samples_metadata()
        stored = dict(table.group_by("label").len().iter_rows())
        before = count_labels(dataset, range(epochs))
        weighted = class_weights(table)
        dataset.set_samples_metadata(weighted)
        after = count_labels(dataset, range(epochs))
        # The expectation of each class: the epoch length times its share of the total weight.
        epoch_len = len(dataset)
        total = weighted["weight"].sum()
        share = dict(weighted.group_by("label").agg(pl.col("weight").sum()).iter_rows())
        expected = {label: epoch_len * share[label] / total for label in share}

    print(f"{'label':>5} {'stored':>6} {'before':>7} {'expected':>9}  after, per epoch")
    worst = 0.0
    for label in sorted(stored):
        got = [epoch.get(label, 0) for epoch in after]
        worst = max(worst, *(abs(n - expected[label]) for n in got))
        print(
            f"{label:>5} {stored[label]:>6} {before[0].get(label, 0):>7} "
            f"{expected[label]:>9.2f}  {got}"
        )
    ok = worst < 1
    print(f"{'OK' if ok else 'FAILED'}: largest distance to the expectation {worst:.3f}")
    return {
        "epoch_len": epoch_len,
        "stored": stored,
        "expected": expected,
        "before": before,
        "after": after,
        "ok": ok,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="2 epochs")
    parser.add_argument("--epochs", type=int, help="epochs to count (default 5)")
    parser.add_argument("--workdir", help="the cache goes here (default: a temp dir)")
    parser.add_argument("--report", help="write the counts to this JSON file")
    args = parser.parse_args()
    epochs = args.epochs or (2 if args.small else 5)
    if args.workdir is not None:
        report = run(Path(args.workdir), epochs)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            report = run(Path(tmp), epochs)
    if args.report is not None:
        Path(args.report).write_text(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
