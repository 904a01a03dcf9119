"""Ordinary transform results through worker result memory: each arrives with workers as it
does with ``num_workers=0``. Only a result's own buffers (arrays, tensors, bytes-like leaves of
its lists, tuples and dict values) travel through result memory; what lies in another object's
pickled state (a numpy scalar's bytes, an object array's items, a date's bytes) is pickled as
pickle made it, since its reconstructor needs exactly that."""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import enum
import fractions
import uuid
from collections import namedtuple
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any, NamedTuple

import numpy as np
import pytest
from loader_helpers import in_result_memory, load, no_leaks  # noqa: F401

from dataset_rt._loader import DataLoader

N = 6
BATCH = 3


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("result-types")
    load(path, N)
    return path


@pytest.fixture
def dataset(base):
    return load(base, N)


# ---- module-level types: picklable under spawn ----


class Color(enum.Enum):
    RED = 1
    GREEN = 2


class Level(enum.IntEnum):
    LOW = 0
    HIGH = 1


@dataclasses.dataclass
class Labelled:
    label: Any
    name: str
    array: Any
    raw: bytes


@dataclasses.dataclass(frozen=True)
class Frozen:
    when: datetime.date
    score: Any


Pair = namedtuple("Pair", ["array", "label"])


class Record(NamedTuple):
    raw: bytes
    label: Any
    values: Any


class Guarded(Pair):
    """A named tuple whose constructor needs ``bytes``: its fields are pickled as they are."""

    __slots__ = ()

    def __new__(cls, array: Any, label: Any) -> Guarded:
        if not isinstance(label, bytes):
            raise TypeError(f"label must be bytes, not {type(label).__name__}")
        return super().__new__(cls, array, label)


def _image(i: int) -> Any:
    from PIL import Image

    image = Image.new("RGB", (5, 3), color=(i % 256, 7, 200))
    image.putpixel((1, 1), (1, 2, 3))
    return image


def _objects(i: int) -> Any:
    array = np.empty((2, 2), object)
    array[0, 0], array[0, 1], array[1, 0], array[1, 1] = i, "a", (1, 2), {"k": b"v"}
    return array


def _nested(i: int) -> Any:
    return {
        "a": ([np.int64(i), np.arange(4, dtype=np.int32) + i, b"xy" * (i + 1)], np.float32(i)),
        "b": {"c": [np.bool_(i % 2), bytearray(b"q" * (i + 2)), (np.uint8(i), b"")]},
        b"key": datetime.date(2024, 1, 1 + i),
        7: Labelled(np.int16(i), f"s{i}", np.full(3, i, np.float64), b"r" * i),
    }


# Each entry: a result built from the sample's index.
def _numpy_scalar(kind: type) -> Callable[[int], Any]:
    return lambda i: kind(i % 2 if kind is np.bool_ else i + 1)


NUMPY_SCALARS = (
    np.bool_,
    np.int8,
    np.int16,
    np.int32,
    np.int64,
    np.uint8,
    np.uint16,
    np.uint32,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
    np.longdouble,
    np.complex64,
    np.complex128,
)

