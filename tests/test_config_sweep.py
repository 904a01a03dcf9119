"""Every public constructor and setter, swept with extreme values: each one either works or
raises ``ConfigError`` / ``TypeError`` / ``ValueError`` (``StateError`` for a state), never a
Rust panic (``PanicException`` is a ``BaseException``), an ``OverflowError``, a
``MemoryError`` or a hang. Where a loader is made, one batch is also taken, so that a value
the constructor let through cannot fail later in another way."""

from __future__ import annotations

import functools
import math
import os
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from loader_helpers import load, no_leaks  # noqa: F401

import dataset_rt
from dataset_rt import (
    ConfigError,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    StateError,
    WriterConfig,
)
from dataset_rt._loader import DataLoader
from dataset_rt.testing import make_source

N = 12
LAST_EPOCH = 2**64 - 2
TIMEOUT = pytest.mark.timeout(120)

# Huge and negative ints, bools, floats at their edges, wrong types.
EXTREMES: list[Any] = [
    2**63,
    2**64,
    2**70,
    2**64 - 1,
    -1,
    0,
    1,
    True,
    False,
    math.nan,
    math.inf,
    -math.inf,
    -0.0,
    1.5,
    1e300,
    "3",
    None,
]

REFUSALS: tuple[type[BaseException], ...] = (ConfigError, TypeError, ValueError)


def attempt(fn: Callable[[], Any], refusals: tuple[type[BaseException], ...] = REFUSALS) -> Any:
    """``fn()``'s value, or the refusal it raised; anything else (a panic, an overflow, memory)
    fails the test with what was raised."""
    try:
        return fn()
    except refusals as error:
        assert not isinstance(error, OverflowError | MemoryError), repr(error)
        assert str(error), f"{type(error).__name__} without a message"
        return error
    except BaseException as error:
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            raise
        pytest.fail(f"{type(error).__module__}.{type(error).__name__}: {error}")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sweep-cache")
    load(path, N)
    return path


@pytest.fixture
def dataset(base: Path) -> dataset_rt.Dataset:
    return load(base, N)


def ids(sample: Any) -> int:
    return int(sample.metadata["i"])


def first_batch(loader: Any) -> Any:
    with loader:
        return next(iter(loader))


# --- dataset_rt.DataLoader ---------------------------------------------------------------------

# Arguments whose values matter with workers run with one (fork: quick to start).
WITH_WORKER = {"result_bytes", "prefetch_factor", "worker_init_fn", "persistent_workers"}
LOADER_ARGS = [
    "batch_size",
    "num_workers",
    "prefetch_factor",
    "slot_size_bytes",
    "timeout",
    "heartbeat_timeout",
    "producer_threads",
    "result_bytes",
    "drop_last",
    "persistent_workers",
    "multiprocessing_context",
    "transform",
    "collate_fn",
    "worker_init_fn",
]


def loader_kwargs(name: str, value: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"batch_size": 4, name: value}
    if name in WITH_WORKER and name != "num_workers":
        kwargs.update(num_workers=1, multiprocessing_context="fork")
    if name == "num_workers":
        kwargs["multiprocessing_context"] = "fork"
    return kwargs


def sweep_loader(make: Callable[..., Any], dataset: dataset_rt.Dataset, name: str) -> None:
    for value in EXTREMES:
        kwargs = loader_kwargs(name, value)
        made = attempt(lambda kwargs=kwargs: make(dataset, **kwargs))
        if isinstance(made, BaseException):
            if isinstance(made, ConfigError):
                assert name in str(made) or "persistent_workers" in str(made), (name, made)
            continue
        batch = attempt(lambda made=made: first_batch(made))
        assert not isinstance(batch, BaseException), (name, value, batch)


@TIMEOUT
@pytest.mark.parametrize("name", LOADER_ARGS)
def test_loader_arguments_work_or_are_refused(dataset, name: str, no_leaks) -> None:  # noqa: F811
    sweep_loader(DataLoader, dataset, name)


