"""Configuration: frozen, slotted dataclasses with documented defaults.

Values are checked by the Rust core when a config is created, so a bad value fails where it is
written, with a message naming the field.
"""

from __future__ import annotations

import json
import math
import numbers
import operator
import os
from dataclasses import dataclass, field, fields
from typing import Literal

from dataset_rt import _native

__all__ = ["ReaderConfig", "RemoteConfig", "ShardCompression", "WriterConfig"]

# The last epoch there is: the epoch after it would not fit the state's 64 bits.
LAST_EPOCH = 2**64 - 2


def is_bool(value: object) -> bool:
    """Python's ``bool`` or numpy's (``numpy.bool_``, named ``numpy.bool`` in numpy 2)."""
    kind = type(value)
    return isinstance(value, bool) or (
        kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool")
    )


def as_index(value: object) -> int | None:
    """``value`` as an int when it is one (or has ``__index__``, as numpy's integers do); a bool
    (Python's or numpy's) is never a count or an epoch."""
    if is_bool(value):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def plain_values(config: object) -> None:
    """Replaces the numpy scalars a config was given (``numpy.int64(7)``, ``numpy.True_``,
    ``numpy.float32(0.5)``, ``numpy.str_("once")``) by the Python values they stand for, once
    the config is checked: a config's attributes are plain values, which ``json`` and
    ``dataclasses.asdict`` users save."""
    for f in fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if type(value).__module__ != "numpy":
            continue
        if is_bool(value):
            plain: object = bool(value)
        elif (index := as_index(value)) is not None:
            plain = index
        elif isinstance(value, numbers.Real):
            plain = float(value)
        elif isinstance(value, str):  # numpy.str_
            plain = str(value)
        else:
            continue
        object.__setattr__(config, f.name, plain)


def check_int(where: str, value: object, low: int, high: int) -> int:
    """``value`` when it is an int from ``low`` to ``high``; otherwise ``ConfigError`` naming
    ``where`` and the range."""
    number = as_index(value)
    if number is None or not low <= number <= high:
        raise _native.ConfigError(
            f"invalid {where}: expected an int from {low} to {high}, got {value!r}"
        )
    return number


def check_seconds(where: str, value: object, *, zero: bool, high: float) -> float:
    """``value`` as a float when it is a number of seconds (an int or a real number, NumPy's
    included, not a bool, not NaN), positive (``>= 0`` with ``zero``) and at most ``high``;
    otherwise ``ConfigError`` naming ``where``. ``-0.0`` is ``0.0``."""
    seconds = math.nan
    number = as_index(value)
    if number is not None:
        seconds = math.inf if number > 2**1000 else float(number)
    elif isinstance(value, numbers.Real) and not is_bool(value):  # float, numpy.float32 ...
        seconds = float(value)
    if not ((seconds >= 0 if zero else seconds > 0) and seconds <= high):  # NaN fails both
        bound = ">= 0" if zero else "> 0"
        limit = "" if math.isinf(high) else f" and at most {high:g}"
        raise _native.ConfigError(
            f"invalid {where}: expected a number of seconds {bound}{limit}, got {value!r}"
        )
    return seconds + 0.0  # -0.0 -> 0.0


def state_json(state: object) -> str:
    """``state`` as the JSON text the native ``load_state_json`` reads. What is not JSON (a
    numpy number, bytes, a set, a mapping that is not a ``dict``) is no state that
    ``state_dict()`` returns: ``StateError``, as the native checks give for the rest."""
    if isinstance(state, dict):
        for key, value in state.items():
            # The native reader would take it for a float: say what is wrong with it instead.
            if isinstance(value, int) and not is_bool(value) and value >= 2**64:
                raise _native.StateError(
                    f"not a state: {key!r} is {value}, above 2**64 - 1; a state is the dict "
                    "that state_dict() returned (saved and loaded as it was)"
                )
    try:
        return json.dumps(state, allow_nan=False, default=_not_json)
    except (TypeError, ValueError) as error:
        raise _native.StateError(
            f"not a state: {error}; a state is the dict that state_dict() returned, of JSON "
            "types only (saved and loaded as it was)"
        ) from None


def _not_json(value: object) -> object:
    kind = type(value)
    raise TypeError(f"{value!r} ({kind.__module__}.{kind.__qualname__}) is not a JSON type")