# Each entry: a result built from the sample's index.
CATALOGUE: dict[str, Callable[[int], Any]] = {
    **{f"np.{t.__name__}": _numpy_scalar(t) for t in NUMPY_SCALARS},
    "np.datetime64": lambda i: np.datetime64("2024-01-01") + np.timedelta64(i, "D"),
    "np.datetime64[ns]": lambda i: np.datetime64(1_700_000_000_000_000_000 + i, "ns"),
    "np.timedelta64": lambda i: np.timedelta64(i * 3, "s"),
    "np.str_": lambda i: np.str_(f"label-{i}é"),
    "np.bytes_": lambda i: np.bytes_(b"raw-%d" % i),
    "np.void": lambda i: np.array([(i, 2.5)], dtype=[("a", "<i4"), ("b", "<f8")])[0],
    "object array": lambda i: np.array([i, "x", None, b"raw", np.int64(i)], dtype=object),
    "object array 2-D": lambda i: _objects(i),
    "structured array": lambda i: np.array(
        [(i, 1.5, b"ab"), (-i, 2.5, b"c")], dtype=[("a", ">i4"), ("b", "<f2"), ("c", "S2")]
    ),
    "structured array, object field": lambda i: np.array(
        [(i, "x"), (2, None)], dtype=[("a", "<i8"), ("o", "O")]
    ),
    "masked array": lambda i: np.ma.masked_array([1, 2, i], mask=[0, 1, 0]),
    "masked array 2-D": lambda i: np.ma.masked_array(
        np.arange(6, dtype=np.float32).reshape(2, 3) + i,
        mask=[[0, 1, 0], [1, 0, 0]],
        fill_value=-1.0,
    ),
    "masked array, no mask": lambda i: np.ma.masked_array(np.arange(3) + i),
    "record array": lambda i: np.rec.array([(i, 1.5)], dtype=[("a", "<i4"), ("b", "<f8")]),
    "big-endian array": lambda i: np.arange(5, dtype=">u8") + i,
    "datetime64 array": lambda i: np.array(["2024-01-01", f"2025-06-0{i + 1}"], "M8[D]"),
    "0-d array": lambda i: np.array(i, dtype=np.int64),
    "array and label": lambda i: (np.arange(8, dtype=np.uint8) + i, np.int64(i)),
    "date": lambda i: datetime.date(2024, 1, 1 + i),
    "datetime": lambda i: datetime.datetime(2024, 1, 1 + i, 12, 30, 5, 123),
    "datetime, tz": lambda i: datetime.datetime(
        2024, 3, 1 + i, tzinfo=datetime.timezone(datetime.timedelta(hours=2))
    ),
    "time": lambda i: datetime.time(1, 2, i),
    "timedelta": lambda i: datetime.timedelta(days=i, seconds=5),
    "Decimal": lambda i: decimal.Decimal("1.25") + i,
    "Fraction": lambda i: fractions.Fraction(i, 3),
    "enum": lambda i: (Color.RED, Color.GREEN)[i % 2],
    "int enum": lambda i: Level(i % 2),
    "dataclass": lambda i: Labelled(np.int64(i), f"s{i}", np.arange(3) + i, b"raw%d" % i),
    "frozen dataclass": lambda i: Frozen(datetime.date(2023, 5, 1 + i), np.float32(i / 2)),
    "namedtuple": lambda i: Pair(np.arange(4) + i, np.int64(i)),
    "typed NamedTuple": lambda i: Record(b"r%d" % i, np.uint16(i), [np.float64(i), b"x"]),
    "namedtuple whose __new__ needs bytes": lambda i: Guarded(np.arange(2) + i, b"l%d" % i),
    "PIL image": _image,
    "nested containers": _nested,
    "bytes": lambda i: b"payload-%d" % i,
    "empty bytes": lambda i: b"",
    "bytearray": lambda i: bytearray(b"ba" * (i + 1)),
    "bytes as a leaf and in a scalar": lambda i: (b"\x01", np.bool_(True), [b"\x01"]),
    "bytes keys and set": lambda i: ({b"k%d" % i: b"v", b"": i}, {b"a", b"b%d" % i}),
    "frozenset": lambda i: frozenset({np.int64(i), b"x"}),
    "memoryview": lambda i: memoryview(b"abcdef")[i % 3 :],
    "memoryview 2-D": lambda i: memoryview(np.arange(6, dtype=np.int16).reshape(2, 3) + i),
    "memoryview cast": lambda i: memoryview(bytes(range(i, i + 24))).cast("i", [2, 3]),
    "memoryview 0-d": lambda i: memoryview(bytes(8)).cast("q", []),
    "memoryview signed": lambda i: memoryview(bytes(range(4))).cast("b"),
    "memoryview big-endian": lambda i: memoryview(np.arange(4, dtype=">i4").reshape(2, 2) + i),
    "memoryview complex": lambda i: memoryview(np.full((2,), 1 + 1j * i, np.complex64)),
    "memoryview structured": lambda i: memoryview(
        np.array([(i, 2.0)], dtype=[("a", "<i2"), ("b", "<f4")])
    ),
    "memoryview empty 2-D": lambda i: memoryview(np.zeros((0, 3), np.int32)),
    "list of memoryview 2-D": lambda i: [memoryview(np.ones((2, 2), np.int8) * i), b"x"],
    "python scalars": lambda i: (i, float(i) / 3, complex(i, 1), "s", None, True, 2**70 + i),
    "misc objects": lambda i: (
        uuid.UUID(int=i),
        PurePosixPath(f"a/{i}"),
        range(i),
        slice(1, i),
        Ellipsis,
        type(None),
    ),
}


