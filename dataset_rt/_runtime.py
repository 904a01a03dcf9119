"""The runtime: one pool of Rust worker threads, and the entry points that load (and write)
caches."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from dataset_rt import _native
from dataset_rt._config import ReaderConfig, RemoteConfig, WriterConfig, check_int, is_url
from dataset_rt._dataset import Dataset
from dataset_rt._results import (
    CacheLoaded,
    CacheMalformed,
    CacheMissing,
    CacheSourceResult,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWriteError,
    CacheWritten,
)

__all__ = ["DatasetRuntime"]

# The most worker threads a runtime starts (docs/python-api.md).
MAX_RUNTIME_WORKERS = 1024


def _resolve_rank(config: ReaderConfig) -> tuple[int, int]:
    """Rank and world size: the config, else torch.distributed, else RANK/WORLD_SIZE, else 0/1."""
    if config.rank is not None and config.world_size is not None:
        return config.rank, config.world_size
    import sys

    dist = sys.modules.get("torch.distributed")  # never import torch just to ask
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), int(dist.get_world_size())
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None:
        try:
            r, w = int(rank), int(world)
        except ValueError:
            r, w = -1, 0
        if not 0 <= r < w:
            raise _native.ConfigError(
                f"RANK={rank!r} / WORLD_SIZE={world!r} in the environment are not a rank "
                "0 <= RANK < WORLD_SIZE; fix them or pass ReaderConfig(rank=, world_size=)"
            )
        return r, w
    return 0, 1


def _result(
    kind: str, name: str, path: str, message: str | None, num_samples: int | None
) -> CacheSourceResult:
    text = os.fspath(path)
    where: Path | str = text if is_url(text) else Path(text)
    if kind == "loaded":
        return CacheLoaded(name, where, num_samples or 0)
    if kind == "written":
        return CacheWritten(name, where, num_samples or 0)
    detail = message or ""
    if kind == "missing":
        return CacheMissing(name, where, detail)
    if kind == "malformed":
        return CacheMalformed(name, where, detail)
    return CacheWriteError(name, where, detail)


def _summary(results: Sequence[CacheSourceResult]) -> str:
    parts = []
    for r in results:
        detail = getattr(r, "message", None) or f"{getattr(r, 'num_samples', 0)} samples"
        parts.append(f"{r.name}: {type(r).__name__} ({detail})")
    return "no cache could be loaded; " + "; ".join(parts)


class DatasetRuntime:
    """Exactly ``num_workers`` Rust worker threads, started once and reused for loading,
    validation, reading and writing. Use as a context manager or call :meth:`close`."""

    __slots__ = ("_native",)

    def __init__(self, num_workers: int = 4) -> None:
        count = check_int("DatasetRuntime.num_workers", num_workers, 1, MAX_RUNTIME_WORKERS)
        self._native = _native.Runtime(count)

    @property
    def num_workers(self) -> int:
        return self._native.num_workers

    @property
    def closed(self) -> bool:
        return self._native.closed

    def close(self) -> None:
        """Stops the worker threads (after work already queued). Datasets of this runtime stop
        working."""
        self._native.close()

    def __enter__(self) -> DatasetRuntime:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"DatasetRuntime(num_workers={self.num_workers}, {state})"

    def from_cache_sources(
        self,
        sources: object | Iterable[object],
        base_cache_dir: str | os.PathLike[str],
        *,
        reader_config: ReaderConfig | None = None,
        writer_config: WriterConfig | None = None,
        remote: RemoteConfig | None = None,
    ) -> CacheSourcesDatasetSuccess | CacheSourcesDatasetError:
        """Loads each source's cache from ``base_cache_dir / source.name``, writing the missing
        ones from their sources, and returns the dataset over every cache that loaded.

        ``base_cache_dir`` may be a URL, as for :meth:`open_caches`: a source whose cache is not
        published at ``URL/name`` is written in a staging directory under the node's local
        cache directory, published there (``dataset-rt push``), and read in place like the
        others; its result is ``CacheWritten``.

        ``sources`` is one source or a list of them; a source has a ``name`` and, to be
        writable, iterates :class:`CacheInput`. Two sources with one name are refused before
        anything is written.

        Each source's outcome is a result: loaded, written, missing, malformed (the cache fails
        validation) or a write error. What is not about one source raises instead: a closed
        runtime, or one used in a forked child, raises ``RuntimeStateError`` before anything is
        created; an operating-system error while loading an existing cache (permission denied,
        EIO) raises its ``OSError`` subclass with ``errno`` set, since the cache itself may be
        fine. Loading a cache also removes temporary directories that dead writers of it left.
        """
        reader = _config("reader_config", reader_config, ReaderConfig)
        writer = _config("writer_config", writer_config, WriterConfig)
        if not isinstance(sources, (list, tuple)):
            sources = [sources]
        if isinstance(base_cache_dir, str) and is_url(base_cache_dir):
            return self._from_published_sources(
                list(sources), base_cache_dir, reader, writer, _remote(remote)
            )
        if remote is not None:
            raise _native.ConfigError(_NOT_A_URL.format(os.fspath(base_cache_dir)))
        return _outcome(
            *self._native.from_cache_sources(
                list(sources),
                os.fspath(base_cache_dir),
                reader,
                _resolve_rank(reader),
                writer,
            )
        )

    def _from_published_sources(
        self,
        sources: list[object],
        base_url: str,
        reader: ReaderConfig,
        writer: WriterConfig,
        remote: RemoteConfig,
    ) -> CacheSourcesDatasetSuccess | CacheSourcesDatasetError:
        """``from_cache_sources`` on a URL: opens what is published, writes the missing caches
        in a staging directory, publishes each one written, then opens them all in place."""
        names = [getattr(source, "name", None) for source in sources]
        first = self.open_caches(names, base_url, reader_config=reader, remote=remote)  # type: ignore[arg-type]
        if not any(isinstance(result, CacheMissing) for result in first.results):
            return first
        local_dir = Path(_native.remote_local_dir(remote))
        staging_root = local_dir / ".publish"
        staging_root.mkdir(parents=True, exist_ok=True)
        # The processes of one node that share its local directory write the missing caches of
        # a URL one at a time: the next one finds them published and writes nothing.
        digest = hashlib.sha256(base_url.encode()).hexdigest()[:32]
        with open(local_dir / f".publish-{digest}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return self._write_and_publish(
                sources, names, base_url, reader, writer, remote, staging_root
            )

    def _write_and_publish(
        self,
        sources: list[object],
        names: list[str | None],
        base_url: str,
        reader: ReaderConfig,
        writer: WriterConfig,
        remote: RemoteConfig,
        staging_root: Path,
    ) -> CacheSourcesDatasetSuccess | CacheSourcesDatasetError:
        """Writes the sources whose caches are not published at ``base_url`` (under the node's
        lock) in a staging directory under ``staging_root``, publishes each one written, and
        opens them all in place."""
        first = self.open_caches(names, base_url, reader_config=reader, remote=remote)  # type: ignore[arg-type]
        missing = [
            source
            for source, result in zip(sources, first.results, strict=True)
            if isinstance(result, CacheMissing)
        ]
        if not missing:
            return first
        staging = Path(tempfile.mkdtemp(prefix="staging-", dir=staging_root))
        try:
            written = self.from_cache_sources(
                missing, staging, reader_config=reader, writer_config=writer
            )
            # A set's parts have results of their own: only the sources are published (a set
            # with its parts). What failed is reported at its URL, with the failing parts'
            # messages: the staging directory, and the parts it kept, go away below.
            outcomes = {
                r.name: r
                if isinstance(r, CacheWritten)
                else _failed_at_url(r, f"{base_url}/{r.name}", written.results, staging)
                for r in written.results
                if r.name in names
            }
            del written
            for name, result in list(outcomes.items()):
                if isinstance(result, CacheWritten):
                    try:
                        _native.push_cache(staging / name, f"{base_url}/{name}", remote, False)
                    except FileExistsError:
                        # Another node published it meanwhile: that one is read, and loaded.
                        del outcomes[name]
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        final = self.open_caches(names, base_url, reader_config=reader, remote=remote)  # type: ignore[arg-type]
        results: list[CacheSourceResult] = []
        for result in final.results:
            made = outcomes.get(result.name)
            if isinstance(made, CacheWritten) and isinstance(result, CacheLoaded):
                results.append(CacheWritten(result.name, result.path, result.num_samples))
            elif made is not None and not isinstance(made, CacheWritten):
                results.append(made)
            else:
                results.append(result)
        if isinstance(final, CacheSourcesDatasetSuccess):
            return CacheSourcesDatasetSuccess(final.dataset, results)
        return CacheSourcesDatasetError(results, _summary(results))

    def open_caches(
        self,
        names: str | Sequence[str],
        base_cache_dir: str | os.PathLike[str],
        *,
        reader_config: ReaderConfig | None = None,
        remote: RemoteConfig | None = None,
    ) -> CacheSourcesDatasetSuccess | CacheSourcesDatasetError:
        """Loads the existing caches ``base_cache_dir / name`` for each of ``names`` (one
        ``str`` or a list or tuple of them) and returns the dataset over those that loaded, with
        the same results as :meth:`from_cache_sources`: ``CacheLoaded``, ``CacheMissing`` (no
        cache of that name) or ``CacheMalformed``.

        It only reads: nothing is iterated or written, no lock file or directory is created and
        no leftover of a dead writer is removed, so it works on read-only storage. Errors are
        those of :meth:`from_cache_sources` (``ConfigError`` for a bad or repeated name or a
        base that is not a directory, ``OSError`` for an unreadable cache).

        ``base_cache_dir`` may be a URL (``s3://bucket/prefix``, ``file:///dir``): each cache is
        then the one published at ``URL/name`` (``dataset-rt push``), read in place through a
        bounded local cache that ``remote`` (a :class:`RemoteConfig`) configures. Such a
        dataset reads like a local one, sample for sample, in process and through the
        shared-memory ``DataLoader``.
        """
        reader = _config("reader_config", reader_config, ReaderConfig)
        if isinstance(base_cache_dir, str) and is_url(base_cache_dir):
            dataset, outcomes = self._native.open_remote_caches(
                names, base_cache_dir, reader, _resolve_rank(reader), _remote(remote)
            )
            # Each result names its cache by its URL, as given (a path would fold `s3://`).
            base = base_cache_dir.rstrip("/")
            return _outcome(dataset, [(k, n, f"{base}/{n}", m, c) for k, n, _, m, c in outcomes])
        if remote is not None:
            raise _native.ConfigError(_NOT_A_URL.format(os.fspath(base_cache_dir)))
        return _outcome(
            *self._native.open_caches(
                names, os.fspath(base_cache_dir), reader, _resolve_rank(reader)
            )
        )


_NOT_A_URL = (
    "remote= configures caches on object storage, but base_cache_dir {!r} is not a URL "
    "(s3://..., file://...)"
)


def _failed_at_url(
    result: CacheSourceResult, url: str, all_results: Sequence[CacheSourceResult], staging: Path
) -> CacheSourceResult:
    """A source that failed in the staging directory of ``from_cache_sources`` on a URL, named
    by its URL (in its message too: the staging directory is gone); a set's result says which
    parts failed and why, since nothing of it is kept."""
    parts = [
        f"{r.name}: {r.message}"
        for r in all_results
        if r.name.startswith(f"{result.name}.part-") and isinstance(r, CacheWriteError)
    ]
    message = getattr(result, "message", "").replace(str(staging / result.name), url)
    if not parts:
        kind = "missing" if isinstance(result, CacheMissing) else "write_error"
        return _result(
            "malformed" if isinstance(result, CacheMalformed) else kind,
            result.name,
            url,
            message,
            None,
        )
    message = (
        f"cache set {result.name!r} was not published at {url}: "
        + "; ".join(parts)
        + " (nothing of it was published: the next call writes every part again)"
    )
    return _result("write_error", result.name, url, message, None)


_Config = TypeVar("_Config", ReaderConfig, WriterConfig, RemoteConfig)


def _config(argument: str, value: _Config | None, cls: type[_Config]) -> _Config:
    """``value``, or the defaults of ``cls`` for ``None``; ``ConfigError`` naming ``argument``
    for anything else (a dict, another config)."""
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise _native.ConfigError(
            f"invalid {argument}: expected a {cls.__name__} or None, got {type(value).__name__}"
        )
    return value


def _remote(remote: RemoteConfig | None) -> RemoteConfig:
    return _config("remote", remote, RemoteConfig)


def _outcome(
    native_dataset: _native.Dataset | None,
    outcomes: list[tuple[str, str, str, str | None, int | None]],
) -> CacheSourcesDatasetSuccess | CacheSourcesDatasetError:
    results: list[CacheSourceResult] = [_result(*o) for o in outcomes]
    if native_dataset is None:
        return CacheSourcesDatasetError(results, _summary(results))
    return CacheSourcesDatasetSuccess(Dataset(native_dataset), results)
