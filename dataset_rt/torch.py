"""DatasetRT's PyTorch integration: importing this module imports torch; ``dataset_rt`` itself
never does.

- :class:`TorchIterableDataset` (``Dataset.to_torch_iterable_dataset()``): the in-process reader
  as a sized ``IterableDataset`` for torch's own ``DataLoader`` (``num_workers=0``).
- :class:`DataLoader`: the shared-memory loader as a real ``torch.utils.data.DataLoader``
  (``isinstance`` checks pass, ``len()`` is batches per epoch).
- Training frameworks (Lightning, Accelerate, Ray Train) take :class:`DataLoader` as it is:
  its ``sampler`` is a ``DistributedSampler`` that describes the loader's own rank split, so
  nothing shards it again, and ``Accelerator.prepare`` hands it back unchanged
  (docs/frameworks.md).
- Batches of :class:`~dataset_rt.CachedSample` collate under torch's own ``default_collate``
  (registered in torch's collate map on import) and under :func:`default_collate`, to the same
  structure: ``{"data": [payload, ...], "metadata": {field: tensor or list of str}}``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.utils.data
import torch.utils.data.distributed
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

from dataset_rt import _loader
from dataset_rt._loader import results
from dataset_rt._native import CachedSample, ConfigError

if TYPE_CHECKING:
    from dataset_rt._dataset import Dataset

__all__ = ["DataLoader", "TorchIterableDataset", "default_collate"]

_WORKERS_REFUSED = (
    "DatasetRT's torch IterableDataset runs in the training process only: use "
    "torch.utils.data.DataLoader(..., num_workers=0) and parallelise reads with "
    "DatasetRuntime(num_workers=N). Torch worker processes would each replay the whole epoch; "
    "for transforms in parallel worker processes use dataset_rt.torch.DataLoader (the "
    "shared-memory loader, also dataset_rt.DataLoader), which takes the same batch_size, "
    "num_workers and collate_fn."
)

# torch's arguments that DataLoader accepts but does not honour, with what to know instead. Each
# warns once per process, as torch's own warnings do; drop an entry once it is honoured.
_IGNORED_ARGUMENTS = {
    "generator": "the order is the dataset's own (ReaderConfig seed and shuffle)",
}
_warned_ignored: set[str] = set()


def _warn_ignored(argument: str) -> None:
    if argument in _warned_ignored:
        return
    _warned_ignored.add(argument)
    warnings.warn(
        f"dataset_rt.torch.DataLoader ignores {argument}=: {_IGNORED_ARGUMENTS[argument]}",
        UserWarning,
        stacklevel=3,
    )


class _IndexedBatches(Protocol):
    """What a pass of the shared-memory loader (``iter(dataset_rt.DataLoader)``) offers beyond
    an iterator: the global sample indices of the batch it delivered last."""

    def __iter__(self) -> Iterator[Any]: ...

    @property
    def last_indices(self) -> list[int]: ...


class TorchIterableDataset(torch.utils.data.IterableDataset[CachedSample]):
    """A sized ``IterableDataset`` over a DatasetRT dataset, yielding :class:`CachedSample`.

    It neither decodes payloads nor changes the order: one pass is one epoch of the dataset.
    Torch worker processes are refused: with the ``spawn`` or ``forkserver`` start method
    ``iter(loader)`` raises in the training process (torch pickles the dataset for its workers,
    which this class refuses); with ``fork`` nothing of the dataset runs in the training process
    before the workers do, so the first batch raises the workers' refusal, re-raised by torch.
    """

    def __init__(self, dataset: Dataset) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator[CachedSample]:
        if torch.utils.data.get_worker_info() is not None:
            raise ConfigError(_WORKERS_REFUSED)
        return iter(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getstate__(self) -> Any:
        raise ConfigError(_WORKERS_REFUSED)


class _Payloads(list[Any]):
    """A batch's payloads. They are bytes, not tensors: torch's ``pin_memory`` leaves them as
    they are instead of rebuilding each ``memoryview`` (a ``Sequence``) item by item."""

    __slots__ = ()

    def pin_memory(self, device: Any = None) -> _Payloads:
        return self


def _collate_metadata(
    batch: list[CachedSample], collate_fn_map: dict[Any, Callable[..., Any]] | None
) -> Any:
    metadata = [s.metadata for s in batch]
    fields = metadata[0].keys()
    for position, m in enumerate(metadata):
        if m.keys() != fields:
            raise ValueError(
                f"cannot collate the metadata of a batch of CachedSample: sample {position} of "
                f"the batch has the fields {sorted(m)}, sample 0 has {sorted(fields)} (samples of "
                "caches with other metadata schemas need a collate_fn of their own)"
            )
    return collate(metadata, collate_fn_map=collate_fn_map)


def _collate_cached_sample_views(
    batch: list[CachedSample], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> dict[str, Any]:
    # Registered in torch's map: the payloads stay the samples' own objects (zero-copy views of
    # the in-process reader, valid for as long as they are held).
    return {
        "data": _Payloads(s.data for s in batch),
        "metadata": _collate_metadata(batch, collate_fn_map),
    }


def _collate_cached_samples(
    batch: list[CachedSample], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> dict[str, Any]:
    # The shared-memory loader's default: its views die with their ring slot (num_workers=0),
    # so the payloads are copied into bytes, which outlive it.
    return {
        "data": [bytes(s.data) for s in batch],
        "metadata": _collate_metadata(batch, collate_fn_map),
    }


def _collate_tensors(
    batch: list[torch.Tensor], *, collate_fn_map: dict[Any, Callable[..., Any]] | None = None
) -> torch.Tensor:
    # In a loader worker, the stacked batch is written once, straight into the worker's result
    # memory, and reaches the training loop without another copy (as torch's own collate
    # stacks into shared memory inside its workers). Only a batch of one dtype: an `out=` of
    # the first tensor's dtype would cast the others to it, where torch.stack promotes. Anything
    # else is torch's business.
    elem = batch[0]
    if (
        elem.layout == torch.strided
        and elem.device.type == "cpu"
        and not elem.is_nested
        and all(
            t.shape == elem.shape and t.dtype == elem.dtype and not t.requires_grad for t in batch
        )
    ):
        numel = elem.numel() * len(batch)
        buffer = results.result_buffer(numel * elem.element_size())
        if buffer is not None:
            out = torch.frombuffer(buffer, dtype=elem.dtype, count=numel)
            return torch.stack(batch, 0, out=out.view(len(batch), *elem.shape))
    stacked: torch.Tensor = collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
    return stacked


# torch's own default_collate (and so torch's DataLoader with a batch_size) collates batches of
# CachedSample from here on; a function the user registered first is kept.
default_collate_fn_map.setdefault(CachedSample, _collate_cached_sample_views)

_COLLATE_FN_MAP: dict[Any, Callable[..., Any]] = {
    **default_collate_fn_map,
    torch.Tensor: _collate_tensors,
    CachedSample: _collate_cached_samples,
}


def default_collate(batch: list[Any]) -> Any:
    """``torch.utils.data.default_collate`` that also takes ``CachedSample`` (anywhere in a
    batch's structure): a batch of them becomes ``{"data": [bytes, ...], "metadata":
    default_collate(the metadata dicts)}``. The payloads are copies, so they outlive the
    loader's ring slots; torch's own ``default_collate`` gives the same structure with the
    samples' views instead.
    In a loader worker, tensors are stacked straight into the worker's result memory."""
    return collate(batch, collate_fn_map=_COLLATE_FN_MAP)


