"""Pack scikit-learn's bundled digits into a DatasetRT cache (shared by the examples here).

``sklearn.datasets.load_digits`` ships with scikit-learn, so nothing is downloaded: 1797
grey-scale images of 8x8 pixels with values 0..16, and their labels 0..9. Each image is stored as
its 64 pixels, one byte each; its metadata is ``{"sample_id": index, "label": digit}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from dataset_rt import (
    CacheInput,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    Dataset,
    DatasetRuntime,
    ReaderConfig,
    WriterConfig,
)

IMAGE_SIZE = 8
NUM_CLASSES = 10


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """All digits as ``(images uint8 [n, 8, 8], labels int64 [n])``, in scikit-learn's order."""
    from sklearn.datasets import load_digits as sklearn_digits

    bunch = sklearn_digits()
    return bunch.images.astype(np.uint8), bunch.target.astype(np.int64)


class DigitsSource:
    """A DatasetRT source: the digits at ``indices`` (into scikit-learn's order), in that order."""

    def __init__(self, name: str, indices: Sequence[int]) -> None:
        self.name = name
        self.indices = list(indices)

    def __iter__(self) -> Iterator[CacheInput]:
        images, labels = load_digits()
        for i in self.indices:
            yield CacheInput(
                data=images[i].tobytes(),
                metadata={"sample_id": int(i), "label": int(labels[i])},
            )


def open_digits(
    runtime: DatasetRuntime,
    base_dir: Path,
    sources: DigitsSource | list[DigitsSource],
    reader_config: ReaderConfig,
) -> Dataset:
    """The dataset over ``sources``, writing each cache under ``base_dir`` the first time.

    Several processes may call this at once (the ranks of a torchrun job): the writers of one
    cache take its lock in turn, so it is written once and the others load it.
    """
    result = runtime.from_cache_sources(
        sources,
        base_dir,
        reader_config=reader_config,
        writer_config=WriterConfig(show_progress=False),
    )
    match result:
        case CacheSourcesDatasetSuccess(dataset, _):
            return dataset
        case CacheSourcesDatasetError(_, message):
            raise RuntimeError(f"could not open the digits caches in {base_dir}: {message}")
    raise AssertionError(f"unexpected result {result!r}")


def pixels(data: memoryview | bytes) -> np.ndarray:
    """A payload's pixels as ``float32 [1, 8, 8]`` scaled to 0..1 (a channel axis for a CNN)."""
    image = np.frombuffer(data, dtype=np.uint8).reshape(1, IMAGE_SIZE, IMAGE_SIZE)
    return image.astype(np.float32) / 16.0
