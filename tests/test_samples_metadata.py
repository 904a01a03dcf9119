"""The samples-metadata table: its columns, editing weights, and every refused table (which
must name the offending rows and leave the previous weights in force)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataset_rt import (
    ConfigError,
    Dataset,
    DatasetRuntime,
    ReaderConfig,
    SamplesMetadataError,
    WriterConfig,
    _native,
)
from dataset_rt.testing import make_source

QUIET = WriterConfig(show_progress=False)
LABELS = ["cat", "dog", "rare_class", "cat", "bird", "rare_class", "dog", "cat", "cat", "dog"]


def animals(name: str = "animals"):  # type: ignore[no-untyped-def]
    """10 samples with int ids 0..9 and one metadata column of each primitive type."""
    return make_source(
        name,
        [
            (
                f"{name}:{i}".encode(),
                {
                    "sample_id": i,
                    "label": LABELS[i],
                    "score": i / 4,
                    "count": i * 10,
                    "ok": i % 2 == 0,
                },
            )
            for i in range(10)
        ],
    )


def ids(dataset: Dataset) -> list[Any]:
    return [(s.metadata.get("sample_id")) for s in dataset]


class Opened:
    def __init__(self, base: Path, sources: Any, reader: ReaderConfig | None = None) -> None:
        self.runtime = DatasetRuntime(num_workers=2)
        result = self.runtime.from_cache_sources(
            sources, base, reader_config=reader or ReaderConfig(seed=42), writer_config=QUIET
        )
        self.dataset: Dataset = result.dataset

    def __enter__(self) -> Dataset:
        return self.dataset

    def __exit__(self, *exc: object) -> None:
        self.runtime.close()


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("samples_metadata")


def rare_weights(table: pl.DataFrame) -> pl.DataFrame:
    """The seed README's example."""
    return table.with_columns(
        pl.when(pl.col("label") == "rare_class").then(5.0).otherwise(1.0).alias("weight")
    )


def test_columns_dtypes_and_default_weights(base_dir: Path) -> None:
    with Opened(base_dir, animals()) as dataset:
        table = dataset.samples_metadata()
    assert isinstance(table, pl.DataFrame)
    assert table.columns == ["cache_id", "sample_id", "label", "score", "count", "ok", "weight"]
    assert table.schema == pl.Schema(
        {
            "cache_id": pl.String,
            "sample_id": pl.Int64,
            "label": pl.String,
            "score": pl.Float64,
            "count": pl.Int64,
            "ok": pl.Boolean,
            "weight": pl.Float64,
        }
    )
    assert table["cache_id"].to_list() == ["animals"] * 10
    assert table["sample_id"].to_list() == list(range(10))
    assert table["label"].to_list() == LABELS
    assert table["score"].to_list() == [i / 4 for i in range(10)]
    assert table["count"].to_list() == [i * 10 for i in range(10)]
    assert table["ok"].to_list() == [i % 2 == 0 for i in range(10)]
    assert table["weight"].to_list() == [1.0] * 10


def test_positional_ids_without_user_sample_id(base_dir: Path) -> None:
    source = make_source("positional", [(b"x" * i, {"label": str(i)}) for i in range(4)])
    with Opened(base_dir, source) as dataset:
        table = dataset.samples_metadata()
    assert table.columns == ["cache_id", "sample_id", "label", "weight"]
    assert table["sample_id"].dtype == pl.Int64
    assert table["sample_id"].to_list() == [0, 1, 2, 3]


