"""Inputs and typed results of :meth:`DatasetRuntime.from_cache_sources`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    from dataset_rt._dataset import Dataset

__all__ = [
    "CacheInput",
    "CacheLoaded",
    "CacheMalformed",
    "CacheMissing",
    "CacheSourceResult",
    "CacheSourcesDatasetError",
    "CacheSourcesDatasetSuccess",
    "CacheWriteError",
    "CacheWritten",
]

MetadataValue: TypeAlias = bool | int | float | str


@dataclass(frozen=True, slots=True)
class CacheInput:
    """One sample from a source: bytes-like ``data`` and primitive ``metadata`` (a ``dict`` or
    any other ``Mapping`` of ``str`` keys)."""

    data: bytes | bytearray | memoryview
    metadata: Mapping[str, MetadataValue] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CacheLoaded:
    """An existing cache was validated and reused; its source was not iterated."""

    name: str
    path: Path | str
    num_samples: int


@dataclass(frozen=True, slots=True)
class CacheWritten:
    """The source was written, published and loaded."""

    name: str
    path: Path | str
    num_samples: int


@dataclass(frozen=True, slots=True)
class CacheMissing:
    """No cache exists and the source cannot be iterated to write one."""

    name: str
    path: Path | str
    message: str


@dataclass(frozen=True, slots=True)
class CacheMalformed:
    """A cache exists but failed validation (structure, sizes or checksums; the message names
    the file). It is never overwritten: remove it to rebuild. A cache that cannot be read at all
    (permission denied, an I/O error) is not malformed: that raises its ``OSError``."""

    name: str
    path: Path | str
    message: str


@dataclass(frozen=True, slots=True)
class CacheWriteError:
    """Writing failed; nothing was published for this source. The message names the sample."""

    name: str
    path: Path | str
    message: str


CacheSourceResult: TypeAlias = (
    CacheLoaded | CacheWritten | CacheMissing | CacheMalformed | CacheWriteError
)


@dataclass(frozen=True, slots=True)
class CacheSourcesDatasetSuccess:
    """At least one cache loaded: the dataset over them and one result per source, in order."""

    dataset: Dataset
    results: list[CacheSourceResult]


@dataclass(frozen=True, slots=True)
class CacheSourcesDatasetError:
    """No cache loaded: one result per source and a summary of all of them."""

    results: list[CacheSourceResult]
    message: str
