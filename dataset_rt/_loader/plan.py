"""The loader's face: :class:`DataLoader` checks its options and holds the plan
(``_native.LoaderPlan``, the Rust pass plan), which decides every pass, the epochs and the
state; each ``iter(loader)`` runs a pass (:mod:`.passes`)."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import sys
from collections.abc import Callable
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING, Any

from dataset_rt import _native
from dataset_rt._config import check_epoch, check_int, check_seconds, is_bool, state_json
from dataset_rt._loader import lifecycle, results
from dataset_rt._loader.passes import LoaderIterator
from dataset_rt._native import CachedSample, ConfigError

if TYPE_CHECKING:
    from dataset_rt._dataset import Dataset

__all__ = ["DataLoader"]

# Seconds a live producer or worker may show no sign of life before the loop gives up on it.
DEFAULT_HEARTBEAT_TIMEOUT = 30.0
# The largest values the options take (docs/python-api.md). A batch holds at most an epoch's
# samples (2**40); the others are far beyond any use and keep every size the ring is made of
# (slot count times slot size) within 64 bits.
MAX_HEARTBEAT_TIMEOUT = 7 * 24 * 3600.0
MAX_BATCH_SIZE = 2**40
MAX_NUM_WORKERS = 1024
MAX_PREFETCH_FACTOR = 1024
MAX_SLOT_SIZE_BYTES = 2**40

# The constructor's options, held as attributes that cannot be reassigned.
OPTIONS = frozenset(
    {
        "dataset",
        "batch_size",
        "num_workers",
        "transform",
        "collate_fn",
        "drop_last",
        "prefetch_factor",
        "slot_size_bytes",
        "timeout",
        "heartbeat_timeout",
        "worker_init_fn",
        "producer_threads",
        "result_bytes",
        "persistent_workers",
    }
)


def max_result_bytes() -> int:
    """The most ``result_bytes`` may be: the machine's physical memory (more could never be
    filled; a region is shared memory)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):  # pragma: no cover - Linux has both
        return 2**48


def _flag(where: str, value: object) -> bool:
    """A bool argument: ``True`` or ``False`` (a ``numpy.bool_`` too); ``ConfigError``
    otherwise, rather than reading ``1`` or ``"no"`` as truthy."""
    if is_bool(value):
        return bool(value)
    raise ConfigError(f"invalid {where}: {value!r} is not a bool")


def _context(value: str | BaseContext | None) -> Any:
    # Any: typeshed's BaseContext lacks Process, which every concrete context has.
    if value is None:
        # Python's default; where that is forkserver (Linux from 3.14), spawn instead.
        default = multiprocessing.get_start_method()
        return multiprocessing.get_context(default if default in ("fork", "spawn") else "spawn")
    if not isinstance(value, str) and not callable(getattr(value, "get_start_method", None)):
        raise ConfigError(
            "invalid DataLoader.multiprocessing_context: expected 'fork', 'spawn', a "
            f"multiprocessing context or None, got {value!r}"
        )
    method = value if isinstance(value, str) else value.get_start_method()
    if method not in ("fork", "spawn"):
        raise ConfigError(
            f"invalid DataLoader.multiprocessing_context: {method!r}; use 'fork' or 'spawn'"
        )
    return multiprocessing.get_context(method) if isinstance(value, str) else value


