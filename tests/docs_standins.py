"""Stand-ins for the placeholders of the documentation's examples (tests/test_docs_blocks.py).

The docs call user code they cannot show, such as `load_my_images()` or `decode_image(data)`, and
user sources such as `Train()`. These small versions make every example runnable: each page's
blocks run with the names below already defined. They live in a module, not in the page's
namespace, so that they can be pickled into loader workers under any start method.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import numpy as np

from dataset_rt import CacheInput

__all__ = [
    "Extra",
    "HardNegatives",
    "SyntheticImages",
    "Train",
    "TrainImages",
    "decode_image",
    "load",
    "load_my_images",
    "save",
    "stack",
    "train_step",
]

SAMPLES = 24
IMAGE_SHAPE = (4, 4, 3)
LABELS = ("cat", "dog", "rare", "rare_class")


def load_my_images() -> Iterator[tuple[int, bytes, str]]:
    """`(sample_id, image_bytes, label)` for a few tiny "images" of one shape."""
    size = int(np.prod(IMAGE_SHAPE))
    for i in range(SAMPLES):
        yield i, bytes((i + j) % 256 for j in range(size)), LABELS[i % len(LABELS)]


def decode_image(data: bytes | memoryview) -> np.ndarray:
    """An "image" as an array of its own (no view of the payload's memory)."""
    return np.frombuffer(data, np.uint8).reshape(IMAGE_SHAPE).copy()


def stack(batch: list[np.ndarray]) -> np.ndarray:
    return np.stack(batch)


class _Source:
    name = ""

    def __iter__(self) -> Iterator[CacheInput]:
        for sample_id, image_bytes, label in load_my_images():
            yield CacheInput(data=image_bytes, metadata={"sample_id": sample_id, "label": label})


class Train(_Source):
    name = "train"


class Extra(_Source):
    name = "extra"


class TrainImages(_Source):
    name = "train_images"


class SyntheticImages(_Source):
    name = "synthetic_images"


class HardNegatives(_Source):
    name = "hard_negatives"


steps: list[Any] = []
_checkpoints: list[dict[str, Any]] = []


def train_step(*batch: Any) -> None:
    steps.append(batch[0] if len(batch) == 1 else batch)


def save(checkpoint: dict[str, Any]) -> None:
    """Keeps `checkpoint`; its "data" through JSON, as a state travels in a real checkpoint."""
    _checkpoints.append({**checkpoint, "data": json.loads(json.dumps(checkpoint["data"]))})


def load() -> dict[str, Any]:
    """The checkpoint `save` kept last."""
    return _checkpoints[-1]


def reset() -> None:
    """Forgets the steps and checkpoints of the previous page."""
    steps.clear()
    _checkpoints.clear()