@TIMEOUT
@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("heartbeat_timeout", math.inf),
        ("heartbeat_timeout", 1e300),
        ("heartbeat_timeout", 1e19),
        ("heartbeat_timeout", 7 * 24 * 3600 + 1),
        ("timeout", math.nan),
        ("timeout", "5"),
        ("batch_size", 2**64),
        ("batch_size", 2**40 + 1),
        ("num_workers", 2**64),
        ("num_workers", True),
        ("slot_size_bytes", 2**64),
        ("slot_size_bytes", 2**40 + 1),
        ("prefetch_factor", 2**40),
        ("result_bytes", 2**70),
        ("result_bytes", 2**62),
        ("drop_last", 1),
        ("multiprocessing_context", 3),
        ("transform", "decode"),
    ],
)
def test_loader_refuses_at_construction_naming_the_argument(dataset, name: str, value) -> None:
    with pytest.raises(ConfigError, match=rf"DataLoader\.{name}"):
        DataLoader(dataset, **{"batch_size": 4, name: value})


@pytest.mark.parametrize("field", ["io_depth", "read_ahead_bytes", "prefetch_size", "seed"])
@pytest.mark.parametrize("value", [2**64, 2**70])
def test_an_int_past_64_bits_is_called_too_large(field: str, value: int) -> None:
    # Not "expected an int >= 1", which the value is.
    expected = re.escape(f"invalid ReaderConfig.{field}: {value} is too large")
    with pytest.raises(ConfigError, match=expected):
        ReaderConfig(**{field: value})


def test_configs_keep_plain_values_for_numpy_scalars() -> None:
    import dataclasses
    import json

    import numpy as np

    configs = [
        ReaderConfig(
            seed=np.int64(5), shuffle=np.True_, prefetch_size=np.uint16(8), verify=np.str_("once")
        ),
        WriterConfig(prefetch_size=np.int32(4), show_progress=np.False_),
        ShardCompression(algo=np.str_("lz4"), ratio=np.float32(0.5)),
    ]
    for config in configs:
        values = dataclasses.asdict(config)
        json.dumps(values)  # numpy scalars would not serialize
        for name, value in values.items():
            assert type(value).__module__ == "builtins", (name, type(value))
    assert (configs[0].seed, configs[0].shuffle, configs[0].prefetch_size) == (5, True, 8)
    assert configs[2].ratio == 0.5
    assert "np.str_" not in repr(configs[0]) and "np.str_" not in repr(configs[2])


def test_result_bytes_names_its_limit(dataset) -> None:
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with pytest.raises(ConfigError, match=rf"result_bytes: expected an int from 0 to {physical}"):
        DataLoader(dataset, 4, result_bytes=physical + 1)


@TIMEOUT
@pytest.mark.parametrize("value", [math.inf, 2**70, -0.0, 0])
def test_a_timeout_of_infinity_or_zero_means_no_limit(dataset, value) -> None:
    with DataLoader(dataset, 4, timeout=value) as loader:
        assert loader.timeout == float(value) and math.copysign(1, loader.timeout) == 1
        assert sum(len(b) for b in loader) == N


@TIMEOUT
def test_the_largest_heartbeat_timeout_works(dataset) -> None:
    with DataLoader(dataset, 4, heartbeat_timeout=7 * 24 * 3600) as loader:
        assert sum(len(b) for b in loader) == N


def test_numpy_numbers_are_seconds(dataset) -> None:
    np = pytest.importorskip("numpy")
    for value in [np.float32(1.5), np.float16(1.5), np.float64(1.5), np.int64(2), np.uint8(3)]:
        with DataLoader(dataset, 4, timeout=value, heartbeat_timeout=value) as loader:
            assert type(loader.timeout) is float and loader.timeout == float(value)
            assert type(loader.heartbeat_timeout) is float
    for value in [np.bool_(True), np.float32("nan"), np.float32(-1)]:
        with pytest.raises(ConfigError, match=r"invalid DataLoader\.timeout"):
            DataLoader(dataset, 4, timeout=value)


def test_numpy_ints_are_ints(dataset) -> None:
    np = pytest.importorskip("numpy")
    loader = DataLoader(dataset, np.int64(4), num_workers=np.int32(0), prefetch_factor=np.uint8(2))
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor) == (4, 0, 2)
    assert type(loader.batch_size) is int
    with pytest.raises(ConfigError, match="drop_last"):
        DataLoader(dataset, 4, drop_last=np.int64(1))
    DataLoader(dataset, 4, drop_last=np.bool_(True))
    with pytest.raises(ConfigError, match="batch_size"):
        DataLoader(dataset, np.bool_(True))


# --- set_epoch and load_state_dict -------------------------------------------------------------