def test_readme_example_weights_rare_class(base_dir: Path) -> None:
    reader = ReaderConfig(seed=42, samples_per_epoch=70)
    with Opened(base_dir, animals(), reader) as dataset:
        before = dataset.state_dict()["weights_fingerprint"]
        metadata = dataset.samples_metadata()
        rare = rare_weights(metadata)
        dataset.set_samples_metadata(rare)
        after = dataset.samples_metadata()
        assert after.equals(rare)
        assert dataset.state_dict()["weights_fingerprint"] != before
        weights = after["weight"].to_list()
        assert weights == [5.0 if label == "rare_class" else 1.0 for label in LABELS]
        for _ in range(3):  # every epoch
            epoch = dataset.state_dict()["epoch"]
            order = ids(dataset)
            assert order == _native.epoch_order(42, epoch, 10, 70, True, weights)
            counts = Counter(order)
            assert sum(counts.values()) == 70
            for i, w in enumerate(weights):
                assert abs(counts[i] - 70 * w / sum(weights)) < 1


@settings(max_examples=20, deadline=None)
@given(
    weights=st.lists(
        st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False),
        min_size=10,
        max_size=10,
    ),
    epoch_len=st.integers(min_value=1, max_value=200),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_weighted_epoch_counts_within_one(
    base_dir: Path, weights: list[float], epoch_len: int, seed: int
) -> None:
    with Opened(base_dir, animals(), ReaderConfig(seed=seed, samples_per_epoch=epoch_len)) as ds:
        ds.set_samples_metadata(ds.samples_metadata().with_columns(pl.Series("weight", weights)))
        counts = Counter(ids(ds))
    assert sum(counts.values()) == epoch_len
    total = math.fsum(weights)
    for i, w in enumerate(weights):
        assert abs(counts[i] - epoch_len * w / total) < 1 + 1e-9


def test_rows_in_any_order_accepted(base_dir: Path) -> None:
    with Opened(base_dir, animals()) as dataset:
        rare = rare_weights(dataset.samples_metadata())
        dataset.set_samples_metadata(rare)
        expected_state = dataset.state_dict()
        expected_order = ids(dataset)
    for seed in range(3):
        shuffled = rare.sample(fraction=1.0, shuffle=True, seed=seed)
        assert shuffled["sample_id"].to_list() != rare["sample_id"].to_list()
        # Several record batches, in reverse.
        chunked = pl.concat([shuffled[5:], shuffled[:2], shuffled[2:5]], rechunk=False)
        for table in (shuffled, chunked):
            with Opened(base_dir, animals()) as dataset:
                dataset.set_samples_metadata(table)
                assert dataset.state_dict() == expected_state
                assert ids(dataset) == expected_order
                # The table comes back in storage order.
                assert dataset.samples_metadata().equals(rare)


def test_equal_weights_are_the_uniform_table(base_dir: Path) -> None:
    with Opened(base_dir, animals()) as dataset:
        uniform_state = dataset.state_dict()
        dataset.set_samples_metadata(rare_weights(dataset.samples_metadata()))
        dataset.set_samples_metadata(
            dataset.samples_metadata().with_columns(pl.lit(3.0).alias("weight"))
        )
        assert dataset.state_dict() == uniform_state
        order = ids(dataset)
    assert sorted(order) == list(range(10))
    assert order == _native.epoch_order(42, 0, 10)


def test_weights_change_the_next_pass_only(base_dir: Path) -> None:
    with Opened(base_dir, animals(), ReaderConfig(seed=1, samples_per_epoch=30)) as dataset:
        iterator = iter(dataset)
        head = [next(iterator).metadata["sample_id"] for _ in range(5)]
        weights = [100.0 if i == 0 else 1.0 for i in range(10)]
        dataset.set_samples_metadata(
            dataset.samples_metadata().with_columns(pl.Series("weight", weights))
        )
        rest = [s.metadata["sample_id"] for s in iterator]
        assert head + rest == _native.epoch_order(1, 0, 10, 30)
        assert ids(dataset) == _native.epoch_order(1, 1, 10, 30, True, weights)


# ---- refused tables


def _negative(t: pl.DataFrame) -> pl.DataFrame:
    return t.with_columns(
        pl.when(pl.col("sample_id") == 3).then(-1.0).otherwise(pl.col("weight")).alias("weight")
    )