class Transform:
    """A picklable transform that builds the catalogue entry ``name``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, sample: Any) -> Any:
        return CATALOGUE[self.name](sample.metadata["i"])


class Collate:
    """A picklable ``collate_fn`` that returns the entry ``name`` of the batch's first sample,
    beside the items and a numpy count."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, items: list[Any]) -> Any:
        return {
            "entry": CATALOGUE[self.name](items[0].metadata["i"]),
            "count": np.int64(len(items)),
            "ids": [np.int32(s.metadata["i"]) for s in items],
        }


def batches(dataset, num_workers: int, **options: Any) -> list[Any]:
    with DataLoader(dataset, batch_size=BATCH, num_workers=num_workers, **options) as loader:
        return list(loader)


# ---- comparison: equal values, same types ----


def assert_same(got: Any, expected: Any, where: str = "result") -> None:
    """``got`` (with workers) is what ``expected`` (``num_workers=0``) is. With workers, a
    bytes-like leaf arrives as a read-only ``memoryview`` of the same bytes (documented)."""
    if isinstance(expected, (bytes, bytearray)) and not isinstance(expected, np.generic):
        assert type(got) in (type(expected), memoryview), f"{where}: {type(got)}"
        if isinstance(got, memoryview):
            assert got.readonly and got.format == "B" and got.ndim == 1, where
        assert bytes(got) == bytes(expected), where
        return
    assert type(got) is type(expected), f"{where}: {type(got)} is not {type(expected)}"
    if isinstance(expected, memoryview):
        assert (got.format, got.shape, got.nbytes) == (
            expected.format,
            expected.shape,
            expected.nbytes,
        ), where
        assert got.tobytes() == expected.tobytes(), where
        if expected.format in ("B", "b", "h", "i", "q", "c"):
            assert got.tolist() == expected.tolist(), where
    elif isinstance(expected, np.ma.MaskedArray):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), where
        assert np.array_equal(np.ma.getmaskarray(got), np.ma.getmaskarray(expected)), where
        assert got.fill_value == expected.fill_value, where
        assert got.filled().tolist() == expected.filled().tolist(), where
    elif isinstance(expected, np.ndarray):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape), where
        if expected.dtype.hasobject:
            for k, (g, e) in enumerate(zip(got.ravel(), expected.ravel(), strict=True)):
                assert_same(g, e, f"{where}[{k}]")
        else:
            assert got.tobytes() == expected.tobytes(), where
            assert got.tolist() == expected.tolist(), where
    elif isinstance(expected, np.generic):
        assert got.dtype == expected.dtype, where
        if expected.dtype.hasobject:  # a structured scalar with an object field
            assert_same(got.item(), expected.item(), where)
        else:
            assert got.tobytes() == expected.tobytes(), where
    elif isinstance(expected, dict):
        assert [type(k) for k in got] == [type(k) for k in expected], where
        assert list(got) == list(expected), where
        for k in expected:
            assert_same(got[k], expected[k], f"{where}[{k!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for k, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert_same(g, e, f"{where}[{k}]")
    elif dataclasses.is_dataclass(expected):
        for field in dataclasses.fields(expected):
            name = field.name
            assert_same(getattr(got, name), getattr(expected, name), f"{where}.{name}")
    elif type(expected).__module__.startswith("PIL."):
        assert (got.mode, got.size) == (expected.mode, expected.size), where
        assert got.tobytes() == expected.tobytes(), where
    elif isinstance(expected, (set, frozenset)):
        assert got == expected, where
        assert sorted(map(repr, got)) == sorted(map(repr, expected)), where
    else:
        assert got == expected, where


# ---- the catalogue, returned by a transform and by a collate_fn ----


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_a_transform_result_arrives_as_without_workers(dataset, name):
    transform = Transform(name)
    expected = batches(dataset, 0, transform=transform)
    got = batches(dataset, 2, transform=transform)
    assert len(got) == len(expected) == N // BATCH
    assert_same(got, expected)


COLLATED = [
    "np.int64",
    "np.float32",
    "np.str_",
    "object array",
    "structured array",
    "masked array 2-D",
    "date",
    "Decimal",
    "dataclass",
    "namedtuple",
    "PIL image",
    "nested containers",
    "memoryview 2-D",
]


@pytest.mark.parametrize("name", COLLATED)
def test_a_collate_fn_result_arrives_as_without_workers(dataset, name):
    collate_fn = Collate(name)
    expected = batches(dataset, 0, collate_fn=collate_fn)
    got = batches(dataset, 2, collate_fn=collate_fn)
    assert_same(got, expected)


CONTEXTS = [
    "np.int64",
    "np.datetime64",
    "object array",
    "structured array",
    "masked array",
    "datetime",
    "Fraction",
    "enum",
    "frozen dataclass",
    "typed NamedTuple",
    "PIL image",
    "nested containers",
    "memoryview cast",
]


class AllOf:
    """A picklable transform returning a dict of several catalogue entries."""

    def __init__(self, names: list[str]) -> None:
        self.names = names

    def __call__(self, sample: Any) -> Any:
        return {name: CATALOGUE[name](sample.metadata["i"]) for name in self.names}


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_the_catalogue_under_each_start_method(dataset, context):
    transform = AllOf(CONTEXTS)
    expected = batches(dataset, 0, transform=transform)
    got = batches(dataset, 2, transform=transform, multiprocessing_context=context)
    assert_same(got, expected)


# ---- the zero-copy path is still taken for a result's own buffers ----


def address(obj: Any) -> int:
    if isinstance(obj, memoryview):
        return np.frombuffer(obj.cast("B") if obj.ndim != 1 else obj, np.uint8).ctypes.data
    return obj.__array_interface__["data"][0]


def own_buffers(sample: Any) -> Any:
    i = sample.metadata["i"]
    return {
        "array": np.arange(16, dtype=np.int32) + i,
        "leaves": (b"b" * (i + 1), bytearray(b"a" * (i + 2))),
        "view": memoryview(np.arange(12, dtype=np.int16).reshape(3, 4) + i),
        "label": np.int64(i),
        "pair": Pair(np.full(4, i, np.float32), np.int64(i)),
        "inside": Labelled(np.int64(i), "x", np.arange(5) + i, b"raw"),
    }


def test_a_results_own_buffers_still_view_result_memory(dataset):
    with DataLoader(dataset, batch_size=BATCH, num_workers=2, transform=own_buffers) as loader:
        items = [item for batch in loader for item in batch]
    assert len(items) == N
    for item in items:
        i = int(item["label"])
        assert type(item["label"]) is np.int64
        array = item["array"]
        assert array.tolist() == list(range(i, i + 16))
        assert in_result_memory(address(array), array.nbytes)
        for leaf, data in zip(item["leaves"], (b"b" * (i + 1), b"a" * (i + 2)), strict=True):
            assert isinstance(leaf, memoryview) and bytes(leaf) == data
            assert in_result_memory(address(leaf), len(data))
        view = item["view"]
        assert (view.format, view.shape, view.readonly) == ("h", (3, 4), True)
        assert view.tolist() == (np.arange(12).reshape(3, 4) + i).tolist()
        assert in_result_memory(address(view), view.nbytes)
        # A plain named tuple is a container: its array is a view too.
        assert type(item["pair"]) is Pair and type(item["pair"].label) is np.int64
        assert in_result_memory(address(item["pair"].array), 16)
        # Inside another object's pickled state: pickled, as pickle made it.
        inside = item["inside"]
        assert type(inside) is Labelled and inside.raw == b"raw"
        assert inside.array.tolist() == list(range(i, i + 5))
        assert not in_result_memory(address(inside.array))
