"""Helpers for testing code that uses DatasetRT: in-memory sources, file damage, comparisons.

Example::

    source = make_source("tiny", [(b"abc", {"label": 1}), (b"de", {"label": 0})])
    result = runtime.from_cache_sources(source, tmp_path, reader_config=ReaderConfig(shuffle=False))
    assert_cache_equal(result.dataset, source)
"""

from __future__ import annotations

import contextlib
import math
import os
import stat
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from dataset_rt._results import CacheInput

__all__ = [
    "ListSource",
    "assert_cache_equal",
    "corrupt_byte",
    "make_source",
    "truncate_file",
]


class ListSource:
    """A source over samples held in memory: it has a ``name`` and iterates them, as many times
    as asked. ``iterations`` counts the passes, so a test can tell a load (no pass) from a write.
    """

    __slots__ = ("iterations", "name", "samples")

    def __init__(self, name: str, samples: Iterable[CacheInput]) -> None:
        self.name = name
        self.samples = list(samples)
        self.iterations = 0

    def __iter__(self) -> Iterator[CacheInput]:
        self.iterations += 1
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __repr__(self) -> str:
        return f"ListSource({self.name!r}, {len(self.samples)} samples)"


def make_source(
    name: str,
    samples: Iterable[CacheInput | bytes | tuple[Any, Mapping[str, Any]]],
) -> ListSource:
    """A :class:`ListSource` from ``CacheInput`` values, bare payloads, or ``(data, metadata)``
    pairs."""
    inputs = []
    for s in samples:
        if isinstance(s, CacheInput):
            inputs.append(s)
        elif isinstance(s, tuple):
            data, metadata = s
            inputs.append(CacheInput(data, dict(metadata)))
        else:
            inputs.append(CacheInput(s))
    return ListSource(name, inputs)


@contextlib.contextmanager
def _writable(path: Path) -> Iterator[None]:
    """Lets the owner write ``path`` for the duration, then restores its mode: a published
    cache's files are read-only (0444)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    path.chmod(mode | stat.S_IWUSR)
    try:
        yield
    finally:
        path.chmod(mode)


def corrupt_byte(path: str | os.PathLike[str], offset: int) -> int:
    """Inverts every bit of the byte at ``offset`` (negative counts from the end) in place and
    returns its old value. The file keeps its size, so only checksums can notice. Works on a
    published cache's read-only files and leaves their mode as it was."""
    path = Path(path)
    size = path.stat().st_size
    position = offset + size if offset < 0 else offset
    if not 0 <= position < size:
        raise IndexError(f"offset {offset} is outside {path} ({size} bytes)")
    with _writable(path), path.open("r+b") as f:
        f.seek(position)
        old = f.read(1)[0]
        f.seek(position)
        f.write(bytes([old ^ 0xFF]))
    return old


def truncate_file(path: str | os.PathLike[str], remove: int = 1) -> None:
    """Cuts the last ``remove`` bytes off a file (a published cache's read-only files too; their
    mode stays as it was)."""
    path = Path(path)
    size = path.stat().st_size
    if not 0 < remove <= size:
        raise ValueError(f"cannot remove {remove} bytes from {path} ({size} bytes)")
    with _writable(path):
        os.truncate(path, size - remove)


def _payload(data: Any) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise AssertionError(f"payload is {type(data).__name__}, not bytes-like")
    return bytes(data)


def _same_value(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return bool(a == b)


def _same_metadata(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)


def assert_cache_equal(
    actual: Iterable[Any],
    expected: Iterable[Any],
    *,
    check_order: bool = True,
) -> None:
    """Asserts that two sequences of samples hold the same payloads and metadata.

    Either side may be a :class:`~dataset_rt.Dataset` (one pass is read), a source, or any
    iterable of ``CachedSample`` / ``CacheInput``. Payloads compare as bytes whatever their type;
    metadata values compare by type and value, NaN equal to NaN. With ``check_order=False`` the
    samples are matched as multisets. The message names the first differing sample.
    """
    left = [(_payload(s.data), dict(s.metadata)) for s in actual]
    right = [(_payload(s.data), dict(s.metadata)) for s in expected]
    if len(left) != len(right):
        raise AssertionError(f"{len(left)} samples, expected {len(right)}")
    if not check_order:
        _assert_same_multiset(left, right)
        return
    for i, ((data, meta), (want_data, want_meta)) in enumerate(zip(left, right, strict=True)):
        if data != want_data:
            raise AssertionError(
                f"sample {i}: payload differs ({len(data)} bytes {data[:32]!r}..., expected "
                f"{len(want_data)} bytes {want_data[:32]!r}...)"
            )
        if not _same_metadata(meta, want_meta):
            raise AssertionError(f"sample {i}: metadata {meta!r}, expected {want_meta!r}")


def _assert_same_multiset(
    left: Sequence[tuple[bytes, dict[str, Any]]], right: Sequence[tuple[bytes, dict[str, Any]]]
) -> None:
    unmatched = list(right)
    for i, (data, meta) in enumerate(left):
        for j, (want_data, want_meta) in enumerate(unmatched):
            if data == want_data and _same_metadata(meta, want_meta):
                del unmatched[j]
                break
        else:
            raise AssertionError(f"sample {i} ({meta!r}) has no match among the expected samples")