def _set_weight(value: float):  # type: ignore[no-untyped-def]
    def edit(t: pl.DataFrame) -> pl.DataFrame:
        return t.with_columns(
            pl.when(pl.col("sample_id") == 3)
            .then(value)
            .otherwise(pl.col("weight"))
            .alias("weight")
        )

    return edit


def _duplicate(t: pl.DataFrame) -> pl.DataFrame:
    return pl.concat([t, t.filter(pl.col("sample_id") == 3)])


def _missing(t: pl.DataFrame) -> pl.DataFrame:
    return t.filter(pl.col("sample_id") != 3)


def _unknown_id(t: pl.DataFrame) -> pl.DataFrame:
    return t.with_columns(
        pl.when(pl.col("sample_id") == 3)
        .then(999)
        .otherwise(pl.col("sample_id"))
        .alias("sample_id")
    )


def _extra_unknown_id(t: pl.DataFrame) -> pl.DataFrame:
    return pl.concat(
        [t, t.filter(pl.col("sample_id") == 3).with_columns(sample_id=pl.lit(999, dtype=pl.Int64))]
    )


def _unknown_cache(t: pl.DataFrame) -> pl.DataFrame:
    return t.with_columns(
        pl.when(pl.col("sample_id") == 3)
        .then(pl.lit("plants"))
        .otherwise(pl.col("cache_id"))
        .alias("cache_id")
    )


def _changed_label(t: pl.DataFrame) -> pl.DataFrame:
    return t.with_columns(
        pl.when(pl.col("sample_id") == 3)
        .then(pl.lit("fish"))
        .otherwise(pl.col("label"))
        .alias("label")
    )


def _changed_score(t: pl.DataFrame) -> pl.DataFrame:
    return t.with_columns(
        pl.when(pl.col("sample_id") == 3).then(0.1).otherwise(pl.col("score")).alias("score")
    )


def _nulled_flag(t: pl.DataFrame) -> pl.DataFrame:
    return t.with_columns(
        pl.when(pl.col("sample_id") == 3).then(None).otherwise(pl.col("ok")).alias("ok")
    )


def _null_weight(t: pl.DataFrame) -> pl.DataFrame:
    return t.with_columns(
        pl.when(pl.col("sample_id") == 3).then(None).otherwise(pl.col("weight")).alias("weight")
    )


REFUSED_ROWS = {
    "negative weight": (_negative, ["row 3", "sample_id=3", "-1"]),
    "zero weight": (_set_weight(0.0), ["row 3", "sample_id=3", "positive"]),
    "nan weight": (_set_weight(math.nan), ["row 3", "sample_id=3", "NaN"]),
    "inf weight": (_set_weight(math.inf), ["row 3", "sample_id=3", "inf"]),
    "-inf weight": (_set_weight(-math.inf), ["row 3", "sample_id=3"]),
    "null weight": (_null_weight, ["row 3", "sample_id=3", "null"]),
    "duplicate row": (_duplicate, ["row 10", "sample_id=3", "more than once"]),
    "missing row": (_missing, ["sample_id=3", "missing"]),
    "unknown sample_id": (_unknown_id, ["row 3", "sample_id=999", "no such sample"]),
    "extra unknown sample_id": (_extra_unknown_id, ["row 10", "sample_id=999", "no such sample"]),
    "unknown cache_id": (_unknown_cache, ["row 3", "plants", "unknown cache_id"]),
    "changed str metadata": (_changed_label, ["row 3", "label", "fish"]),
    "changed float metadata": (_changed_score, ["row 3", "score", "0.1"]),
    "nulled bool metadata": (_nulled_flag, ["row 3", "ok", "null"]),
}


