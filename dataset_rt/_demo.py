"""``dataset-rt demo``: the quickstart's main job on an embedded synthetic dataset.

The dataset is generated, never fetched: small raw RGB "images" whose bytes are a pure function of
``(GENERATOR_SEED, index)`` (a class-coloured gradient plus seeded noise, so LZ4 has something to
compress). Reading back checks every payload against the generator. Then the shared-memory loader
decodes the cache in worker processes, resumes from a checkpoint taken mid-epoch, and is timed
beside torch's ``DataLoader`` when torch is installed.
"""

from __future__ import annotations

import importlib.util
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dataset_rt import _native
from dataset_rt._config import ReaderConfig, ShardCompression, WriterConfig
from dataset_rt._dataset import Dataset
from dataset_rt._results import (
    CacheInput,
    CacheLoaded,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWritten,
)
from dataset_rt._runtime import DatasetRuntime
from dataset_rt.exceptions import ConfigError

__all__ = ["DEMO_SOURCE_NAME", "DemoImages", "fake_image", "run_demo"]

DEMO_SOURCE_NAME = "demo_images"
GENERATOR_SEED = 20240601
READER_SEED = 42
CLASSES = ("cat", "dog", "bird", "fish")
_COLOURS = ((200, 120, 40), (90, 60, 30), (40, 140, 220), (30, 200, 160))
_SIZES = ((32, 32), (48, 32), (32, 48), (64, 48))
_RUN = 4
LOADER_WORKERS = 2
LOADER_BATCH = 32


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
        resumed_ok = _loader_demo(dataset)
    return 0 if permutations and mismatches == 0 and resumed_ok else 1


# --- the shared-memory loader -----------------------------------------------------------------

Decoded = tuple[str, npt.NDArray[np.float32]]
DecodedBatch = tuple[list[str], npt.NDArray[np.float32]]


def decode(sample: _native.CachedSample) -> Decoded:
    """The demo's transform: the payload as an ``(height, width, 3)`` image, without a copy, and
    its mean colour (the "training" input), with the sample's id."""
    meta = sample.metadata
    pixels = np.frombuffer(sample.data, dtype=np.uint8)
    image = pixels.reshape(int(meta["height"]), int(meta["width"]), 3)
    return str(meta["sample_id"]), image.mean(axis=(0, 1), dtype=np.float32)


def collate(items: list[Decoded]) -> DecodedBatch:
    """A batch: the ids in order and one ``(batch, 3)`` array of mean colours."""
    return [sample_id for sample_id, _ in items], np.stack([mean for _, mean in items])


def _same(a: list[DecodedBatch], b: list[DecodedBatch]) -> bool:
    return len(a) == len(b) and all(
        ids_a == ids_b and np.array_equal(x_a, x_b)
        for (ids_a, x_a), (ids_b, x_b) in zip(a, b, strict=True)
    )


def _rate(batches: int, seconds: float) -> str:
    return f"{batches} batches in {seconds:.2f} s, {batches / seconds:,.0f} batches/s"


def _loader_demo(dataset: Dataset) -> bool:
    """Runs ``dataset_rt.DataLoader`` with workers and a decoding transform over the demo cache,
    resumes it from a mid-epoch ``state_dict`` and checks that the resumed batches are the rest
    of the epoch; then times torch's ``DataLoader`` over the same records when torch is there.
    Returns whether the resumed batches matched."""
    from dataset_rt._loader import DataLoader

    options: dict[str, Any] = {
        "batch_size": LOADER_BATCH,
        "num_workers": LOADER_WORKERS,
        "transform": decode,
        "collate_fn": collate,
    }
    try:
        loader = DataLoader(dataset, **options)
    except ConfigError as e:  # not Linux
        print(f"loader: skipped ({e})")
        return True
    with loader:
        batches = len(loader)
        middle = batches // 2
        epoch: list[DecodedBatch] = []
        checkpoint = loader.state_dict()  # replaced mid-epoch
        started = time.perf_counter()
        for batch in loader:
            epoch.append(batch)
            if len(epoch) == middle:
                checkpoint = loader.state_dict()
        elapsed = time.perf_counter() - started
    print(
        f"loader: dataset_rt.DataLoader, {LOADER_WORKERS} workers decoding, batch "
        f"{LOADER_BATCH}: {_rate(len(epoch), elapsed)} (one epoch, processes started included)"
    )
    with DataLoader(dataset, **options) as resumed_loader:
        resumed_loader.load_state_dict(checkpoint)
        resumed = list(resumed_loader)
    same = _same(resumed, epoch[middle:])
    print(
        f"resume: state_dict after batch {middle} of {batches}; a new loader resumed from it "
        f"delivered {len(resumed)} batches, equal to the rest of the epoch: "
        f"{'yes' if same else 'NO'}"
    )
    _torch_beside(dataset)
    return same


def _torch_beside(dataset: Dataset) -> None:
    """Times torch's ``DataLoader`` with the same workers, batch, transform and collate over a
    map-style dataset of the same records, held in memory (torch's workers read them there)."""
    if importlib.util.find_spec("torch") is None:
        print("torch: not installed, so no comparison with its DataLoader (pip install torch)")
        return
    import torch.utils.data

    records = [_native.CachedSample(bytes(s.data), dict(s.metadata)) for s in dataset]

    class Records(torch.utils.data.Dataset[Decoded]):
        def __len__(self) -> int:
            return len(records)

        def __getitem__(self, index: int) -> Decoded:
            return decode(records[index])

    loader = torch.utils.data.DataLoader(
        Records(),
        batch_size=LOADER_BATCH,
        shuffle=True,
        num_workers=LOADER_WORKERS,
        collate_fn=collate,
        generator=torch.Generator().manual_seed(READER_SEED),
    )
    started = time.perf_counter()
    count = sum(1 for _ in loader)
    elapsed = time.perf_counter() - started
    print(
        f"torch: torch.utils.data.DataLoader, {LOADER_WORKERS} workers, the same transform over "
        f"the same records in memory: {_rate(count, elapsed)}"
    )
