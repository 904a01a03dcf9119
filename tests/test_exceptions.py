"""The public exception tree: `dataset_rt.exceptions`, re-exported from `dataset_rt`, with
`ConfigError` also a `ValueError` and the loader's internal signal kept out of both `__all__`."""

from __future__ import annotations

import pytest

import dataset_rt
import dataset_rt.exceptions
from dataset_rt import ReaderConfig, _native

PUBLIC = {
    "DatasetRTError",
    "ConfigError",
    "CacheMalformedError",
    "CorruptRecordError",
    "InvalidSampleError",
    "SamplesMetadataError",
    "StateError",
    "RuntimeStateError",
    "LoaderError",
    "WorkerError",
}
INTERNAL = {"RingClosed"}


def test_exceptions_module_exposes_the_whole_public_tree() -> None:
    assert set(dataset_rt.exceptions.__all__) == PUBLIC
    for name in PUBLIC:
        cls = getattr(dataset_rt.exceptions, name)
        assert issubclass(cls, dataset_rt.exceptions.DatasetRTError)
        # Defined once, in the native module: the same class under every name.
        assert cls is getattr(_native, name) is getattr(dataset_rt, name)
    assert set(dataset_rt.__all__) >= PUBLIC


def test_every_native_exception_is_public_or_known_internal() -> None:
    native = {
        name
        for name, value in vars(_native).items()
        if isinstance(value, type) and issubclass(value, _native.DatasetRTError)
    }
    assert native == PUBLIC | INTERNAL


def test_internal_signals_are_not_public() -> None:
    for name in INTERNAL:
        assert name not in dataset_rt.__all__
        assert name not in dataset_rt.exceptions.__all__
        assert not hasattr(dataset_rt, name)


def test_config_error_is_a_value_error() -> None:
    assert issubclass(dataset_rt.ConfigError, ValueError)
    assert issubclass(dataset_rt.ConfigError, dataset_rt.DatasetRTError)
    assert dataset_rt.ConfigError.__module__ == "dataset_rt._native"
    assert dataset_rt.ConfigError.__doc__


@pytest.mark.parametrize(
    "raise_it",
    [
        # Raised by Rust code of the bindings ...
        lambda: _native.epoch_order(1, 0, 0, epoch_len=5),
        # ... by the core's configuration check ...
        lambda: ReaderConfig(world_size=0),
        # ... and by the Python facade.
        lambda: dataset_rt._loader.plan._context("forkserver"),
    ],
    ids=["bindings", "core", "facade"],
)
def test_config_errors_are_caught_as_value_errors(raise_it: object) -> None:
    with pytest.raises(ValueError) as caught:
        raise_it()  # type: ignore[operator]
    assert type(caught.value) is dataset_rt.ConfigError
    assert str(caught.value)