@pytest.fixture
def weighted(base_dir: Path):  # type: ignore[no-untyped-def]
    """A dataset whose weights were already edited once, and what it looks like."""
    with Opened(base_dir, animals(), ReaderConfig(seed=5, samples_per_epoch=25)) as dataset:
        dataset.set_samples_metadata(rare_weights(dataset.samples_metadata()))
        table = dataset.samples_metadata()
        fingerprint = dataset.state_dict()["weights_fingerprint"]
        assert fingerprint != "uniform"
        yield dataset, table, fingerprint


def assert_unchanged(dataset: Dataset, table: pl.DataFrame, fingerprint: str) -> None:
    assert dataset.state_dict()["weights_fingerprint"] == fingerprint
    assert dataset.samples_metadata().equals(table)
    epoch = dataset.state_dict()["epoch"]
    order = ids(dataset)
    assert order == _native.epoch_order(5, epoch, 10, 25, True, table["weight"].to_list())


@pytest.mark.parametrize("case", sorted(REFUSED_ROWS))
def test_refused_table_names_rows_and_changes_nothing(weighted: Any, case: str) -> None:
    dataset, table, fingerprint = weighted
    edit, fragments = REFUSED_ROWS[case]
    # Also change other weights in the same table: none of them may take effect.
    bad = edit(table.with_columns((pl.col("weight") * 3.0).alias("weight")))
    with pytest.raises(SamplesMetadataError) as refused:
        dataset.set_samples_metadata(bad)
    message = str(refused.value)
    for fragment in fragments:
        assert fragment in message
    assert "nothing was changed" in message
    assert_unchanged(dataset, table, fingerprint)


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param(lambda t: t.rename({"label": "labels"}), id="renamed column"),
        pytest.param(lambda t: t.drop("label"), id="missing metadata column"),
        pytest.param(lambda t: t.drop("weight"), id="missing weight column"),
        pytest.param(lambda t: t.drop("cache_id"), id="missing cache_id column"),
        pytest.param(lambda t: t.drop("sample_id"), id="missing sample_id column"),
        pytest.param(lambda t: t.with_columns(pl.lit(1).alias("extra")), id="extra column"),
    ],
)
def test_refused_columns_change_nothing(weighted: Any, edit: Any) -> None:
    dataset, table, fingerprint = weighted
    with pytest.raises(SamplesMetadataError, match="columns"):
        dataset.set_samples_metadata(edit(table.with_columns(pl.lit(2.0).alias("weight"))))
    assert_unchanged(dataset, table, fingerprint)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        pytest.param(
            lambda t: t.with_columns(pl.col("count").cast(pl.Float64)),
            '"count" is Float64, where samples_metadata() gave Int64',
            id="int to float",
        ),
        pytest.param(
            lambda t: t.with_columns(pl.col("ok").cast(pl.String)),
            '"ok" is ',
            id="bool to str",
        ),
        pytest.param(
            lambda t: t.with_columns(pl.col("weight").cast(pl.String)),
            '"weight" has unsupported type',
            id="weight str",
        ),
        pytest.param(
            lambda t: t.with_columns(pl.col("sample_id").cast(pl.Float64)),
            '"sample_id" is Float64, where samples_metadata() gave Int64',
            id="sample_id float",
        ),
        pytest.param(
            lambda t: t.with_columns(pl.col("count").cast(pl.Int32)),
            '"count" has unsupported type Int32: keep the Int64 that samples_metadata() gave',
            id="int64 to int32",
        ),
    ],
)
def test_refused_column_types_change_nothing(weighted: Any, edit: Any, says: str) -> None:
    dataset, table, fingerprint = weighted
    with pytest.raises(SamplesMetadataError) as refused:
        dataset.set_samples_metadata(edit(table))
    # The message says which column's type changed, not that its values did.
    assert says in str(refused.value), str(refused.value)
    assert "was changed from" not in str(refused.value)
    assert_unchanged(dataset, table, fingerprint)


