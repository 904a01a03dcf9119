"""The dataset over loaded caches: iteration, epochs, state and samples metadata."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# The native module makes zero-copy views of shards through numpy (a read-only array over its own
# map of the file): imported with the package, not at the first sample, so that a process that
# later drops its privileges or changes `sys.path` still reads.
import numpy  # noqa: F401

from dataset_rt import _native
from dataset_rt._config import as_index, check_epoch, is_bool, state_json
from dataset_rt._native import CachedSample

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import polars as pl

    from dataset_rt.torch import TorchIterableDataset

__all__ = ["Batch", "CachedSample", "Dataset", "require_dataset"]

# The most samples of a batch: those of the longest epoch (ReaderConfig.samples_per_epoch).
MAX_BATCH_SIZE = 2**40


class _ArrowStream:
    """Holds a native Arrow C stream capsule for the PyCapsule interface (`__arrow_c_stream__`)."""

    __slots__ = ("_capsule",)

    def __init__(self, capsule: object) -> None:
        self._capsule = capsule

    def __arrow_c_stream__(self, requested_schema: object | None = None) -> object:
        return self._capsule


class Batch:
    """Consecutive samples of a pass, from :meth:`Dataset.iter_batches`.

    The payloads come in two forms, each made on first access:

    - ``data``: one object per sample, a zero-copy ``memoryview`` slice of the memory-mapped
      shard (``bytes`` where a record was stored compressed);
    - ``buffers`` and ``spans``: no object per sample. Sample ``i``'s payload is
      ``buffers[b][start:end]`` for ``b, start, end = spans[i]``.

    Both stay valid for as long as they are held, after later batches too. ``indices`` and
    ``rows`` are also built on first access.
    """

    __slots__ = ("_indices", "_native", "_rows", "_spans")

    def __init__(self, native: _native.Batch) -> None:
        self._native = native
        self._indices: npt.NDArray[np.int64] | None = None
        self._spans: npt.NDArray[np.int64] | None = None
        self._rows: pl.DataFrame | None = None

    def __len__(self) -> int:
        return len(self._native)

    def __repr__(self) -> str:
        return f"Batch({len(self)} samples)"

    @property
    def data(self) -> list[memoryview | bytes]:
        """The payloads, one per sample, in order: a new list on each access (of the same
        objects), so that changing one list changes nothing of the batch."""
        return list(self._native.data)

    @property
    def buffers(self) -> tuple[memoryview | bytes, ...]:
        """The buffers that ``spans`` points into: read-only zero-copy ``memoryview``s of the
        shards the batch reads (whole shards, in order of first use), then, if any record was
        stored compressed, one ``bytes`` holding the batch's decompressed payloads end to end."""
        return self._native.buffers

    @property
    def spans(self) -> npt.NDArray[np.int64]:
        """Where each payload lies, in order: a read-only ``int64`` array of shape
        ``(len(batch), 3)`` whose row ``i`` is ``(buffer, start, end)``, so that payload ``i``
        is ``buffers[buffer][start:end]`` and its length is ``end - start``."""
        if self._spans is None:
            import numpy as np

            self._spans = np.frombuffer(self._native.spans_bytes(), dtype="<i8").reshape(-1, 3)
        return self._spans

    @property
    def indices(self) -> npt.NDArray[np.int64]:
        """The samples' global indices: their row numbers in :meth:`Dataset.samples_metadata`
        (read-only ``int64``)."""
        if self._indices is None:
            import numpy as np

            self._indices = np.frombuffer(self._native.indices_bytes(), dtype="<i8")
        return self._indices

    @property
    def rows(self) -> pl.DataFrame:
        """The samples' rows of :meth:`Dataset.samples_metadata`, in the batch's order
        (``cache_id | sample_id | <metadata...> | weight``, with the weights of the pass), built
        in Rust from the caches' metadata columns and handed to Polars through Arrow."""
        if self._rows is None:
            import polars as pl

            self._rows = pl.DataFrame(_ArrowStream(self._native.rows_stream()))
        return self._rows


