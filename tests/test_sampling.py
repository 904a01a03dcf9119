"""Epoch orders: the golden vectors of docs/determinism.md, an independent reimplementation of
that page, the sampling properties, and the same orders observed through a real dataset."""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataset_rt import DatasetRuntime, ReaderConfig, WriterConfig, _native
from dataset_rt.testing import make_source

QUIET = WriterConfig(show_progress=False)
PROPERTY = settings(max_examples=150, deadline=None)
# Tests that write or read caches share a module-wide base dir: caches are written once per name.
DATASET_PROPERTY = settings(max_examples=25, deadline=None)

# ---- golden vectors, copied from docs/determinism.md

# (seed, epoch, num_samples, weights, epoch_len, shuffle, order)
GOLDEN_ORDERS = [
    (42, 0, 10, None, 10, True, [3, 5, 6, 8, 2, 0, 1, 9, 7, 4]),
    (42, 1, 10, None, 10, True, [6, 8, 4, 5, 2, 1, 9, 0, 7, 3]),
    (7, 3, 4, [1.0, 2.0, 3.0, 4.0], 10, True, [1, 3, 2, 0, 3, 3, 1, 2, 3, 2]),
    (7, 3, 4, [1.0, 2.0, 3.0, 4.0], 10, False, [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]),
    (0, 0, 5, None, 12, True, [0, 3, 1, 1, 2, 2, 2, 0, 3, 4, 4, 4]),
    (7, 3, 4, [1.0, 2.0, 3.0, 4.0], 7, False, [0, 1, 2, 2, 3, 3, 3]),
    (1, 2, 5, [0.5, 1.25, 3.0, 0.1, 2.15], 13, True, [4, 2, 4, 2, 3, 4, 1, 2, 4, 2, 1, 2, 1]),
    (3, 0, 10, None, 4, False, [1, 3, 6, 8]),
]

# (seed, epoch, num_samples, weights, epoch_len, counts)
GOLDEN_COUNTS = [
    (7, 3, 4, [1.0, 2.0, 3.0, 4.0], 10, [1, 2, 3, 4]),
    (0, 0, 5, None, 12, [2, 2, 3, 2, 3]),
    (7, 3, 4, [1.0, 2.0, 3.0, 4.0], 7, [1, 1, 2, 3]),
    (1, 2, 5, [0.5, 1.25, 3.0, 0.1, 2.15], 13, [0, 3, 5, 1, 4]),
]

# (seed, epoch, num_samples, epoch_len, positions, samples at those positions): read one
# position at a time, as a resumed pass does.
GOLDEN_POSITIONS = [
    (2026, 5, 10**9, 10**9, [0, 1, 2, 10**9 - 1], [123200540, 267981582, 148084559, 759708584]),
    (2026, 5, 1000, 10**9, [0, 1, 2, 10**9 - 1], [480, 389, 230, 835]),
]

# (x, seed, XXH3_64bits_withSeed of x's 8 little-endian bytes): the shuffle's round function.
GOLDEN_ROUND_FUNCTION = [
    (0, 0, 0xC77B3ABB6F87ACD9),
    (5, 42, 0x53E4368E22C276EC),
    (2**31, 0xDEADBEEFCAFEF00D, 0xEBD33C553418D8D2),
    (2**64 - 1, 2**64 - 1, 0xDA8F77A4D5C399EA),
]

GOLDEN_RAW_STREAM_42_0 = [
    0x9BC6998114E23BF6,
    0x6D1428A87CA3F1DD,
    0xFF381514D423C3E0,
    0x2B331F431C3CB506,
]


def histogram(order: Sequence[int], n: int) -> list[int]:
    counts = [0] * n
    for i in order:
        counts[i] += 1
    return counts


@pytest.mark.parametrize(
    ("seed", "epoch", "n", "weights", "epoch_len", "shuffle", "expected"), GOLDEN_ORDERS
)
def test_golden_orders(
    seed: int,
    epoch: int,
    n: int,
    weights: list[float] | None,
    epoch_len: int,
    shuffle: bool,
    expected: list[int],
) -> None:
    order = _native.epoch_order(seed, epoch, n, epoch_len, shuffle, weights)
    assert order == expected
    # Keyword form: the same call as documented in the stub.
    assert (
        _native.epoch_order(
            seed=seed,
            epoch=epoch,
            num_samples=n,
            epoch_len=epoch_len,
            shuffle=shuffle,
            weights=weights,
        )
        == expected
    )


