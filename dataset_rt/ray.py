"""Building a cache set with Ray Data: each block of a Ray dataset becomes one part, written by
one Ray task into a base directory that every node of the cluster sees (a shared file system).

``import dataset_rt.ray`` imports Ray; ``dataset_rt`` alone never does. The set is published
exactly as ``from_cache_sources`` publishes one (``dataset_rt.CacheSet``): by one rename once every
part is, and a rerun writes only the parts that are missing. Open it with
``runtime.open_caches(name, base_cache_dir)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dataset_rt import _native
from dataset_rt._config import WriterConfig
from dataset_rt._results import CacheInput, CacheSourceResult
from dataset_rt._runtime import DatasetRuntime, _result

if TYPE_CHECKING:
    import ray.data

__all__ = ["write_cache_set"]

# How often the driver redraws the set's line while it waits for the tasks.
_POLL_S = 0.2


class _BlockRows:
    """One block's rows as a source: ``to_input(row)`` for each row, in the block's order."""

    __slots__ = ("table", "to_input")

    def __init__(self, table: Any, to_input: Callable[[dict[str, Any]], CacheInput]) -> None:
        self.table = table
        self.to_input = to_input

    def __iter__(self) -> Iterator[CacheInput]:
        for batch in self.table.to_batches():
            for row in batch.to_pylist():
                yield self.to_input(row)


def _write_block(
    table: Any,  # a pyarrow.Table
    staging: str,
    name: str,
    to_input: Callable[[Mapping[str, Any]], CacheInput],
    writer: WriterConfig,
    threads: int,
) -> tuple[str, str | None, int, int]:
    """A Ray task: writes one block as the part ``name`` of the set staged in ``staging``."""
    runtime = _native.Runtime(threads)
    try:
        return _native.write_part(runtime, _BlockRows(table, to_input), staging, name, writer)
    finally:
        runtime.close()


def write_cache_set(
    ray_dataset: ray.data.Dataset,
    name: str,
    base_cache_dir: str | os.PathLike[str],
    to_input: Callable[[Mapping[str, Any]], CacheInput],
    *,
    writer_config: WriterConfig | None = None,
    threads_per_task: int = 1,
) -> list[CacheSourceResult]:
    """Writes ``ray_dataset`` as the cache set ``base_cache_dir / name``, one part per block:
    part ``i`` holds block ``i``'s rows, in order, each turned into a ``CacheInput`` by
    ``to_input(row)`` in a Ray task (``to_input`` must be picklable by Ray: a function or a
    lambda is). ``base_cache_dir`` must be a path every node of the cluster sees.

    The dataset is executed first, with its block order preserved (its blocks wait in Ray's
    object store, which spills to disk), so the parts follow the dataset's order whatever the
    scheduling. The partitioning (the blocks) decides the content: the same rows in the same
    blocks give the same set, byte for byte, as ``from_cache_sources(CacheSet(name, parts))``.

    Returns one result per part (``CacheWritten``, ``CacheLoaded`` for a part published by an
    earlier run, ``CacheWriteError``, ``CacheMalformed``), then the set's own:
    ``CacheWritten`` once it is published, ``CacheWriteError`` when a part failed (the published
    parts are kept: call again to write only the missing ones). A set that is published already
    is not written again: the result is that of ``open_caches`` (``CacheLoaded``).
    ``KeyboardInterrupt`` cancels the tasks and publishes nothing.
    """
    import ray

    writer = writer_config if writer_config is not None else WriterConfig()
    if not isinstance(writer, WriterConfig):
        raise _native.ConfigError(
            f"write_cache_set: writer_config must be a WriterConfig, got {type(writer).__name__}"
        )
    if not callable(to_input):
        raise _native.ConfigError(
            f"write_cache_set: to_input must be callable, got {type(to_input).__name__}"
        )
    base = os.fspath(base_cache_dir)
    if os.path.exists(os.path.join(base, name)):
        return _open(name, base)
    options = ray_dataset.context.execution_options
    preserved = options.preserve_order
    options.preserve_order = True
    try:
        blocks = ray_dataset.to_arrow_refs()
    finally:
        options.preserve_order = preserved
    builder = _native.SetBuilder(base, name, len(blocks))
    if builder.published is not None:
        return _open(name, base)
    try:
        missing = builder.missing_parts()
        progress = (
            _native.SetProgress(name, len(blocks), builder.published_parts())
            if writer.show_progress
            else None
        )
        task = ray.remote(num_cpus=threads_per_task)(_write_block)
        pending = {
            task.remote(
                blocks[i],
                builder.staging,
                builder.part_names[i],
                to_input,
                writer,
                threads_per_task,
            ): i
            for i in missing
        }
        reports: list[tuple[int, str, str | None, int]] = []
        totals = [0, 0]
        try:
            while pending:
                done, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
                for ref in done:
                    index = pending.pop(ref)
                    try:
                        kind, message, samples, nbytes = ray.get(ref)
                    except ray.exceptions.RayError as error:
                        kind, message, samples, nbytes = (
                            "write_error",
                            f"part {index}: the Ray task failed: {error}",
                            0,
                            0,
                        )
                    reports.append((index, kind, message, samples))
                    totals[0] += samples
                    totals[1] += nbytes
                if progress is not None:
                    progress.update(totals[0], totals[1], len(reports))
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            if progress is not None:
                progress.finish("interrupted")
            raise
        outcomes = builder.finish(reports)
        if progress is not None:
            progress.finish("written" if outcomes[-1][0] == "written" else "failed")
        return [_result(*o) for o in outcomes]
    finally:
        builder.close()


def _open(name: str, base: str) -> list[CacheSourceResult]:
    with DatasetRuntime(num_workers=1) as runtime:
        return runtime.open_caches(name, base).results