@pytest.mark.parametrize(
    "value",
    [
        pytest.param(lambda t: t.to_dict(as_series=False), id="dict"),
        pytest.param(lambda t: t.lazy(), id="LazyFrame"),
        pytest.param(lambda t: t.rows(), id="list of rows"),
        pytest.param(lambda t: t["weight"], id="Series"),
        pytest.param(lambda t: t.to_arrow(), id="pyarrow Table"),
        pytest.param(lambda t: None, id="None"),
    ],
)
def test_non_dataframe_refused_with_type_error(weighted: Any, value: Any) -> None:
    dataset, table, fingerprint = weighted
    with pytest.raises(TypeError, match=r"polars\.DataFrame"):
        dataset.set_samples_metadata(value(table))
    assert_unchanged(dataset, table, fingerprint)


def test_a_pandas_frame_is_named_as_such(weighted: Any) -> None:
    """Both libraries call their table `DataFrame`: the message names the module, and how to
    convert."""
    pytest.importorskip("pandas")
    dataset, table, fingerprint = weighted
    # pandas 2 names the class's module pandas.core.frame, pandas 3 pandas.
    expected = r"got pandas(\.[a-z.]+)?\.DataFrame \(convert it with polars\.from_pandas\)"
    with pytest.raises(TypeError, match=expected):
        dataset.set_samples_metadata(table.to_pandas())
    assert_unchanged(dataset, table, fingerprint)


def test_weights_summing_past_the_largest_float_are_refused(weighted: Any) -> None:
    """Each finite and positive, their sum infinite: every count but the last would be 0, an
    epoch of one sample repeated."""
    dataset, table, fingerprint = weighted
    huge = table.with_columns(
        pl.when(pl.col("sample_id") == 0).then(1.0).otherwise(1.7e308).alias("weight")
    )
    with pytest.raises(SamplesMetadataError, match="sum to more than the largest float"):
        dataset.set_samples_metadata(huge)
    assert_unchanged(dataset, table, fingerprint)
    with pytest.raises(ConfigError, match="sum to more than the largest float"):
        _native.epoch_order(5, 0, 10, 25, True, huge["weight"].to_list())


@pytest.mark.parametrize(
    "dtype", [pl.Int8, pl.Int16, pl.Int32, pl.Int64, pl.UInt8, pl.UInt32, pl.UInt64, pl.Float32]
)
def test_any_integer_or_float_column_gives_weights(weighted: Any, dtype: Any) -> None:
    dataset, table, _ = weighted
    edited = table.with_columns(
        pl.when(pl.col("sample_id") == 3).then(5).otherwise(1).cast(dtype).alias("weight")
    )
    dataset.set_samples_metadata(edited)
    got = dataset.samples_metadata()["weight"].to_list()
    assert got == [5.0 if i == 3 else 1.0 for i in table["sample_id"].to_list()]
    epoch = dataset.state_dict()["epoch"]
    assert ids(dataset) == _native.epoch_order(5, epoch, 10, 25, True, got)


def test_error_quotes_a_bounded_number_of_rows(weighted: Any) -> None:
    dataset, table, fingerprint = weighted
    with pytest.raises(SamplesMetadataError) as refused:
        dataset.set_samples_metadata(table.with_columns(pl.lit(-2.0).alias("weight")))
    message = str(refused.value)
    assert "10 problem(s)" in message
    assert "row 0" in message
    assert "more" in message
    assert len(message) < 2000
    assert_unchanged(dataset, table, fingerprint)


# ---- several caches