@pytest.mark.parametrize(("seed", "epoch", "n", "weights", "epoch_len", "counts"), GOLDEN_COUNTS)
def test_golden_counts(
    seed: int, epoch: int, n: int, weights: list[float] | None, epoch_len: int, counts: list[int]
) -> None:
    # The counts draw comes first, so shuffled and storage orders hold the same counts.
    for shuffle in (False, True):
        order = _native.epoch_order(seed, epoch, n, epoch_len, shuffle, weights)
        assert histogram(order, n) == counts


def test_defaults_are_full_uniform_shuffled_epoch() -> None:
    assert _native.epoch_order(42, 0, 10) == GOLDEN_ORDERS[0][-1]
    assert _native.epoch_order(42, 1, 10) == GOLDEN_ORDERS[1][-1]


def test_uniform_full_epoch_without_shuffle_is_identity() -> None:
    for n in (0, 1, 2, 17, 1000):
        assert _native.epoch_order(5, 9, n, shuffle=False) == list(range(n))


def test_empty_epoch() -> None:
    assert _native.epoch_order(1, 1, 5, epoch_len=0) == []
    assert _native.epoch_order(1, 1, 0) == []
    assert _native.epoch_order(1, 1, 3, epoch_len=0, weights=[1.0, 2.0, 3.0]) == []


def test_epoch_len_without_samples_is_an_error_not_a_panic() -> None:
    # An epoch of 5 entries over no samples cannot exist: that is the caller's mistake, and must
    # reach Python as a DatasetRT error, never as a Rust panic.
    with pytest.raises(_native.DatasetRTError):
        _native.epoch_order(0, 0, 0, epoch_len=5)


@pytest.mark.parametrize(
    ("weights", "match"),
    [
        ([1.0, 2.0], "2 weights for 3 samples"),
        ([1.0, 0.0, 1.0], "weight 1 is 0"),
        ([1.0, -2.0, 1.0], "weight 1 is -2"),
        ([1.0, 1.0, math.nan], "weight 2 is NaN"),
        ([math.inf, 1.0, 1.0], "weight 0 is inf"),
    ],
)
def test_bad_weights_refused(weights: list[float], match: str) -> None:
    with pytest.raises(_native.ConfigError, match=match):
        _native.epoch_order(0, 0, 3, weights=weights)


# ---- an independent implementation of docs/determinism.md, from the page alone

MASK32 = 0xFFFFFFFF
MASK64 = (1 << 64) - 1


def _rotl(x: int, n: int) -> int:
    return ((x << n) | (x >> (32 - n))) & MASK32


def _quarter(s: list[int], a: int, b: int, c: int, d: int) -> None:
    s[a] = (s[a] + s[b]) & MASK32
    s[d] = _rotl(s[d] ^ s[a], 16)
    s[c] = (s[c] + s[d]) & MASK32
    s[b] = _rotl(s[b] ^ s[c], 12)
    s[a] = (s[a] + s[b]) & MASK32
    s[d] = _rotl(s[d] ^ s[a], 8)
    s[c] = (s[c] + s[d]) & MASK32
    s[b] = _rotl(s[b] ^ s[c], 7)


class ChaCha8:
    """ChaCha with 8 rounds, 64-bit block counter in words 12/13, stream words 14/15 = 0."""

    CONSTANTS = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)

    def __init__(self, key: bytes) -> None:
        assert len(key) == 32
        self.key = list(struct.unpack("<8I", key))
        self.counter = 0
        self.words: list[int] = []

    def _block(self) -> list[int]:
        state = [
            *self.CONSTANTS,
            *self.key,
            self.counter & MASK32,
            self.counter >> 32,
            0,
            0,
        ]
        work = list(state)
        for _ in range(4):
            _quarter(work, 0, 4, 8, 12)
            _quarter(work, 1, 5, 9, 13)
            _quarter(work, 2, 6, 10, 14)
            _quarter(work, 3, 7, 11, 15)
            _quarter(work, 0, 5, 10, 15)
            _quarter(work, 1, 6, 11, 12)
            _quarter(work, 2, 7, 8, 13)
            _quarter(work, 3, 4, 9, 14)
        self.counter += 1
        return [(w + s) & MASK32 for w, s in zip(work, state, strict=True)]

    def next_u32(self) -> int:
        if not self.words:
            self.words = self._block()
        return self.words.pop(0)

    def next_u64(self) -> int:
        lo = self.next_u32()
        hi = self.next_u32()
        return lo | (hi << 32)