class DataLoader:
    """Batches of a :class:`~dataset_rt.Dataset` through the shared-memory loader (Linux).

    - ``batch_size``: samples per batch; the last may be short unless ``drop_last``. The only
      argument besides ``dataset`` that may be given by position.
    - ``num_workers``: processes running ``transform`` (per sample) and ``collate_fn`` (per
      batch); ``0`` runs them in the training process on zero-copy views.
    - ``collate_fn``: ``None`` yields each batch as a list.
    - ``prefetch_factor``: ring slots per worker (at least 2 slots in all, plus one with
      ``num_workers=0``): how far the producer may run ahead of the training loop.
    - With ``num_workers=0``, ``sample.data`` views stay valid as long as they are referenced
      (views of an uncompressed record are views of its shard file; a batch of decompressed
      records kept past the next one is copied once when its slot is reused).
    - ``slot_size_bytes``: bytes of one slot; ``None`` sizes slots from the data, so that a
      batch of the dataset's largest samples fits. A batch that does not fit an explicit size
      raises ``LoaderError`` naming both sizes (it is never truncated).
    - ``multiprocessing_context``: ``"fork"``, ``"spawn"`` or a context; ``None`` = Python's.
    - ``timeout``: seconds to wait for one batch (``0`` = no limit).
    - ``heartbeat_timeout``: seconds the producer or a worker may show no sign of life (stopped,
      hung) before ``LoaderError``; a slow ``transform`` is no such sign (see ``timeout``).
    - ``worker_init_fn``: called with the worker index at the start of each worker.
    - ``producer_threads``: threads of the producer process that read, verify and decompress
      samples ahead of the batch being written (up to ``ReaderConfig.prefetch_size`` samples and
      64 MiB of decompressed LZ4 payloads); ``None`` = ``min(4, available cores)``. Batches keep
      the global order whatever the count.
    - ``result_bytes``: shared memory for the workers' results, split evenly among them
      (``None`` = 1 GiB; ``0`` pickles every result instead). Buffers in results travel through
      it without copies in the training process; see the module's notes on their lifetime.
    - ``persistent_workers``: keep the producer, the workers, the ring and the result memory
      between epochs (needs ``num_workers > 0``, as torch's); they stop with :meth:`close`,
      ``with``, the loader's deletion or the interpreter's exit. A pass left before its end
      (``break``) is closed at the next ``iter(loader)``, which starts a fresh pipeline.

    Each ``iter(loader)`` is one epoch (the next one, or the one a loaded state resumes).
    :meth:`state_dict` reflects the batches the training loop has received.

    The options are fixed at construction: assigning one of the attributes that hold them
    raises ``ConfigError`` (a ``ValueError``, as torch raises).
    """

    _initialized = False

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int = 1,
        *,
        num_workers: int = 0,
        transform: Callable[[CachedSample], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        drop_last: bool = False,
        prefetch_factor: int = 2,
        slot_size_bytes: int | None = None,
        multiprocessing_context: str | BaseContext | None = None,
        timeout: float = 0.0,
        heartbeat_timeout: float = DEFAULT_HEARTBEAT_TIMEOUT,
        worker_init_fn: Callable[[int], None] | None = None,
        producer_threads: int | None = None,
        result_bytes: int | None = None,
        persistent_workers: bool = False,
    ) -> None:
        # /dev/shm, futexes and prctl: checked first, before anything else could fail oddly.
        if not sys.platform.startswith("linux"):
            raise ConfigError("the shared-memory loader needs Linux")
        from dataset_rt._dataset import require_dataset

        require_dataset(dataset, "dataset_rt.DataLoader")
        batch_size = check_int("DataLoader.batch_size", batch_size, 1, MAX_BATCH_SIZE)
        num_workers = check_int("DataLoader.num_workers", num_workers, 0, MAX_NUM_WORKERS)
        prefetch_factor = check_int(
            "DataLoader.prefetch_factor", prefetch_factor, 1, MAX_PREFETCH_FACTOR
        )
        if slot_size_bytes is not None:
            slot_size_bytes = check_int(
                "DataLoader.slot_size_bytes", slot_size_bytes, 1, MAX_SLOT_SIZE_BYTES
            )
        if result_bytes is not None:
            result_bytes = check_int("DataLoader.result_bytes", result_bytes, 0, max_result_bytes())
        drop_last = _flag("DataLoader.drop_last", drop_last)
        persistent_workers = _flag("DataLoader.persistent_workers", persistent_workers)
        if persistent_workers and num_workers == 0:
            # torch's own check and words.
            raise ConfigError("persistent_workers option needs num_workers > 0")
        timeout = check_seconds("DataLoader.timeout", timeout, zero=True, high=math.inf)
        heartbeat_timeout = check_seconds(
            "DataLoader.heartbeat_timeout",
            heartbeat_timeout,
            zero=False,
            high=MAX_HEARTBEAT_TIMEOUT,
        )
        for name, function in (
            ("transform", transform),
            ("collate_fn", collate_fn),
            ("worker_init_fn", worker_init_fn),
        ):
            if function is not None and not callable(function):
                raise ConfigError(
                    f"invalid DataLoader.{name}: expected a callable or None, got {function!r}"
                )
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.transform = transform
        self.collate_fn = collate_fn
        self.drop_last = drop_last
        self.prefetch_factor = prefetch_factor
        self.slot_size_bytes = slot_size_bytes
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.result_bytes = results.DEFAULT_RESULT_BYTES if result_bytes is None else result_bytes
        self._context = _context(multiprocessing_context)
        self._plan = _native.LoaderPlan(dataset._native, batch_size, drop_last, producer_threads)
        self.producer_threads = self._plan.producer_threads
        self._iterator: LoaderIterator | None = None
        self._owner = os.getpid()
        self._initialized = True

    def __setattr__(self, name: str, value: Any) -> None:
        # The options are read when a pass starts, and the plan holds batch_size and drop_last:
        # a new value would apply to some passes, half of one, or none. Refused, as torch
        # refuses it (and in its words); make a new loader instead.
        if (name in OPTIONS or name == "multiprocessing_context") and self._initialized:
            raise ConfigError(
                f"{name} attribute should not be set after {type(self).__name__} is initialized"
            )
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name in OPTIONS and self._initialized:
            raise ConfigError(
                f"{name} attribute should not be deleted after {type(self).__name__} is initialized"
            )
        super().__delattr__(name)

    def _replace_worker_init_fn(self, worker_init_fn: Callable[[int], None] | None) -> None:
        """For ``dataset_rt.torch.DataLoader``, whose ``worker_init_fn`` frameworks set: applies
        from the next pass that starts workers."""
        object.__setattr__(self, "worker_init_fn", worker_init_fn)

    def _require_owner(self) -> None:
        """A loader is its creator's: in a forked child every use raises ``RuntimeStateError``
        (``close()`` does nothing there)."""
        if os.getpid() != self._owner:
            raise lifecycle.forked_error(self._owner, "DataLoader")

    def __iter__(self) -> LoaderIterator:
        self._require_owner()
        iterator = self._iterator
        if iterator is not None and iterator.persistent and iterator._restart():
            return iterator
        if iterator is not None:
            iterator.replace()
            self._iterator = None
        self._iterator = LoaderIterator(self)
        return self._iterator

    def __len__(self) -> int:
        """Batches per epoch of this rank."""
        self._require_owner()
        return len(self._plan)

    def set_epoch(self, epoch: int) -> None:
        """Makes the next ``iter(loader)`` read ``epoch`` from its start; the state describes
        that start from now on (``ConfigError`` for anything but an int from 0 to 2**64 - 2)."""
        self._require_owner()
        self._plan.set_epoch(check_epoch("DataLoader.set_epoch epoch", epoch))

    def _next_pass_epoch(self) -> int:
        """The epoch the next ``iter(loader)`` reads (for the torch adapter's sampler)."""
        self._require_owner()
        return self._plan.next_pass_epoch()

    def _untouched_pass_epoch(self) -> int | None:
        """The epoch of the pass that ``iter(loader)`` started when it has handed out no batch
        yet, else ``None`` (for the torch adapter's sampler: Lightning calls ``set_epoch``
        between the two)."""
        self._require_owner()
        iterator = self._iterator
        if iterator is None or not iterator.untouched():
            return None
        return int(json.loads(self._plan.state_json())["epoch"])

    def state_dict(self) -> dict[str, Any]:
        """The dataset's state format at the batches the training loop has received: resume it
        with another ``num_workers``, ``batch_size`` or world size."""
        self._require_owner()
        state: dict[str, Any] = json.loads(self._plan.state_json())
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Makes the next ``iter(loader)`` continue at the exact next sample of ``state``."""
        self._require_owner()
        self._plan.load_state_json(state_json(state))

    def close(self) -> None:
        """Stops the current pass's processes (with ``persistent_workers``, the pipeline's)
        and removes its segments. In a forked child it does nothing: they are the parent's."""
        if os.getpid() != self._owner:
            return
        if self._iterator is not None:
            self._iterator.close_by_loader()
            self._iterator = None

    def __enter__(self) -> DataLoader:
        self._require_owner()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