def test_caches_with_different_metadata_columns(base_dir: Path) -> None:
    first = make_source(
        "first", [(b"f%d" % i, {"sample_id": i, "label": f"l{i}", "size": i}) for i in range(3)]
    )
    second = make_source(
        "second",
        [(b"s%d" % i, {"sample_id": i, "flag": i == 1, "label": f"m{i}"}) for i in range(2)],
    )
    with Opened(base_dir, [first, second], ReaderConfig(shuffle=False)) as dataset:
        table = dataset.samples_metadata()
        assert table.columns == ["cache_id", "sample_id", "label", "size", "flag", "weight"]
        assert table.schema["size"] == pl.Int64
        assert table.schema["flag"] == pl.Boolean
        assert table["cache_id"].to_list() == ["first"] * 3 + ["second"] * 2
        assert table["sample_id"].to_list() == [0, 1, 2, 0, 1]
        assert table["label"].to_list() == ["l0", "l1", "l2", "m0", "m1"]
        assert table["size"].to_list() == [0, 1, 2, None, None]
        assert table["flag"].to_list() == [None, None, None, False, True]

        # The same sample_id in two caches is two samples: weigh them apart.
        edited = table.with_columns(
            pl.when((pl.col("cache_id") == "second") & (pl.col("sample_id") == 1))
            .then(4.0)
            .otherwise(0.5)
            .alias("weight")
        )
        dataset.set_samples_metadata(edited.reverse())
        assert dataset.samples_metadata()["weight"].to_list() == [0.5, 0.5, 0.5, 0.5, 4.0]
        assert ids(dataset) == [
            [0, 1, 2, 0, 1][g] for g in _native.epoch_order(0, 0, 5, 5, False, [0.5] * 4 + [4.0])
        ]

        # Filling a null where a cache lacks the column changes its metadata: refused.
        filled = edited.with_columns(pl.col("size").fill_null(7))
        with pytest.raises(SamplesMetadataError, match="size"):
            dataset.set_samples_metadata(filled)
        assert dataset.samples_metadata()["weight"].to_list() == [0.5, 0.5, 0.5, 0.5, 4.0]


def test_int_and_str_sample_ids_together(base_dir: Path) -> None:
    ints = make_source("ints", [(b"i%d" % i, {"sample_id": i, "k": "int"}) for i in range(3)])
    strs = make_source("strs", [(b"s%d" % i, {"sample_id": str(i), "k": "str"}) for i in (2, 0)])
    with Opened(base_dir, [ints, strs], ReaderConfig(shuffle=False)) as dataset:
        table = dataset.samples_metadata()
        assert table.schema["sample_id"] == pl.String
        assert table.select("cache_id", "sample_id").rows() == [
            ("ints", "0"),
            ("ints", "1"),
            ("ints", "2"),
            ("strs", "2"),
            ("strs", "0"),
        ]
        edited = table.with_columns(
            pl.when((pl.col("cache_id") == "ints") & (pl.col("sample_id") == "2"))
            .then(9.0)
            .when((pl.col("cache_id") == "strs") & (pl.col("sample_id") == "0"))
            .then(2.0)
            .otherwise(1.0)
            .alias("weight")
        )
        dataset.set_samples_metadata(edited.sample(fraction=1.0, shuffle=True, seed=1))
        assert dataset.samples_metadata().equals(edited)
        # Payloads keep their own id types.
        samples = list(dataset)
        assert {type(s.metadata["sample_id"]) for s in samples[:3]} == {int}

        # An int cache's id written differently ("02") is not its sample.
        renamed = edited.with_columns(
            pl.when((pl.col("cache_id") == "ints") & (pl.col("sample_id") == "2"))
            .then(pl.lit("02"))
            .otherwise(pl.col("sample_id"))
            .alias("sample_id")
        )
        with pytest.raises(SamplesMetadataError, match="02"):
            dataset.set_samples_metadata(renamed)
        assert dataset.samples_metadata().equals(edited)


def test_nan_metadata_is_unchanged_metadata(base_dir: Path) -> None:
    source = make_source(
        "nans", [(b"n%d" % i, {"sample_id": i, "x": math.nan if i else 1.5}) for i in range(3)]
    )
    with Opened(base_dir, source) as dataset:
        table = dataset.samples_metadata()
        dataset.set_samples_metadata(table.with_columns(pl.Series("weight", [1.0, 2.0, 3.0])))
        assert dataset.samples_metadata()["weight"].to_list() == [1.0, 2.0, 3.0]