def epoch_stream(seed: int, epoch: int) -> ChaCha8:
    return ChaCha8(struct.pack("<QQ", seed, epoch) + b"dataset-rt/epoch")


def unit_float(rng: ChaCha8) -> float:
    return (rng.next_u64() >> 11) * 2.0**-53


def bounded(rng: ChaCha8, m: int) -> int:
    return (rng.next_u64() * m) >> 64


def reference_counts(
    rng: ChaCha8, n: int, epoch_len: int, weights: Sequence[float] | None
) -> Iterator[int]:
    """Counts per sample, consuming the counts draw from ``rng`` as the page says."""
    if n == 0 or epoch_len == 0:
        yield from [0] * n
        return
    if weights is None:
        if epoch_len == n:
            yield from [1] * n
            return
        off = bounded(rng, n)
        for i in range(n):
            yield ((i + 1) * epoch_len + off) // n - (i * epoch_len + off) // n
        return
    total = 0.0
    for w in weights:  # strictly left to right (not sum(), which may compensate)
        total += w
    u = unit_float(rng)
    prefix = 0.0
    previous = 0
    for i, w in enumerate(weights):
        prefix += w
        if i == n - 1:
            boundary = epoch_len
        else:
            boundary = min(math.floor(float(epoch_len) * (prefix / total) + u), epoch_len)
        boundary = max(boundary, previous)
        yield boundary - previous
        previous = boundary


SHUFFLE_ROUNDS = 8


def xxh3_u64(x: int, seed: int) -> int:
    """XXH3_64bits_withSeed of the 8 little-endian bytes of ``x``, in the page's short form."""
    seed ^= int.from_bytes((seed & MASK32).to_bytes(4, "little"), "big") << 32
    flip = ((0x1CAD21F72C81017C ^ 0xDB979083E96DD4DE) - seed) & MASK64
    h = ((x >> 32) + ((x & MASK32) << 32)) ^ flip
    h ^= _rotl64(h, 49) ^ _rotl64(h, 24)
    h = (h * 0x9FB21C651E98DF25) & MASK64
    h ^= ((h >> 35) + 8) & MASK64
    h = (h * 0x9FB21C651E98DF25) & MASK64
    return h ^ (h >> 28)


def _rotl64(x: int, n: int) -> int:
    return ((x << n) | (x >> (64 - n))) & MASK64


def shuffle_position(keys: Sequence[int], length: int, k: int) -> int:
    """The slot at position ``k``: the Feistel network with cycle walking, as the page says."""
    bits = (length - 1).bit_length()
    half = (bits + 1) // 2
    mask = (1 << half) - 1
    y = k
    while True:
        left, right = y >> half, y & mask
        for key in keys:
            left, right = right, left ^ (xxh3_u64(right, key) & mask)
        y = (left << half) | right
        if y < length:
            return y


def reference_order(
    seed: int,
    epoch: int,
    n: int,
    epoch_len: int | None = None,
    shuffle: bool = True,
    weights: Sequence[float] | None = None,
) -> list[int]:
    length = n if epoch_len is None else epoch_len
    rng = epoch_stream(seed, epoch)
    expansion = [
        i for i, c in enumerate(reference_counts(rng, n, length, weights)) for _ in range(c)
    ]
    assert len(expansion) == length
    if not shuffle or length < 2:
        return expansion
    keys = [rng.next_u64() for _ in range(SHUFFLE_ROUNDS)]
    return [expansion[shuffle_position(keys, length, k)] for k in range(length)]


def test_reference_reproduces_raw_stream() -> None:
    rng = epoch_stream(42, 0)
    assert [rng.next_u64() for _ in range(4)] == GOLDEN_RAW_STREAM_42_0


@pytest.mark.parametrize(("x", "seed", "expected"), GOLDEN_ROUND_FUNCTION)
def test_reference_reproduces_round_function(x: int, seed: int, expected: int) -> None:
    assert xxh3_u64(x, seed) == expected