def check_epoch(where: str, epoch: object) -> int:
    """An epoch: an int from 0 to 2**64 - 2 (``ConfigError`` otherwise, a bool included)."""
    number = as_index(epoch)
    if number is None or not 0 <= number <= LAST_EPOCH:
        raise _native.ConfigError(
            f"invalid {where}: expected an epoch, an int from 0 to 2**64 - 2, got {epoch!r}"
        )
    return number


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardCompression:
    """How payloads are stored.

    ``algo="none"`` stores payloads raw and requires ``ratio=1.0``. ``algo="lz4"`` compresses each
    record on its own (random access stays direct) and keeps the compressed form only when it is at
    most ``ratio`` of the raw size, so incompressible payloads (JPEG, PNG) stay raw and zero-copy.
    """

    algo: Literal["none", "lz4"] = "none"
    ratio: float = 1.0

    def __post_init__(self) -> None:
        # A bool or a string is never a ratio (the native check reads True as 1.0).
        if isinstance(self.ratio, (str, bytes)) or is_bool(self.ratio):
            raise _native.ConfigError(
                f"invalid ShardCompression.ratio: expected a float, got {self.ratio!r}"
            )
        if not isinstance(self.algo, str):
            raise _native.ConfigError(
                f'invalid ShardCompression.algo: expected "none" or "lz4", got {self.algo!r}'
            )
        _native.check_compression(self.algo, self.ratio)
        plain_values(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderConfig:
    """How a dataset is read.

    - ``seed``: decides the shuffled order together with the epoch (docs/determinism.md).
    - ``prefetch_size``: samples read ahead on the runtime's workers (memory stays bounded by it;
      LZ4 records read ahead also stay within 64 MiB decompressed, or one record if larger).
    - ``shuffle``: ``False`` reads in storage order, caches in source order.
    - ``validate_cache``: also hash every file when loading: the index, ``metadata.arrow`` (and
      decode it) and every shard. Without it a load checks the structure only and reads nothing
      per sample; ``metadata.arrow`` is checked at the first use of the metadata table, each
      index entry against its record when that record is read, and record checksums follow
      ``verify``.
    - ``verify``: when a record's checksum is checked as it is read. ``"always"``: on every read.
      ``"once"`` (the default): the first time the dataset reads the record (one bit per sample
      remembers it, shared by the dataset's readers and by its loaders' producer processes, across
      loaders and epochs).
      ``"never"``: not at read time. Under every policy the record's header is checked against the
      index on every read, so a damaged record cannot make a read or LZ4 decoding go out of bounds;
      under ``"always"`` and ``"once"`` a damaged record raises ``CorruptRecordError`` naming the
      shard file and the sample. What each policy does not catch: docs/security.md.
    - ``rank`` / ``world_size``: this reader's share; ``None`` takes them from an initialised
      ``torch.distributed``, else the ``RANK`` / ``WORLD_SIZE`` environment, else 0 of 1.
    - ``drop_last``: ranks get equal shares by padding (repeating samples, the default) or, when
      ``True``, by dropping the tail of the epoch.
    - ``samples_per_epoch``: epoch length before the rank split; ``None`` = number of samples.
      At most ``2**40``. The epoch order costs 8 bytes per sample: one larger than the machine's
      memory raises ``MemoryError`` when a pass starts, and the dataset stays usable.
    - ``io_depth``: records whose reads the read planner keeps in flight ahead of the reading
      threads while reads miss the page cache (1 to 65,536; default 64). It adds no thread and
      changes nothing about the order (docs/runtime-model.md).
    - ``read_ahead_bytes``: bound on the stored bytes of those records (1 to 2**40; default
      64 MiB); one record is always let through, however large.
    """

    seed: int = 0
    prefetch_size: int = 64
    shuffle: bool = True
    validate_cache: bool = False
    verify: Literal["always", "once", "never"] = "once"
    rank: int | None = None
    world_size: int | None = None
    drop_last: bool = False
    samples_per_epoch: int | None = None
    io_depth: int = 64
    read_ahead_bytes: int = 64 * 1024 * 1024

    def __post_init__(self) -> None:
        _native.check_reader_config(self)
        plain_values(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterConfig:
    """How caches are written.

    - ``prefetch_size``: samples between the source and the disk (memory stays bounded by it).
    - ``shard_compression``: see :class:`ShardCompression`.
    - ``show_progress``: a live line on stderr with committed samples/s and MB/s, and for several
      sources which one of how many and the ETA.
    - ``validate_cache``: re-read and verify everything written before publishing it.
    - ``shard_size_bytes``: target size of one shard file.
    - ``processes``: how many processes write the parts of a :class:`CacheSet` at once (1 to
      1024). With 1 the parts are written one after the other in this process; with more, in
      worker processes started with ``spawn`` (the parts must be picklable). The content of the
      set does not depend on it.
    """

    prefetch_size: int = 64
    shard_compression: ShardCompression = field(default_factory=ShardCompression)
    show_progress: bool = True
    validate_cache: bool = False
    shard_size_bytes: int = 256 * 1024 * 1024
    processes: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.shard_compression, ShardCompression):
            raise _native.ConfigError(
                "invalid WriterConfig.shard_compression: expected ShardCompression, got "
                f"{type(self.shard_compression).__name__}"
            )
        _native.check_writer_config(self)
        plain_values(self)


def is_url(text: str) -> bool:
    """Whether ``text`` names a location on object storage (``s3://...``, ``file://...``) rather
    than a local path: what ``open_caches`` and the command line take a URL by."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.isidentifier()


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteConfig:
    """How caches on object storage (``s3://`` and ``file://`` URLs) are reached.

    - ``local_dir``: the node's local cache of downloaded bytes; ``None``:
      ``$DATASET_RT_REMOTE_DIR``, else ``$XDG_CACHE_HOME/dataset-rt/remote``, else
      ``~/.cache/dataset-rt/remote``.
    - ``max_local_bytes``: that cache's budget in bytes, at least 64 MiB; ``None``: 64 GiB.
    - ``max_requests``: requests in flight at most, per process (1 to 4096).
    - ``endpoint``: the store's ``http(s)://`` address (MinIO, R2, Ceph, a local server);
      ``None``: ``AWS_ENDPOINT_URL``, else AWS itself.
    - ``region``: ``None``: ``AWS_REGION``, else ``us-east-1``.
    - ``allow_http``: allow a plain ``http://`` endpoint; ``None``: ``AWS_ALLOW_HTTP``, else no.

    Credentials are never part of a config: they come from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``), so a config's
    ``repr`` holds none. ``local_dir`` and ``max_local_bytes`` matter once datasets are read
    from URLs; publishing (``dataset-rt push``, ``pull``, ``ls``) uses the others.
    """

    local_dir: str | os.PathLike[str] | None = None
    max_local_bytes: int | None = None
    max_requests: int = 64
    endpoint: str | None = None
    region: str | None = None
    allow_http: bool | None = None

    def __post_init__(self) -> None:
        _native.check_remote_config(self)
        plain_values(self)
