"""Building a cache set with Ray Data: each block of a Ray dataset becomes one part, written by
one Ray task into a base directory that every node of the cluster sees (a shared file system),
or published by that task at a URL (object storage: ``s3://bucket/prefix``, ``file:///dir``).

``import dataset_rt.ray`` imports Ray; ``dataset_rt`` alone never does. The set is published
exactly as ``from_cache_sources`` publishes one (``dataset_rt.CacheSet``): by one rename once every
part is, and a rerun writes only the parts that are missing. Open it with
``runtime.open_caches(name, base_cache_dir)``.
"""

from __future__ import annotations

import operator
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from dataset_rt import _native
from dataset_rt._config import RemoteConfig, WriterConfig, is_url
from dataset_rt._results import (
    CacheInput,
    CacheLoaded,
    CacheMissing,
    CacheSourceResult,
    CacheWritten,
)
from dataset_rt._runtime import DatasetRuntime, _remote, _result

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


def _publish_block(
    table: Any,  # a pyarrow.Table
    url: str,
    name: str,
    to_input: Callable[[Mapping[str, Any]], CacheInput],
    writer: WriterConfig,
    threads: int,
    remote: RemoteConfig,
) -> tuple[str, str | None, int, int]:
    """A Ray task: writes one block as the part ``name`` in a temporary directory of this node's
    local cache directory, then publishes it at ``url/name``."""
    staging_root = os.path.join(_native.remote_local_dir(remote), ".publish")
    os.makedirs(staging_root, exist_ok=True)
    staging = tempfile.mkdtemp(prefix="part-", dir=staging_root)
    try:
        outcome = _write_block(table, staging, name, to_input, writer, threads)
        if outcome[0] == "written":
            _native.push_cache(os.path.join(staging, name), f"{url}/{name}", remote, False)
        return outcome
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_cache_set(
    ray_dataset: ray.data.Dataset,
    name: str,
    base_cache_dir: str | os.PathLike[str],
    to_input: Callable[[Mapping[str, Any]], CacheInput],
    *,
    writer_config: WriterConfig | None = None,
    threads_per_task: int = 1,
    remote: RemoteConfig | None = None,
) -> list[CacheSourceResult]:
    """Writes ``ray_dataset`` as the cache set ``base_cache_dir / name``, one part per block:
    part ``i`` holds block ``i``'s rows, in order, each turned into a ``CacheInput`` by
    ``to_input(row)`` in a Ray task (``to_input`` must be picklable by Ray: a function or a
    lambda is). ``base_cache_dir`` must be a path every node of the cluster sees, or a URL
    (``s3://bucket/prefix``, ``file:///dir``): then each task writes its part in the local cache
    directory of its node (``remote``, a :class:`RemoteConfig`, configures it and the store) and
    publishes it at ``URL/name/part``, and the set appears at ``URL/name`` by one conditional
    write of its set manifest once every part is published. Open it with
    ``runtime.open_caches(name, URL, remote=remote)``.

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

    threads_per_task = _threads(threads_per_task)
    writer = writer_config if writer_config is not None else WriterConfig()
    if not isinstance(writer, WriterConfig):
        raise _native.ConfigError(
            f"write_cache_set: writer_config must be a WriterConfig, got {type(writer).__name__}"
        )
    if not callable(to_input):
        raise _native.ConfigError(
            f"write_cache_set: to_input must be callable, got {type(to_input).__name__}"
        )
    _check_sendable(to_input)
    if not isinstance(ray_dataset, ray.data.Dataset):
        raise _native.ConfigError(
            "write_cache_set: ray_dataset must be a ray.data.Dataset, got "
            f"{type(ray_dataset).__name__}"
        )
    if not isinstance(name, str):
        raise _native.ConfigError(
            f"write_cache_set: name must be a str (the set's directory name), got "
            f"{type(name).__name__}"
        )
    if not isinstance(base_cache_dir, str | os.PathLike):
        raise _native.ConfigError(
            "write_cache_set: base_cache_dir must be a str, an os.PathLike or a URL, got "
            f"{type(base_cache_dir).__name__}"
        )
    if isinstance(base_cache_dir, str) and is_url(base_cache_dir):
        return _write_to_url(
            ray_dataset, name, base_cache_dir, to_input, writer, threads_per_task, _remote(remote)
        )
    if remote is not None:
        raise _native.ConfigError(
            "write_cache_set: remote= configures object storage, but "
            f"{os.fspath(base_cache_dir)!r} is not a URL (s3://..., file://...)"
        )
    base = os.fspath(base_cache_dir)
    if os.path.exists(os.path.join(base, name)):
        return _open(name, base)
    blocks = _blocks_in_order(ray_dataset)
    _check_fits(threads_per_task)
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


def _check_sendable(to_input: Callable[..., Any]) -> None:
    """Refuses a ``to_input`` that Ray cannot pickle (a closure over a lock, a file, a socket)
    before anything is created, instead of failing as the first task is submitted."""
    from ray import cloudpickle

    try:
        cloudpickle.dumps(to_input)  # type: ignore[no-untyped-call]  # Ray ships it untyped
    except Exception as error:
        raise _native.ConfigError(
            f"write_cache_set: to_input cannot be sent to Ray's tasks ({error}); pass a "
            "function whose closure holds no lock, file or connection"
        ) from error


def _threads(threads_per_task: object) -> int:
    """``threads_per_task`` as an int of at least 1 (checked before anything is created)."""
    try:
        if isinstance(threads_per_task, bool):
            raise TypeError
        n = operator.index(threads_per_task)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is None or n < 1:
        raise _native.ConfigError(
            "invalid write_cache_set.threads_per_task: expected an int >= 1 (CPUs and writer "
            f"threads of each Ray task), got {threads_per_task!r}"
        )
    return n


def _check_fits(threads_per_task: int) -> None:
    """Refuses tasks that no node of the running cluster has the CPUs for: Ray would keep them
    pending for ever, waiting for a node that never comes."""
    import ray

    nodes = ray.nodes()  # type: ignore[no-untyped-call]
    cpus = (node.get("Resources", {}).get("CPU", 0) for node in nodes if node.get("Alive"))
    largest = max(cpus, default=0)
    if threads_per_task > largest:
        raise _native.ConfigError(
            f"invalid write_cache_set.threads_per_task: {threads_per_task} CPUs per task, but "
            f"the largest node of the Ray cluster has {largest:g}, so no task could start; "
            "nothing was written"
        )


def _open(name: str, base: str) -> list[CacheSourceResult]:
    with DatasetRuntime(num_workers=1) as runtime:
        return runtime.open_caches(name, base).results


def _blocks_in_order(ray_dataset: ray.data.Dataset) -> list[Any]:
    """The dataset executed, its blocks (object refs of Arrow tables) in the dataset's order."""
    options = ray_dataset.context.execution_options
    preserved = options.preserve_order
    options.preserve_order = True
    try:
        return list(ray_dataset.to_arrow_refs())
    finally:
        options.preserve_order = preserved