def reference_positions(
    seed: int, epoch: int, n: int, epoch_len: int, positions: Sequence[int]
) -> list[int]:
    """Uniform weights, shuffled: the samples at ``positions`` alone, without the expansion."""
    rng = epoch_stream(seed, epoch)
    off = None if epoch_len == n else bounded(rng, n)
    keys = [rng.next_u64() for _ in range(SHUFFLE_ROUNDS)]
    slots = [shuffle_position(keys, epoch_len, k) for k in positions]
    if off is None:
        return slots
    return [((t + 1) * n - off - 1) // epoch_len for t in slots]


@pytest.mark.parametrize(
    ("seed", "epoch", "n", "epoch_len", "positions", "expected"), GOLDEN_POSITIONS
)
def test_golden_positions_of_a_large_epoch(
    seed: int, epoch: int, n: int, epoch_len: int, positions: list[int], expected: list[int]
) -> None:
    assert reference_positions(seed, epoch, n, epoch_len, positions) == expected
    assert _native.epoch_order(seed, epoch, n, epoch_len, positions=positions) == expected


def test_positions_agree_with_the_whole_order() -> None:
    weights = [0.5, 1.25, 3.0, 0.1, 2.15]
    for n, w in ((10, None), (5, weights)):
        for shuffle in (True, False):
            whole = _native.epoch_order(1, 2, n, 13, shuffle, w)
            picked = [12, 0, 7, 7, 3]
            got = _native.epoch_order(1, 2, n, 13, shuffle, w, positions=picked)
            assert got == [whole[k] for k in picked]


def test_a_position_outside_the_epoch_is_refused() -> None:
    with pytest.raises(_native.ConfigError, match="position 13 is outside the epoch of 13"):
        _native.epoch_order(1, 2, 10, 13, positions=[0, 13])


@pytest.mark.parametrize(
    ("seed", "epoch", "n", "weights", "epoch_len", "shuffle", "expected"), GOLDEN_ORDERS
)
def test_reference_reproduces_golden_orders(
    seed: int,
    epoch: int,
    n: int,
    weights: list[float] | None,
    epoch_len: int,
    shuffle: bool,
    expected: list[int],
) -> None:
    assert reference_order(seed, epoch, n, epoch_len, shuffle, weights) == expected


def test_uniform_expansion_formula_matches_counts() -> None:
    # The page gives two forms of the uniform expansion; they must agree.
    for n in range(1, 13):
        for epoch_len in range(0, 30):
            if epoch_len == n:
                continue
            for off in range(n):
                slots = [((t + 1) * n - off - 1) // epoch_len for t in range(epoch_len)]
                counts = [
                    ((i + 1) * epoch_len + off) // n - (i * epoch_len + off) // n for i in range(n)
                ]
                assert histogram(slots, n) == counts
                assert slots == sorted(slots)


u64s = st.integers(min_value=0, max_value=MASK64)


@PROPERTY
@given(
    seed=u64s,
    epoch=u64s,
    n=st.integers(min_value=1, max_value=60),
    epoch_len=st.integers(min_value=0, max_value=150),
    shuffle=st.booleans(),
)
def test_native_matches_reference_uniform(
    seed: int, epoch: int, n: int, epoch_len: int, shuffle: bool
) -> None:
    assert _native.epoch_order(seed, epoch, n, epoch_len, shuffle) == reference_order(
        seed, epoch, n, epoch_len, shuffle
    )


@PROPERTY
@given(
    seed=u64s,
    epoch=u64s,
    weights=st.lists(
        st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=40,
    ),
    epoch_len=st.integers(min_value=0, max_value=150),
    shuffle=st.booleans(),
)
def test_native_matches_reference_weighted(
    seed: int, epoch: int, weights: list[float], epoch_len: int, shuffle: bool
) -> None:
    n = len(weights)
    assert _native.epoch_order(seed, epoch, n, epoch_len, shuffle, weights) == reference_order(
        seed, epoch, n, epoch_len, shuffle, weights
    )


# ---- sampling properties


@PROPERTY
@given(seed=u64s, epoch=u64s, n=st.integers(min_value=0, max_value=500))
def test_uniform_shuffled_full_epoch_is_permutation(seed: int, epoch: int, n: int) -> None:
    order = _native.epoch_order(seed, epoch, n, shuffle=True)
    assert sorted(order) == list(range(n))


@PROPERTY
@given(
    seed=u64s,
    n=st.integers(min_value=1, max_value=200),
    epoch_len=st.integers(min_value=0, max_value=600),
    shuffle=st.booleans(),
)
def test_uniform_counts_are_floor_or_ceil(seed: int, n: int, epoch_len: int, shuffle: bool) -> None:
    order = _native.epoch_order(seed, 0, n, epoch_len, shuffle)
    assert len(order) == epoch_len
    assert all(0 <= i < n for i in order)
    low, high = epoch_len // n, -(-epoch_len // n)
    assert all(c in (low, high) for c in histogram(order, n))


@PROPERTY
@given(
    seed=u64s,
    epoch=u64s,
    weights=st.lists(
        st.floats(min_value=1e-6, max_value=1e6, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=80,
    ),
    epoch_len=st.integers(min_value=0, max_value=2000),
    shuffle=st.booleans(),
)
def test_weighted_counts_within_one_of_expectation(
    seed: int, epoch: int, weights: list[float], epoch_len: int, shuffle: bool
) -> None:
    order = _native.epoch_order(seed, epoch, len(weights), epoch_len, shuffle, weights)
    assert len(order) == epoch_len
    counts = histogram(order, len(weights))
    assert sum(counts) == epoch_len
    total = math.fsum(weights)
    for count, w in zip(counts, weights, strict=True):
        assert abs(count - epoch_len * w / total) < 1 + 1e-9
    if not shuffle:
        assert order == sorted(order)


@PROPERTY
@given(
    seed=u64s,
    epoch=u64s,
    n=st.integers(min_value=1, max_value=100),
    epoch_len=st.integers(min_value=0, max_value=300),
    weighted=st.booleans(),
)
def test_shuffle_permutes_storage_order(
    seed: int, epoch: int, n: int, epoch_len: int, weighted: bool
) -> None:
    weights = [1.0 + (i % 7) for i in range(n)] if weighted else None
    stored = _native.epoch_order(seed, epoch, n, epoch_len, False, weights)
    shuffled = _native.epoch_order(seed, epoch, n, epoch_len, True, weights)
    assert sorted(shuffled) == stored
    assert _native.epoch_order(seed, epoch, n, epoch_len, True, weights) == shuffled


def test_epochs_and_seeds_differ() -> None:
    base = _native.epoch_order(42, 0, 100)
    assert _native.epoch_order(42, 1, 100) != base
    assert _native.epoch_order(43, 0, 100) != base


# ---- the same orders through a real dataset


def positional_source(name: str, n: int, first_id: int = 0):  # type: ignore[no-untyped-def]
    """n samples whose sample_id is their position (plus ``first_id``); payloads name them."""
    return make_source(
        name,
        [(f"{name}:{first_id + i}".encode(), {"sample_id": first_id + i}) for i in range(n)],
    )


def ids(dataset) -> list[int]:  # type: ignore[no-untyped-def]
    return [sample.metadata["sample_id"] for sample in dataset]


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sampling")


def load(base: Path, sources, reader: ReaderConfig, workers: int = 2):  # type: ignore[no-untyped-def]
    runtime = DatasetRuntime(num_workers=workers)
    result = runtime.from_cache_sources(sources, base, reader_config=reader, writer_config=QUIET)
    return runtime, result.dataset


def test_dataset_reproduces_golden_permutations(base_dir: Path) -> None:
    runtime, dataset = load(base_dir, positional_source("golden10", 10), ReaderConfig(seed=42))
    with runtime:
        assert dataset.state_dict()["epoch"] == 0
        assert ids(dataset) == GOLDEN_ORDERS[0][-1]  # first pass: epoch 0
        assert ids(dataset) == GOLDEN_ORDERS[1][-1]  # second pass: epoch 1
        assert ids(dataset) == _native.epoch_order(42, 2, 10)


def test_dataset_payloads_follow_order(base_dir: Path) -> None:
    runtime, dataset = load(base_dir, positional_source("golden10", 10), ReaderConfig(seed=42))
    with runtime:
        samples = list(dataset)
    assert [bytes(s.data) for s in samples] == [
        f"golden10:{i}".encode() for i in GOLDEN_ORDERS[0][-1]
    ]


def test_dataset_reproduces_weighted_golden(base_dir: Path) -> None:
    runtime, dataset = load(
        base_dir, positional_source("golden4", 4), ReaderConfig(seed=7, samples_per_epoch=10)
    )
    with runtime:
        table = dataset.samples_metadata().sort("sample_id")
        dataset.set_samples_metadata(table.with_columns(pl.Series("weight", [1.0, 2.0, 3.0, 4.0])))
        dataset.set_epoch(3)
        assert ids(dataset) == GOLDEN_ORDERS[2][-1]


def test_dataset_reproduces_oversampled_golden(base_dir: Path) -> None:
    runtime, dataset = load(
        base_dir, positional_source("golden5", 5), ReaderConfig(seed=0, samples_per_epoch=12)
    )
    with runtime:
        assert len(dataset) == 12
        assert ids(dataset) == GOLDEN_ORDERS[4][-1]


def test_dataset_undersampled_storage_order(base_dir: Path) -> None:
    runtime, dataset = load(
        base_dir,
        positional_source("golden10", 10),
        ReaderConfig(seed=3, shuffle=False, samples_per_epoch=4),
    )
    with runtime:
        assert ids(dataset) == [1, 3, 6, 8]


def test_unshuffled_is_storage_order_with_caches_in_source_order(base_dir: Path) -> None:
    first = positional_source("first", 7)
    second = positional_source("second", 5, first_id=100)
    runtime, dataset = load(base_dir, [first, second], ReaderConfig(shuffle=False))
    with runtime:
        assert dataset.cache_names == ["first", "second"]
        expected = [*range(7), *range(100, 105)]
        assert ids(dataset) == expected
        assert ids(dataset) == expected  # every epoch
    # Reversed source order: the other cache comes first.
    runtime, dataset = load(base_dir, [second, first], ReaderConfig(shuffle=False))
    with runtime:
        assert ids(dataset) == [*range(100, 105), *range(7)]


def test_shuffled_global_index_is_cache_start_plus_row(base_dir: Path) -> None:
    first = positional_source("first", 7)
    second = positional_source("second", 5, first_id=100)
    runtime, dataset = load(base_dir, [first, second], ReaderConfig(seed=11))
    with runtime:
        global_ids = [*range(7), *range(100, 105)]
        for epoch in range(3):
            expected = [global_ids[g] for g in _native.epoch_order(11, epoch, 12)]
            assert ids(dataset) == expected


@DATASET_PROPERTY
@given(
    n=st.integers(min_value=1, max_value=40),
    seed=st.integers(min_value=0, max_value=MASK64),
    shuffle=st.booleans(),
    samples_per_epoch=st.none() | st.integers(min_value=0, max_value=90),
)
def test_order_independent_of_workers_and_prefetch(
    base_dir: Path, n: int, seed: int, shuffle: bool, samples_per_epoch: int | None
) -> None:
    source = positional_source(f"n{n}", n)
    expected = _native.epoch_order(seed, 0, n, samples_per_epoch, shuffle)
    orders = []
    for workers, prefetch in ((1, 1), (3, 64), (1, 64), (3, 1)):
        reader = ReaderConfig(
            seed=seed, shuffle=shuffle, prefetch_size=prefetch, samples_per_epoch=samples_per_epoch
        )
        runtime, dataset = load(base_dir, source, reader, workers=workers)
        with runtime:
            orders.append(ids(dataset))
    assert all(order == expected for order in orders)


@DATASET_PROPERTY
@given(
    n=st.integers(min_value=2, max_value=30),
    seed=st.integers(min_value=0, max_value=MASK64),
    weight_seed=st.integers(min_value=0, max_value=1000),
    epoch_len=st.integers(min_value=1, max_value=80),
)
def test_weighted_dataset_order_matches_epoch_order(
    base_dir: Path, n: int, seed: int, weight_seed: int, epoch_len: int
) -> None:
    weights = [0.25 + ((weight_seed * 7919 + i * 104729) % 97) / 10 for i in range(n)]
    source = positional_source(f"n{n}", n)
    expected = _native.epoch_order(seed, 0, n, epoch_len, True, weights)
    for workers, prefetch in ((1, 1), (3, 16)):
        reader = ReaderConfig(seed=seed, prefetch_size=prefetch, samples_per_epoch=epoch_len)
        runtime, dataset = load(base_dir, source, reader, workers=workers)
        with runtime:
            table = dataset.samples_metadata()
            weight_of = dict(zip(range(n), weights, strict=True))
            dataset.set_samples_metadata(
                table.with_columns(
                    pl.col("sample_id")
                    .replace_strict(weight_of, return_dtype=pl.Float64)
                    .alias("weight")
                )
            )
            assert ids(dataset) == expected