# It stacks equal tensors as torch.stack does: a loader worker may write each transformed
# sample's row into result memory as it comes (the loader knows nothing of this module).
results.register_tensor_stacking_collate(default_collate)


class _RankSplit(torch.utils.data.distributed.DistributedSampler):  # type: ignore[type-arg]
    """What ``DataLoader.sampler`` shows torch code: the split the loader already makes, the
    dataset's rank and world size, as a ``DistributedSampler``. Frameworks that shard a loader by
    giving it one (Lightning's ``use_distributed_sampler``, Ray Train's ``prepare_data_loader``)
    see it is done and leave the loader alone; ``set_epoch`` is the loader's. It is never
    iterated: the order is the producer's, read in the loader's own ``__iter__``.
    """

    def __init__(self, loader: _loader.DataLoader) -> None:
        # Not DistributedSampler.__init__: it asks torch.distributed, and the dataset knows.
        dataset = loader.dataset
        state = loader.state_dict()
        self._loader = loader
        self.dataset = dataset  # type: ignore[assignment]
        self.num_replicas = dataset.world_size
        self.rank = dataset.rank
        self.epoch = int(state["epoch"])
        self.shuffle = bool(state["shuffle"])
        self.seed = int(state["seed"])
        self.num_samples = len(dataset)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[int]:
        raise ConfigError(
            "the sampler of dataset_rt.torch.DataLoader only describes its rank split and "
            "cannot be iterated: iterate the loader itself, which reads the dataset's order"
        )

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Makes the loader's next pass read ``epoch`` from its start, unless that pass reads
        ``epoch`` already: frameworks call this at each epoch's start, also right after loading
        a mid-epoch state, whose position must then be kept. Lightning calls it after
        ``iter(loader)``: a pass of ``epoch`` started and not yet read from is kept, so that it
        moves the state. A pass of ``epoch`` left early (a sanity check's few batches) is read
        again from its start, as torch's sampler does."""
        self.epoch = epoch
        running = self._loader._untouched_pass_epoch()
        if running is not None and running == epoch:
            return
        if self._loader._next_pass_epoch() != epoch:
            self._loader.set_epoch(epoch)


def _lightning_index_wrapper(batch_sampler: Any) -> bool:
    """Whether ``batch_sampler`` is the index-recording wrapper ``Trainer.predict`` puts around
    a loader's batch sampler (lightning.pytorch.overrides.distributed), without importing
    Lightning."""
    cls = type(batch_sampler)
    return cls.__name__ == "_IndexBatchSamplerWrapper" and cls.__module__.split(".")[0] in (
        "lightning",
        "pytorch_lightning",
    )


def _predict_split(dataset: Dataset, wrapper: Any) -> _RankSplit:
    """The rank split inside Lightning's prediction wrapper: that of a loader of this dataset,
    re-created with it; ``ConfigError`` for anything else."""
    inner = getattr(wrapper, "_batch_sampler", None)
    split = getattr(inner, "sampler", None)
    if not isinstance(split, _RankSplit) or split._loader.dataset is not dataset:
        raise ConfigError(
            "dataset_rt.torch.DataLoader takes Lightning's prediction batch sampler only around "
            "the rank split of a dataset_rt.torch.DataLoader of the same dataset (what "
            f"Trainer.predict makes of one); got one around {type(split).__name__}"
        )
    return split


def _callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise ConfigError(f"invalid DataLoader.{name}: expected a callable or None, got {value!r}")
    return value


class _WorkerInit:
    """The user's ``worker_init_fn``, from this module: a spawned worker that unpickles it
    imports torch before it starts, so every worker of this adapter runs with one intra-op
    thread (set by every loader worker where torch is imported, before ``worker_init_fn``:
    ``dataset_rt._loader.workers.one_torch_thread``), as torch's own workers do."""

    def __init__(self, user: Callable[[int], None] | None) -> None:
        self.user = user

    def __call__(self, index: int) -> None:
        if self.user is not None:
            self.user(index)


# The options that may not be reassigned: the loader reads them at construction. torch's own
# guard covers batch_size, drop_last, dataset, sampler, batch_sampler and persistent_workers
# with a plain ValueError; all of them are refused here first, as ConfigError in torch's words.
_FIXED_AFTER_INIT = frozenset(
    {
        "batch_size",
        "drop_last",
        "dataset",
        "sampler",
        "batch_sampler",
        "persistent_workers",
        "num_workers",
        "collate_fn",
        "timeout",
        "prefetch_factor",
        "multiprocessing_context",
        "transform",
        "slot_size_bytes",
        "heartbeat_timeout",
        "producer_threads",
        "result_bytes",
    }
)
# None of the options may be deleted (torch's guard does not cover deletion).
_KEPT_AFTER_INIT = _FIXED_AFTER_INIT | {"worker_init_fn"}


class DataLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """A drop-in ``torch.utils.data.DataLoader`` over a DatasetRT dataset.

    Takes torch's arguments plus ``transform`` (per sample, in the workers),
    ``slot_size_bytes``, ``heartbeat_timeout``, ``producer_threads`` and
    ``result_bytes``; collates with
    :func:`default_collate` (torch's, plus ``CachedSample``) unless given ``collate_fn``. The
    order is the dataset's (``ReaderConfig(seed=, shuffle=)``), so ``shuffle``, ``sampler`` and
    ``batch_sampler`` are refused (except Lightning's prediction wrapper around the loader's own
    rank split, whose record of batch indices the loader fills). ``persistent_workers=True``
    keeps the producer, the workers and the ring between epochs. ``generator`` is not used.
    ``pin_memory`` pins on CUDA; without it, a warning (as torch gives) and no pinning.

    ``sampler`` is a ``DistributedSampler`` describing the dataset's rank split (it cannot be
    iterated), and ``Accelerator.prepare`` returns the loader unchanged: see
    docs/frameworks.md. ``state_dict``/``load_state_dict`` follow torchdata's
    ``StatefulDataLoader``: a state taken mid-epoch resumes at the next batch, one taken after
    an epoch's last batch starts the next epoch.
    """

    # Accelerate's own marker of a loader it already prepared: `Accelerator.prepare` returns
    # it as it is instead of re-creating it with a second rank split (or a dispatcher).
    _is_accelerate_prepared = True

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        transform: Callable[[CachedSample], Any] | None = None,
        slot_size_bytes: int | None = None,
        heartbeat_timeout: float = _loader.DEFAULT_HEARTBEAT_TIMEOUT,
        producer_threads: int | None = None,
        result_bytes: int | None = None,
    ) -> None:
        from dataset_rt._dataset import require_dataset

        require_dataset(dataset, "dataset_rt.torch.DataLoader")
        # Lightning's Trainer.predict re-creates the loader with its batch sampler wrapped in
        # one that records each batch's indices: take the batch size from it, and fill the
        # record from what the producer delivers (see __iter__).
        self._index_recorder: Any = None
        resumed_from: _RankSplit | None = None
        if batch_sampler is not None and _lightning_index_wrapper(batch_sampler):
            resumed_from = _predict_split(dataset, batch_sampler)
            inner = batch_sampler._batch_sampler
            batch_size, drop_last = int(inner.batch_size), bool(inner.drop_last)
            self._index_recorder, batch_sampler = batch_sampler, None
        if shuffle or sampler is not None or batch_sampler is not None:
            raise ConfigError(
                "dataset_rt.torch.DataLoader reads the dataset's own order: set seed/shuffle in "
                "ReaderConfig instead of shuffle=, sampler= or batch_sampler="
            )
        if generator is not None:
            _warn_ignored("generator")
        collate_batch = default_collate if collate_fn is None else collate_fn
        self._shm = _loader.DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            transform=transform,
            collate_fn=collate_batch,
            drop_last=drop_last,
            prefetch_factor=2 if prefetch_factor is None else prefetch_factor,
            slot_size_bytes=slot_size_bytes,
            multiprocessing_context=multiprocessing_context,
            timeout=timeout,
            heartbeat_timeout=heartbeat_timeout,
            worker_init_fn=_WorkerInit(_callable("worker_init_fn", worker_init_fn)),
            producer_threads=producer_threads,
            result_bytes=result_bytes,
            persistent_workers=persistent_workers,
        )
        # The arguments as the loader checked them (an int for numpy's ints, a float timeout).
        shm = self._shm
        batch_size, drop_last, num_workers = shm.batch_size, shm.drop_last, shm.num_workers
        timeout, persistent_workers = shm.timeout, shm.persistent_workers
        if prefetch_factor is not None:
            prefetch_factor = shm.prefetch_factor
        # Frameworks that re-create a loader from its attributes (Lightning, for a loader made
        # outside its hooks) find these arguments too.
        self.transform = transform
        self.slot_size_bytes = slot_size_bytes
        self.heartbeat_timeout = heartbeat_timeout
        self.producer_threads = producer_threads
        self.result_bytes = result_bytes
        split = _RankSplit(self._shm)
        batch_sampler_arg: Any = None
        if resumed_from is not None:
            # The re-created loader reads on from where the loader it replaces stands.
            self._shm.load_state_dict(resumed_from._loader.state_dict())
            recorder = self._index_recorder
            recorder._batch_sampler = torch.utils.data.BatchSampler(split, batch_size, drop_last)
            recorder.sampler = split
            recorder.batch_size, recorder.drop_last = batch_size, drop_last
            batch_sampler_arg, batch_size, drop_last = recorder, 1, False
        # torch's own constructor validates its arguments and sets the attributes frameworks
        # read (batch_size, num_workers, pin_memory, sampler, ...); the sampler is never
        # iterated.
        super().__init__(
            dataset,  # type: ignore[arg-type]
            batch_size=batch_size,
            batch_sampler=batch_sampler_arg,
            sampler=split if batch_sampler_arg is None else None,
            num_workers=num_workers,
            collate_fn=collate_batch,
            pin_memory=pin_memory,
            drop_last=drop_last,
            timeout=timeout,
            worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device,
        )

    def __setattr__(self, name: str, value: Any) -> None:
        # Every option is refused once torch's constructor has run, as ConfigError in torch's
        # words (the loader read them at construction; torch's own guard would raise a plain
        # ValueError for some). worker_init_fn is the exception: Lightning sets it under
        # seed_everything(workers=True), and it applies from the next pass that starts workers.
        if getattr(self, "_DataLoader__initialized", False):
            if name == "worker_init_fn":
                self._shm._replace_worker_init_fn(_WorkerInit(_callable(name, value)))
            elif name in _FIXED_AFTER_INIT:
                raise ConfigError(
                    f"{name} attribute should not be set after {type(self).__name__} is initialized"
                )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if getattr(self, "_DataLoader__initialized", False) and name in _KEPT_AFTER_INIT:
            raise ConfigError(
                f"{name} attribute should not be deleted after {type(self).__name__} is initialized"
            )
        super().__delattr__(name)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        loader_pass = iter(self._shm)
        batches: Iterator[Any] = loader_pass
        if self._index_recorder is not None:
            batches = self._recording(loader_pass)
        if self.pin_memory and not torch.cuda.is_available():
            # What torch's DataLoader does without an accelerator: say so, do not pin.
            warnings.warn(
                "'pin_memory' argument is set as true but no accelerator is found, "
                "then device pinned memory won't be used.",
                stacklevel=2,
            )
        if not (self.pin_memory and torch.cuda.is_available()):
            return batches
        return self._pinned(batches)

    def _recording(self, batches: _IndexedBatches) -> Iterator[Any]:
        """Lightning's record of the pass's batches: each batch's global sample indices (rows
        of ``samples_metadata()``, padding included), as the producer wrote them."""
        recorder = self._index_recorder
        recorder.seen_batch_indices = []
        for batch in batches:
            recorder.seen_batch_indices.append(list(batches.last_indices))
            yield batch

    def _pinned(self, batches: Iterator[Any]) -> Iterator[Any]:
        from torch.utils.data._utils.pin_memory import pin_memory

        for batch in batches:
            yield pin_memory(batch, self.pin_memory_device or None)  # type: ignore[no-untyped-call]

    def __len__(self) -> int:
        return len(self._shm)

    def set_epoch(self, epoch: int) -> None:
        self._shm.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        return self._shm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._shm.load_state_dict(state)

    def close(self) -> None:
        self._shm.close()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