def _write_to_url(
    ray_dataset: ray.data.Dataset,
    name: str,
    base_url: str,
    to_input: Callable[[Mapping[str, Any]], CacheInput],
    writer: WriterConfig,
    threads_per_task: int,
    remote: RemoteConfig,
) -> list[CacheSourceResult]:
    """``write_cache_set`` at a URL: the parts are written and published by Ray tasks, each on its
    own node, then the set manifest by the driver."""
    import ray

    base = base_url.rstrip("/")
    url = f"{base}/{name}"
    with DatasetRuntime(num_workers=1) as runtime:
        found = runtime.open_caches(name, base, remote=remote).results
    if not isinstance(found[0], CacheMissing):
        return found  # published already (CacheLoaded), or there and malformed: never rewritten
    blocks = _blocks_in_order(ray_dataset)
    _check_fits(threads_per_task)
    parts = _native.published_set_parts(url, len(blocks), remote)
    missing = [i for i, (_, samples) in enumerate(parts) if samples is None]
    progress = (
        _native.SetProgress(name, len(blocks), len(blocks) - len(missing))
        if writer.show_progress
        else None
    )
    task = ray.remote(num_cpus=threads_per_task)(_publish_block)
    pending = {
        task.remote(blocks[i], url, parts[i][0], to_input, writer, threads_per_task, remote): i
        for i in missing
    }
    results: list[CacheSourceResult | None] = [
        None if samples is None else CacheLoaded(part, f"{url}/{part}", samples)
        for part, samples in parts
    ]
    failed: list[str] = []
    totals = [0, 0]
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=_POLL_S)
            for ref in done:
                index = pending.pop(ref)
                part = parts[index][0]
                try:
                    kind, message, samples, nbytes = ray.get(ref)
                except ray.exceptions.RayError as error:
                    kind, message, samples, nbytes = (
                        "write_error",
                        f"part {index}: the Ray task failed: {error}",
                        0,
                        0,
                    )
                results[index] = _result(kind, part, f"{url}/{part}", message, samples)
                if kind != "written":
                    failed.append(f"part {index} ({part}): {message}")
                totals[0] += samples
                totals[1] += nbytes
            if progress is not None:
                progress.update(totals[0], totals[1], len(missing) - len(pending))
    except BaseException:
        for ref in pending:
            ray.cancel(ref, force=True)
        if progress is not None:
            progress.finish("interrupted")
        raise
    if failed:
        if progress is not None:
            progress.finish("failed")
        message = (
            f"cache set {name!r} is not published at {url}: "
            + "; ".join(failed)
            + " (the published parts are kept: call again to write only the missing ones)"
        )
        return [
            *(r for r in results if r is not None),
            _result("write_error", name, url, message, None),
        ]
    _native.publish_set(url, len(blocks), remote)
    if progress is not None:
        progress.finish("written")
    num_samples = sum(r.num_samples for r in results if isinstance(r, CacheLoaded | CacheWritten))
    return [
        *(r for r in results if r is not None),
        _result("written", name, url, None, num_samples),
    ]