EPOCHS_REFUSED: list[Any] = [-1, 2**64 - 1, 2**64, 2**70, True, False, 1.0, math.nan, "3", None]


def check_set_epoch(target: Any, state: Callable[[], dict[str, Any]]) -> None:
    for epoch in [0, 2**63 - 1, 2**63, LAST_EPOCH]:
        target.set_epoch(epoch)
        assert (state()["epoch"], state()["position"]) == (epoch, 0)
    target.set_epoch(5)
    for epoch in EPOCHS_REFUSED:
        with pytest.raises(ConfigError, match="epoch"):
            target.set_epoch(epoch)
        assert state()["epoch"] == 5


def test_dataset_set_epoch_takes_every_epoch(dataset) -> None:
    check_set_epoch(dataset, dataset.state_dict)
    dataset.set_epoch(2**63)
    assert sorted(ids(s) for s in dataset) == list(range(N))
    assert dataset.state_dict()["epoch"] == 2**63 + 1


@TIMEOUT
def test_loader_set_epoch_takes_every_epoch(dataset, no_leaks) -> None:  # noqa: F811
    with DataLoader(dataset, 4) as loader:
        check_set_epoch(loader, loader.state_dict)
        loader.set_epoch(2**63)
        assert sorted(ids(s) for b in loader for s in b) == list(range(N))
        assert loader.state_dict()["epoch"] == 2**63 + 1


def test_iter_batches_sizes(dataset) -> None:
    for value in EXTREMES:
        got = attempt(lambda value=value: next(dataset.iter_batches(value)))
        if type(value) is int and value == 1:
            assert len(got) == 1
        else:
            assert isinstance(got, BaseException), value
    with pytest.raises(ConfigError, match="batch_size"):
        dataset.iter_batches(2**40 + 1)
    assert len(next(dataset.iter_batches(2**40))) == N
    with pytest.raises(TypeError, match="drop_last"):
        dataset.iter_batches(2, drop_last=1)


@TIMEOUT
@pytest.mark.parametrize("owner", ["dataset", "loader"])
def test_absurd_states_are_refused(dataset, owner: str) -> None:
    target = dataset if owner == "dataset" else DataLoader(dataset, 4)
    good = target.state_dict()
    for state in [
        {**good, "epoch": 2**64 - 1},
        {**good, "epoch": 2**64},
        {**good, "epoch": 2**70},
        {**good, "epoch": -1},
        {**good, "epoch": True},
        {**good, "epoch": math.nan},
        {**good, "epoch": math.inf},
        {**good, "position": 2**64},
        {**good, "position": -1},
        {**good, "position": 1.5},
        {**good, "seed": 2**64},
        {**good, "world_size": 0},
        {**good, "world_size": 2**70},
        {**good, "rank": 2**63},
        list(good.values()),
        None,
        "state",
        2**70,
    ]:
        got = attempt(lambda state=state: target.load_state_dict(state), (*REFUSALS, StateError))
        assert isinstance(got, BaseException), state
        assert target.state_dict() == good
    target.load_state_dict({**good, "epoch": LAST_EPOCH})
    assert target.state_dict()["epoch"] == LAST_EPOCH


@TIMEOUT
@pytest.mark.parametrize("owner", ["dataset", "loader"])
def test_states_that_are_not_json_are_state_errors(dataset, owner: str) -> None:
    """state_dict() returns plain JSON types: anything else is a StateError, as every other
    refused state is, so that `except StateError` catches it."""
    np = pytest.importorskip("numpy")
    target = dataset if owner == "dataset" else DataLoader(dataset, 4)
    good = target.state_dict()
    for state in [
        {**good, "position": np.int64(3)},
        {**good, "fingerprint": good["fingerprint"].encode()},
        {**good, "seed": {1, 2}},
        {**good, "epoch": math.nan},
        types.MappingProxyType(good),
    ]:
        with pytest.raises(StateError, match="not a state"):
            target.load_state_dict(state)
        assert target.state_dict() == good
    # Each says what is wrong, in the user's terms.
    for state, says in [
        ({**good, "position": 2**64}, "'position' is 18446744073709551616, above 2**64 - 1"),
        ({**good, "shuffle": np.bool_(True)}, "(numpy.bool"),
    ]:
        with pytest.raises(StateError, match=re.escape(says)):
            target.load_state_dict(state)


# --- runtime and configs -----------------------------------------------------------------------