class BatchIterator(Iterator[Batch]):
    """One pass of :meth:`Dataset.iter_batches`: its batches, and like ``iter(dataset)``'s
    iterator ``len()`` and ``epoch``. ``len()`` is the batches left in the pass (the last one
    may be short unless ``drop_last``)."""

    __slots__ = ("_native", "_size")

    def __init__(self, native: _native.BatchIterator, size: int) -> None:
        self._native = native
        self._size = size

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> Batch:
        return Batch(next(self._native))

    def __len__(self) -> int:
        return -(-len(self._native) // self._size)

    @property
    def epoch(self) -> int:
        """The epoch this pass reads."""
        return self._native.epoch

    def __repr__(self) -> str:
        return f"BatchIterator(epoch={self.epoch}, batches_left={len(self)})"


class Dataset:
    """Samples of one or more caches, read in a deterministic order.

    ``for sample in dataset`` is one epoch of this rank's samples; the next pass is the next
    epoch (:meth:`set_epoch` fixes it). Payloads of uncompressed caches are zero-copy
    ``memoryview`` slices of the memory-mapped shard.
    """

    __slots__ = ("_native",)

    def __init__(self, native: _native.Dataset) -> None:
        self._native = native

    def __iter__(self) -> Iterator[CachedSample]:
        return self._native.__iter__()

    def iter_batches(self, batch_size: int, *, drop_last: bool = False) -> BatchIterator:
        """One pass, ``batch_size`` samples at a time: the same order, rank split, epochs and
        state as ``for sample in dataset``. ``state_dict()`` counts the samples of the batches
        yielded; a state loaded at any position resumes at its exact next sample, and the first
        batch then starts there. With ``drop_last`` the pass ends after its last whole batch.
        ``batch_size`` is an int from 1 to 2**40 (``ConfigError`` out of that range,
        ``TypeError`` for a non-int or a bool)."""
        size = as_index(batch_size)
        if size is None:
            # What the native call has always raised for a non-int (2.5, "3", None).
            raise TypeError(f"iter_batches: batch_size must be an int, got {batch_size!r}")
        if not 1 <= size <= MAX_BATCH_SIZE:
            raise _native.ConfigError(
                f"iter_batches: invalid batch_size {batch_size}: must be at least 1 and at most "
                "2**40"
            )
        if not is_bool(drop_last):
            raise TypeError(f"iter_batches: drop_last must be a bool, got {drop_last!r}")
        return BatchIterator(self._native.iter_batches(size, drop_last=bool(drop_last)), size)

    def __len__(self) -> int:
        """This rank's samples per epoch."""
        return len(self._native)

    def __repr__(self) -> str:
        return (
            f"Dataset(caches={self.cache_names}, samples={self.num_samples}, "
            f"rank={self.rank}/{self.world_size})"
        )

    @property
    def num_samples(self) -> int:
        """Samples in all loaded caches (before sampling and the rank split)."""
        return self._native.num_samples

    @property
    def cache_names(self) -> list[str]:
        return self._native.cache_names

    @property
    def cache_dirs(self) -> list[Path]:
        return [Path(p) for p in self._native.cache_dirs]

    @property
    def rank(self) -> int:
        return self._native.rank

    @property
    def world_size(self) -> int:
        return self._native.world_size

    @property
    def fingerprint(self) -> str:
        """Identifies the loaded caches' content, in order."""
        return self._native.fingerprint

    @property
    def verified_samples(self) -> int | None:
        """Under ``verify="once"``, the samples whose records passed their checksum so far,
        read by this dataset or by its loaders' producers (they share one record of it);
        ``None`` under the other policies."""
        return self._native.verified_samples

    def set_epoch(self, epoch: int) -> None:
        """Makes the next pass read ``epoch``: an int from 0 to 2**64 - 2 (``ConfigError``
        otherwise, a bool included)."""
        self._native.set_epoch(check_epoch("Dataset.set_epoch epoch", epoch))

    def state_dict(self) -> dict[str, Any]:
        """The iterator state as plain JSON-serialisable data: what the loop has received."""
        state: dict[str, Any] = json.loads(self._native.state_json())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next pass continue at the exact next sample of ``state``; refuses a state
        of another dataset, weight table, seed or epoch length."""
        self._native.load_state_json(state_json(state))

    def samples_metadata(self) -> pl.DataFrame:
        """``cache_id | sample_id | <metadata...> | weight`` as a Polars DataFrame, handed over
        through the Arrow C stream interface (the metadata columns are not copied).

        Like a sample's ``metadata``, the first use of a cache's metadata table checks its
        ``metadata.arrow`` (checksum, decoding): a damaged one raises ``CacheMalformedError``
        naming the file."""
        import polars as pl

        return pl.DataFrame(_ArrowStream(self._native.samples_metadata_stream()))

    def set_samples_metadata(self, table: pl.DataFrame) -> None:
        """Applies the ``weight`` column of ``table``; validated in Rust, all or nothing."""
        import io

        import polars as pl

        if not isinstance(table, pl.DataFrame):
            kind = type(table)
            name = (
                kind.__qualname__
                if kind.__module__ == "builtins"
                else f"{kind.__module__}.{kind.__qualname__}"
            )
            hint = (
                " (convert it with polars.from_pandas)"
                if kind.__module__.startswith("pandas")
                else ""
            )
            raise TypeError(f"expected a polars.DataFrame, got {name}{hint}")
        buffer = io.BytesIO()
        table.write_ipc_stream(buffer, compat_level=pl.CompatLevel.oldest())
        self._native.set_samples_metadata_ipc(buffer.getvalue())

    def to_torch_iterable_dataset(self) -> TorchIterableDataset:
        """A sized ``torch.utils.data.IterableDataset`` yielding :class:`CachedSample`, for
        torch's ``DataLoader`` with ``num_workers=0``. Imports ``dataset_rt.torch`` (and torch),
        which registers ``CachedSample`` in torch's ``default_collate``: with a ``batch_size``, a
        batch is ``{"data": [payload views], "metadata": {field: tensor or list}}``."""
        from dataset_rt.torch import TorchIterableDataset

        return TorchIterableDataset(self)


def require_dataset(value: object, caller: str) -> Dataset:
    """``value`` when it is a :class:`Dataset`; otherwise a ``TypeError`` that says what was
    passed and what to pass instead."""
    if isinstance(value, Dataset):
        return value
    kind = type(value)
    got = f"{kind.__module__}.{kind.__qualname__}"
    if hasattr(value, "dataset") and hasattr(value, "results"):
        hint = "pass its .dataset"
    elif isinstance(getattr(value, "dataset", None), Dataset):  # the torch adapter
        hint = "pass the Dataset itself, not its to_torch_iterable_dataset()"
    else:
        hint = "pass result.dataset, from DatasetRuntime.from_cache_sources or open_caches"
    raise TypeError(f"{caller} takes a dataset_rt Dataset, got {got}: {hint}")
