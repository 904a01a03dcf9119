"""``dataset-rt demo``: the quickstart's main job on an embedded synthetic dataset.

The dataset is generated, never fetched: small raw RGB "images" whose bytes are a pure function of
``(GENERATOR_SEED, index)`` (a class-coloured gradient plus seeded noise, so LZ4 has something to
compress). Reading back checks every payload against the generator.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dataset_rt._config import ReaderConfig, ShardCompression, WriterConfig
from dataset_rt._results import (
    CacheInput,
    CacheLoaded,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWritten,
)
from dataset_rt._runtime import DatasetRuntime

__all__ = ["DEMO_SOURCE_NAME", "DemoImages", "fake_image", "run_demo"]

DEMO_SOURCE_NAME = "demo_images"
GENERATOR_SEED = 20240601
READER_SEED = 42
CLASSES = ("cat", "dog", "bird", "fish")
_COLOURS = ((200, 120, 40), (90, 60, 30), (40, 140, 220), (30, 200, 160))
_SIZES = ((32, 32), (48, 32), (32, 48), (64, 48))
_RUN = 4


def fake_image(index: int) -> tuple[bytes, str, int, int]:
    """The bytes, label, width and height of synthetic image ``index`` (deterministic)."""
    rng = np.random.default_rng([GENERATOR_SEED, index])
    label = int(rng.integers(len(CLASSES)))
    width, height = _SIZES[int(rng.integers(len(_SIZES)))]
    # Texture on 4-pixel runs, like the flat patches of a real image: it keeps LZ4 useful.
    runs = width // _RUN
    gradient = np.add.outer(np.arange(height), np.arange(runs))[..., None] * 3
    noise = rng.integers(0, 16, size=(height, runs, 3))
    pixels = np.repeat((np.array(_COLOURS[label]) + gradient + noise) % 256, _RUN, axis=1)
    return pixels.astype(np.uint8).tobytes(), CLASSES[label], width, height


def _sample_id(index: int) -> str:
    return f"img-{index:06d}"


class DemoImages:
    """The demo source: ``num_samples`` synthetic images with sample_id/label/width/height."""

    name = DEMO_SOURCE_NAME

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __iter__(self) -> Iterator[CacheInput]:
        for index in range(self.num_samples):
            data, label, width, height = fake_image(index)
            yield CacheInput(
                data=data,
                metadata={
                    "sample_id": _sample_id(index),
                    "label": label,
                    "width": width,
                    "height": height,
                },
            )


def run_demo(out: Path, *, num_samples: int = 2000, num_workers: int = 4) -> int:
    """Writes (or reuses) the demo cache under ``out``, reads it back shuffled for two epochs and
    prints a summary; returns the exit status (1 when a read-back check fails)."""
    print(f"DatasetRT demo: {num_samples} synthetic images -> {out / DEMO_SOURCE_NAME}")
    with DatasetRuntime(num_workers=num_workers) as runtime:
        result = runtime.from_cache_sources(
            DemoImages(num_samples),
            out,
            reader_config=ReaderConfig(seed=READER_SEED, prefetch_size=64, shuffle=True),
            writer_config=WriterConfig(
                prefetch_size=64,
                shard_compression=ShardCompression(algo="lz4", ratio=0.9),
                show_progress=True,
            ),
        )
        match result:
            case CacheSourcesDatasetSuccess(dataset, [CacheWritten() | CacheLoaded() as outcome]):
                pass
            case CacheSourcesDatasetSuccess(_, results):
                print(f"unexpected results: {results!r}")
                return 1
            case CacheSourcesDatasetError(_, message):
                print(f"demo failed: {message}")
                return 1

        kind = type(outcome).__name__
        verb = "wrote" if isinstance(outcome, CacheWritten) else "reused the existing cache,"
        print(f"{kind}: {verb} {outcome.num_samples} samples at {outcome.path}")
        if outcome.num_samples != num_samples:
            print(
                f"note: the existing cache holds {outcome.num_samples} samples, not "
                f"{num_samples}; remove {outcome.path} to rebuild it"
            )

        all_ids = {_sample_id(i) for i in range(outcome.num_samples)}
        orders: list[list[str]] = []
        classes: Counter[str] = Counter()
        mismatches = 0
        for epoch in range(2):
            order: list[str] = []
            total_bytes = 0
            for sample in dataset:
                sample_id = str(sample.metadata["sample_id"])
                order.append(sample_id)
                total_bytes += len(sample.data)
                expected, label, width, height = fake_image(int(sample_id.removeprefix("img-")))
                if (
                    bytes(sample.data) != expected
                    or sample.metadata["label"] != label
                    or (sample.metadata["width"], sample.metadata["height"]) != (width, height)
                ):
                    mismatches += 1
                if epoch == 0:
                    classes[str(sample.metadata["label"])] += 1
            orders.append(order)
            head = ", ".join(order[:4])
            print(
                f"epoch {epoch}: {len(order)} samples, {total_bytes / 1e6:.2f} MB; "
                f"first: {head}, ..."
            )

        permutations = all(len(o) == len(all_ids) and set(o) == all_ids for o in orders)
        differ = orders[0] != orders[1]
        counts = ", ".join(f"{label} {classes[label]}" for label in sorted(classes))
        print(f"classes: {counts}")
        print(f"each epoch reads every sample exactly once: {'yes' if permutations else 'NO'}")
        print(f"epoch orders differ: {'yes' if differ else 'no'}")
        reads = sum(len(o) for o in orders)
        print(f"payloads and metadata match the generator: {reads - mismatches} of {reads} reads")
        print(f"state_dict: {json.dumps(dataset.state_dict())}")
    return 0 if permutations and mismatches == 0 else 1