def test_runtime_workers() -> None:
    for value in EXTREMES:
        made = attempt(lambda value=value: DatasetRuntime(num_workers=value))
        if isinstance(made, DatasetRuntime):
            assert value == 1 and value is not True
            made.close()
        else:
            assert isinstance(made, ConfigError) and "num_workers" in str(made), (value, made)
    with pytest.raises(ConfigError, match="num_workers"):
        DatasetRuntime(num_workers=1025)


READER_FIELDS = [
    "seed",
    "prefetch_size",
    "shuffle",
    "validate_cache",
    "verify",
    "drop_last",
    "samples_per_epoch",
    "rank",
    "world_size",
    "io_depth",
    "read_ahead_bytes",
]
WRITER_FIELDS = ["prefetch_size", "show_progress", "validate_cache", "shard_size_bytes"]


def reader_kwargs(name: str, value: Any) -> dict[str, Any]:
    if name == "rank":
        return {"rank": value, "world_size": 2}
    if name == "world_size":
        return {"rank": 0, "world_size": value}
    return {name: value}


@TIMEOUT
@pytest.mark.parametrize("name", READER_FIELDS)
def test_reader_config_fields(tmp_path: Path, name: str) -> None:
    with DatasetRuntime(num_workers=2) as runtime:
        for value in [*EXTREMES, "once", "Once"]:
            config = attempt(lambda value=value: ReaderConfig(**reader_kwargs(name, value)))
            if isinstance(config, BaseException):
                assert isinstance(config, ConfigError), (name, value, config)
                continue
            # Accepted: a dataset reads with it.
            result = attempt(
                lambda config=config: runtime.from_cache_sources(
                    make_source("c", [(b"x%d" % i, {"i": i}) for i in range(N)]),
                    tmp_path,
                    reader_config=config,
                    writer_config=WriterConfig(show_progress=False),
                )
            )
            assert not isinstance(result, BaseException), (name, value, result)
            assert result.dataset is not None, result
            got = attempt(lambda result=result: [ids(s) for s in result.dataset])
            assert isinstance(got, list), (name, value, got)


@TIMEOUT
@pytest.mark.parametrize("name", WRITER_FIELDS)
def test_writer_config_fields(tmp_path: Path, name: str) -> None:
    with DatasetRuntime(num_workers=2) as runtime:
        for k, value in enumerate(EXTREMES):
            config = attempt(lambda value=value: WriterConfig(**{name: value}))
            if isinstance(config, BaseException):
                assert isinstance(config, ConfigError), (name, value, config)
                continue
            if name == "show_progress":
                config = WriterConfig(show_progress=False, validate_cache=config.validate_cache)
            result = attempt(
                lambda config=config, k=k: runtime.from_cache_sources(
                    make_source(f"w{k}", [(b"x%d" % i, {"i": i}) for i in range(N)]),
                    tmp_path,
                    writer_config=config,
                )
            )
            assert not isinstance(result, BaseException), (name, value, result)
            assert result.dataset is not None, (name, value, result.results)
            assert len(list(result.dataset)) == N


def test_shard_compression_fields() -> None:
    for value in [*EXTREMES, 0.5, 1e-300, 5e-324]:
        for algo in ("none", "lz4"):
            got = attempt(lambda value=value, algo=algo: ShardCompression(algo=algo, ratio=value))
            if isinstance(got, BaseException):
                assert isinstance(got, ConfigError), (algo, value, got)
            else:
                assert 0 < got.ratio <= 1 and not isinstance(got.ratio, str)
    for algo in EXTREMES:
        got = attempt(lambda algo=algo: ShardCompression(algo=algo))
        assert isinstance(got, ConfigError), (algo, got)
    with pytest.raises(ConfigError, match="shard_compression"):
        WriterConfig(shard_compression="lz4")  # type: ignore[arg-type]


WRONG_CONFIGS: list[tuple[str, Any]] = [
    ("reader_config", {"seed": 1}),
    ("reader_config", WriterConfig()),
    ("writer_config", ReaderConfig()),
    ("writer_config", {"shard_size_bytes": 1 << 20}),
    ("remote", ReaderConfig()),
]


@pytest.mark.parametrize(
    ("call", "argument", "value"),
    [("from_cache_sources", a, v) for a, v in WRONG_CONFIGS]
    # open_caches takes no writer_config
    + [("open_caches", a, v) for a, v in WRONG_CONFIGS if a != "writer_config"],
)
def test_a_config_of_another_type_is_refused_naming_the_argument(
    tmp_path: Path, call: str, argument: str, value: Any
) -> None:
    with DatasetRuntime(num_workers=1) as runtime:
        first = make_source("a", [b"x"] * 4) if call == "from_cache_sources" else "a"
        base = tmp_path.as_uri() if argument == "remote" else tmp_path
        method = getattr(runtime, call)
        with pytest.raises(ConfigError, match=f"invalid {argument}: expected a "):
            method(first, base, **{argument: value})
    assert not any(tmp_path.iterdir())


# --- reassigning a loader's options ------------------------------------------------------------

OPTIONS = [
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
]


@TIMEOUT
def test_loader_options_cannot_be_reassigned(dataset) -> None:
    with DataLoader(dataset, 4) as loader:
        for name in OPTIONS:
            before = getattr(loader, name)
            with pytest.raises(
                ConfigError,
                match=f"^{name} attribute should not be set after DataLoader is initialized$",
            ):
                setattr(loader, name, before)
            assert getattr(loader, name) is before
            with pytest.raises(
                ConfigError,
                match=f"^{name} attribute should not be deleted after DataLoader is initialized$",
            ):
                delattr(loader, name)
            assert getattr(loader, name) is before
        # An argument the loader keeps no attribute for is refused too, not silently ignored.
        with pytest.raises(
            ConfigError,
            match=r"^multiprocessing_context attribute should not be set after DataLoader is "
            r"initialized$",
        ):
            loader.multiprocessing_context = "spawn"
        loader.custom = 1  # other attributes are the caller's
        del loader.custom
        assert [len(b) for b in loader] == [4, 4, 4]


# --- dataset_rt.torch.DataLoader ---------------------------------------------------------------


def torch_loader() -> Any:
    pytest.importorskip("torch")
    import dataset_rt.torch

    return dataset_rt.torch.DataLoader


@TIMEOUT
@pytest.mark.torch
@pytest.mark.parametrize("name", LOADER_ARGS)
def test_torch_loader_arguments_work_or_are_refused(dataset, name: str, no_leaks) -> None:  # noqa: F811
    sweep_loader(torch_loader(), dataset, name)


@TIMEOUT
@pytest.mark.torch
def test_torch_loader_set_epoch_takes_every_epoch(dataset) -> None:
    with torch_loader()(dataset, 4) as loader:
        check_set_epoch(loader, loader.state_dict)
        check_set_epoch(loader.sampler, loader.state_dict)
        loader.set_epoch(2**63)
        assert sum(len(b["data"]) for b in loader) == N


@pytest.mark.torch
def test_torch_loader_normalises_numpy_ints(dataset) -> None:
    np = pytest.importorskip("numpy")
    loader = torch_loader()(dataset, np.int64(4), num_workers=np.int64(0))
    assert (type(loader.batch_size), loader.batch_size, loader.num_workers) == (int, 4, 0)
    assert len(loader) == 3


def _touch(path: Path, index: int) -> None:
    Path(f"{path}-{index}").touch()


@TIMEOUT
@pytest.mark.torch
def test_torch_loader_options_cannot_be_reassigned(dataset, tmp_path: Path) -> None:
    loader = torch_loader()(dataset, 4, num_workers=1, multiprocessing_context="fork")
    with loader:
        for name in [o for o in OPTIONS if o != "worker_init_fn"] + [
            "sampler",
            "batch_sampler",
            "multiprocessing_context",
        ]:
            before = getattr(loader, name)
            with pytest.raises(
                ConfigError,
                match=f"^{name} attribute should not be set after DataLoader is initialized$",
            ):
                setattr(loader, name, before)
            assert getattr(loader, name) is before
            with pytest.raises(
                ConfigError,
                match=f"^{name} attribute should not be deleted after DataLoader is initialized$",
            ):
                delattr(loader, name)
            assert getattr(loader, name) is before
        # Lightning sets worker_init_fn (seed_everything(workers=True)): it applies.
        loader.worker_init_fn = functools.partial(_touch, tmp_path / "init")
        assert sum(len(b["data"]) for b in loader) == N
        assert (tmp_path / "init-0").exists()
        with pytest.raises(ConfigError, match="worker_init_fn"):
            loader.worker_init_fn = "seed"
        loader.pin_memory = False  # what torch lets one change and the loader honours
