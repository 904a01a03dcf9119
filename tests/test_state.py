"""Iterator state: plain JSON data, exact resume at any position with any workers or prefetch,
epochs and set_epoch, and every refused state."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dataset_rt import (
    DataLoader,
    Dataset,
    DatasetRuntime,
    ReaderConfig,
    RuntimeStateError,
    StateError,
    WriterConfig,
    _native,
)
from dataset_rt.testing import make_source

QUIET = WriterConfig(show_progress=False)
STATE_KEYS = {
    "format_version",
    "sampler_version",
    "fingerprint",
    "seed",
    "epoch",
    "position",
    "rank",
    "world_size",
}


def positional_source(name: str, n: int, tag: str = ""):  # type: ignore[no-untyped-def]
    return make_source(
        name, [(f"{name}{tag}:{i}".encode(), {"sample_id": i, "tag": tag}) for i in range(n)]
    )


def ids(samples: Any) -> list[int]:
    return [sample.metadata["sample_id"] for sample in samples]


def take(iterator: Any, k: int) -> list[int]:
    return [next(iterator).metadata["sample_id"] for _ in range(k)]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    restored: dict[str, Any] = json.loads(json.dumps(state))
    return restored


class Opened:
    """A runtime and the dataset it loaded, closed together."""

    def __init__(self, base: Path, source: Any, reader: ReaderConfig, workers: int = 2) -> None:
        self.runtime = DatasetRuntime(num_workers=workers)
        result = self.runtime.from_cache_sources(
            source, base, reader_config=reader, writer_config=QUIET
        )
        self.dataset: Dataset = result.dataset

    def __enter__(self) -> Dataset:
        return self.dataset

    def __exit__(self, *exc: object) -> None:
        self.runtime.close()


def weigh(dataset: Dataset, weights: list[float]) -> None:
    table = dataset.samples_metadata().sort("sample_id")
    dataset.set_samples_metadata(table.with_columns(pl.Series("weight", weights)))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("state")


def test_state_is_plain_json_with_documented_fields(base_dir: Path) -> None:
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=9)) as dataset:
        fresh = dataset.state_dict()
        assert fresh.keys() >= STATE_KEYS
        assert roundtrip(fresh) == fresh
        assert json.loads(json.dumps(fresh, sort_keys=True)) == fresh
        assert fresh["epoch"] == 0
        assert fresh["position"] == 0
        assert fresh["seed"] == 9
        assert fresh["rank"] == 0
        assert fresh["world_size"] == 1
        assert fresh["fingerprint"] == dataset.fingerprint
        assert isinstance(fresh["format_version"], int)
        assert fresh["sampler_version"] == 3
        for value in fresh.values():
            assert isinstance(value, (bool, int, float, str))

        iterator = iter(dataset)
        take(iterator, 3)
        middle = dataset.state_dict()
        assert (middle["epoch"], middle["position"]) == (0, 3)
        assert roundtrip(middle) == middle


def test_state_counts_what_was_received_not_prefetched(base_dir: Path) -> None:
    reader = ReaderConfig(seed=1, prefetch_size=64)
    with Opened(base_dir, positional_source("s40", 40), reader) as dataset:
        iterator = iter(dataset)
        for k in range(1, 8):
            next(iterator)
            assert dataset.state_dict()["position"] == k


def test_state_after_full_epoch_is_next_epoch_at_start(base_dir: Path) -> None:
    source = positional_source("s10", 10)
    with Opened(base_dir, source, ReaderConfig(seed=42)) as dataset:
        first = ids(dataset)
        state = dataset.state_dict()
        assert (state["epoch"], state["position"]) == (1, 0)
        second = ids(dataset)
        assert first == _native.epoch_order(42, 0, 10)
        assert second == _native.epoch_order(42, 1, 10)
        assert (dataset.state_dict()["epoch"], dataset.state_dict()["position"]) == (2, 0)
    with Opened(base_dir, source, ReaderConfig(seed=42), workers=1) as fresh:
        fresh.load_state_dict(roundtrip(state))
        assert ids(fresh) == second


def test_state_after_last_sample_before_stop_iteration(base_dir: Path) -> None:
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=3)) as dataset:
        iterator = iter(dataset)
        take(iterator, 10)
        state = dataset.state_dict()
        # Everything was received: the checkpoint must not replay any sample of epoch 0.
        assert (state["epoch"], state["position"]) in {(1, 0), (0, 10)}
        with pytest.raises(StopIteration):
            next(iterator)
        assert (dataset.state_dict()["epoch"], dataset.state_dict()["position"]) == (1, 0)


def test_abandoned_pass_is_checkpointed_where_it_stopped(base_dir: Path) -> None:
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=5)) as dataset:
        iterator = iter(dataset)
        head = take(iterator, 4)
        del iterator
        state = dataset.state_dict()
        assert (state["epoch"], state["position"]) == (0, 4)
        # A new pass is the next epoch, not a resume.
        assert ids(dataset) == _native.epoch_order(5, 1, 10)
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=5)) as fresh:
        fresh.load_state_dict(state)
        assert head + ids(fresh) == _native.epoch_order(5, 0, 10)


def test_set_epoch_fixes_the_next_pass(base_dir: Path) -> None:
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset:
        dataset.set_epoch(7)
        state = dataset.state_dict()
        assert (state["epoch"], state["position"]) == (7, 0)
        assert ids(dataset) == _native.epoch_order(42, 7, 10)
        assert ids(dataset) == _native.epoch_order(42, 8, 10)
        dataset.set_epoch(1)
        assert ids(dataset) == _native.epoch_order(42, 1, 10)
        dataset.set_epoch(1)
        assert ids(dataset) == _native.epoch_order(42, 1, 10)


def test_state_after_set_epoch_names_that_epoch(base_dir: Path) -> None:
    # The training loop calls set_epoch(e) at the top of each epoch; a checkpoint taken right
    # then must resume epoch e, not the epoch after the previous pass.
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset:
        ids(dataset)
        dataset.set_epoch(5)
        state = dataset.state_dict()
        assert (state["epoch"], state["position"]) == (5, 0)
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as fresh:
        fresh.load_state_dict(state)
        assert ids(fresh) == _native.epoch_order(42, 5, 10)


def test_set_epoch_drops_a_loaded_position(base_dir: Path) -> None:
    source = positional_source("s10", 10)
    with Opened(base_dir, source, ReaderConfig(seed=2)) as dataset:
        iterator = iter(dataset)
        take(iterator, 6)
        state = dataset.state_dict()
    with Opened(base_dir, source, ReaderConfig(seed=2)) as fresh:
        fresh.load_state_dict(state)
        fresh.set_epoch(3)
        assert ids(fresh) == _native.epoch_order(2, 3, 10)


def test_loaded_state_is_reported_until_iterated(base_dir: Path) -> None:
    source = positional_source("s10", 10)
    with Opened(base_dir, source, ReaderConfig(seed=2)) as dataset:
        dataset.set_epoch(4)
        take(iter(dataset), 6)
        state = dataset.state_dict()
    with Opened(base_dir, source, ReaderConfig(seed=2)) as fresh:
        fresh.load_state_dict(state)
        assert fresh.state_dict() == state
        assert len(list(iter(fresh))) == 4


def resume_case(
    base: Path,
    n: int,
    seed: int,
    k: int,
    epoch: int,
    before: tuple[int, int],
    after: tuple[int, int],
    shuffle: bool = True,
    samples_per_epoch: int | None = None,
    weights: list[float] | None = None,
) -> None:
    source = positional_source(f"s{n}", n)

    def reader(prefetch: int) -> ReaderConfig:
        return ReaderConfig(
            seed=seed, shuffle=shuffle, prefetch_size=prefetch, samples_per_epoch=samples_per_epoch
        )

    with Opened(base, source, reader(before[1]), workers=before[0]) as reference:
        if weights is not None:
            weigh(reference, weights)
        reference.set_epoch(epoch)
        full = ids(reference)
    assert full == _native.epoch_order(seed, epoch, n, samples_per_epoch, shuffle, weights)
    with Opened(base, source, reader(before[1]), workers=before[0]) as dataset:
        if weights is not None:
            weigh(dataset, weights)
        ids(dataset)  # the pass under test is not the dataset's first one
        dataset.set_epoch(epoch)
        iterator = iter(dataset)
        head = take(iterator, k)
        state = roundtrip(dataset.state_dict())
        if k < len(full):
            assert (state["epoch"], state["position"]) == (epoch, k)
        else:  # the whole epoch was received
            assert (state["epoch"], state["position"]) == (epoch + 1, 0)
        rest_here = ids(iterator)
    with Opened(base, source, reader(after[1]), workers=after[0]) as resumed:
        if weights is not None:
            weigh(resumed, weights)
        resumed.load_state_dict(state)
        # A state taken after the whole epoch was received resumes at the next epoch.
        tail = ids(resumed) if k < len(full) else []
        following = ids(resumed)  # the pass after a resumed pass is the next epoch
    assert head + rest_here == full
    assert head + tail == full
    assert following == _native.epoch_order(seed, epoch + 1, n, samples_per_epoch, shuffle, weights)


@pytest.mark.parametrize("k", range(0, 14))
def test_resume_at_every_position(base_dir: Path, k: int) -> None:
    resume_case(base_dir, 13, seed=42, k=k, epoch=0, before=(1, 1), after=(3, 64))


def test_resume_at_every_position_of_a_later_weighted_oversampled_epoch(base_dir: Path) -> None:
    weights = [1.0, 5.0, 0.5, 2.0, 3.0, 1.0, 0.25]
    for k in range(0, 20, 3):
        resume_case(
            base_dir,
            7,
            seed=17,
            k=k,
            epoch=3,
            before=(3, 2),
            after=(1, 1),
            samples_per_epoch=19,
            weights=weights,
        )


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    n=st.integers(min_value=1, max_value=40),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    epoch=st.integers(min_value=0, max_value=5),
    shuffle=st.booleans(),
    samples_per_epoch=st.none() | st.integers(min_value=0, max_value=80),
    before=st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 64])),
    after=st.tuples(st.integers(1, 3), st.sampled_from([1, 3, 64])),
)
def test_resume_property(
    base_dir: Path,
    data: st.DataObject,
    n: int,
    seed: int,
    epoch: int,
    shuffle: bool,
    samples_per_epoch: int | None,
    before: tuple[int, int],
    after: tuple[int, int],
) -> None:
    length = n if samples_per_epoch is None else samples_per_epoch
    k = data.draw(st.integers(min_value=0, max_value=length), label="k")
    resume_case(
        base_dir,
        n,
        seed=seed,
        k=k,
        epoch=epoch,
        before=before,
        after=after,
        shuffle=shuffle,
        samples_per_epoch=samples_per_epoch,
    )


def test_resume_of_a_resumed_pass(base_dir: Path) -> None:
    source = positional_source("s40", 40)
    full = _native.epoch_order(8, 2, 40)
    received: list[int] = []
    state: dict[str, Any] | None = None
    for workers, prefetch, k in ((1, 1, 5), (3, 64, 11), (2, 2, 1), (1, 7, 0), (3, 3, 9)):
        with Opened(base_dir, source, ReaderConfig(seed=8, prefetch_size=prefetch), workers) as ds:
            if state is None:
                ds.set_epoch(2)
            else:
                ds.load_state_dict(state)
            received += take(iter(ds), k)
            state = roundtrip(ds.state_dict())
            assert (state["epoch"], state["position"]) == (2, len(received))
    with Opened(base_dir, source, ReaderConfig(seed=8)) as ds:
        assert state is not None
        ds.load_state_dict(state)
        received += ids(ds)
    assert received == full


# ---- weights changed during a pass


def test_state_after_new_weights_mid_pass_describes_the_pass_being_read(base_dir: Path) -> None:
    """Weights set during a pass apply from the next pass, so a checkpoint taken mid-pass names
    the weight table that pass reads under and resumes exactly that pass's order."""
    source = positional_source("s10", 10)
    reader = ReaderConfig(seed=4, samples_per_epoch=30)
    new = [50.0 if i == 3 else 1.0 for i in range(10)]
    full = _native.epoch_order(4, 0, 10, 30)
    with Opened(base_dir, source, reader) as dataset:
        uniform_state = dataset.state_dict()
        iterator = iter(dataset)
        head = take(iterator, 12)
        weigh(dataset, new)
        mid = roundtrip(dataset.state_dict())
        assert (mid["epoch"], mid["position"]) == (0, 12)
        assert mid["weights_fingerprint"] == uniform_state["weights_fingerprint"]
        assert head + ids(iterator) == full
        after = roundtrip(dataset.state_dict())  # the next pass reads under the new weights
        assert (after["epoch"], after["position"]) == (1, 0)
        assert after["weights_fingerprint"] != mid["weights_fingerprint"]
    with Opened(base_dir, source, reader) as resumed:  # the weights that pass read under
        resumed.load_state_dict(mid)
        assert head + ids(resumed) == full
    with Opened(base_dir, source, reader) as weighted:
        weigh(weighted, new)
        with pytest.raises(StateError, match="weight table"):
            weighted.load_state_dict(mid)
        weighted.load_state_dict(after)
        assert ids(weighted) == _native.epoch_order(4, 1, 10, 30, True, new)


def test_new_weights_after_loading_a_state_are_refused_at_the_next_pass(base_dir: Path) -> None:
    source = positional_source("s10", 10)
    with Opened(base_dir, source, ReaderConfig(seed=4)) as dataset:
        take(iter(dataset), 3)
        state = dataset.state_dict()
    with Opened(base_dir, source, ReaderConfig(seed=4)) as dataset:
        dataset.load_state_dict(state)
        weigh(dataset, [float(i + 1) for i in range(10)])
        with pytest.raises(StateError, match="weight table"):
            iter(dataset)
        assert dataset.state_dict() == state
        weigh(dataset, [1.0] * 10)  # the state's (uniform) weights again: it resumes
        assert ids(dataset) == _native.epoch_order(4, 0, 10)[3:]


# ---- a pass that cannot start


def test_failed_start_keeps_the_loaded_state(base_dir: Path) -> None:
    source = positional_source("s10", 10)
    with Opened(base_dir, source, ReaderConfig(seed=6)) as dataset:
        dataset.set_epoch(3)
        take(iter(dataset), 4)
        state = dataset.state_dict()
    opened = Opened(base_dir, source, ReaderConfig(seed=6))
    opened.dataset.load_state_dict(state)
    opened.runtime.close()
    with pytest.raises(RuntimeStateError, match="closed"):
        iter(opened.dataset)
    # The checkpoint was not consumed: it is still what a new runtime would resume.
    assert opened.dataset.state_dict() == state
    with Opened(base_dir, source, ReaderConfig(seed=6)) as fresh:
        fresh.load_state_dict(opened.dataset.state_dict())
        assert ids(fresh) == _native.epoch_order(6, 3, 10)[4:]


def test_failed_start_does_not_advance_the_epoch(base_dir: Path) -> None:
    opened = Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=6))
    opened.dataset.set_epoch(5)
    opened.runtime.close()
    for _ in range(2):
        with pytest.raises(RuntimeStateError, match="closed"):
            iter(opened.dataset)
    state = opened.dataset.state_dict()
    assert (state["epoch"], state["position"]) == (5, 0)


# ---- refused states


@pytest.fixture
def checkpoint(base_dir: Path) -> dict[str, Any]:
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset:
        take(iter(dataset), 4)
        return dataset.state_dict()


def assert_refused(
    base: Path, state: dict[str, Any], match: str, reader: ReaderConfig | None = None
) -> None:
    """The state is refused, and the dataset then reads exactly what it would have read."""
    reader = reader if reader is not None else ReaderConfig(seed=42)
    with Opened(base, positional_source("s10", 10), reader) as dataset:
        before = dataset.state_dict()
        with pytest.raises(StateError, match=match):
            dataset.load_state_dict(state)
        assert dataset.state_dict() == before
        assert ids(dataset) == _native.epoch_order(
            reader.seed, 0, 10, reader.samples_per_epoch, reader.shuffle
        )


def test_state_of_another_dataset_refused(base_dir: Path, checkpoint: dict[str, Any]) -> None:
    # Same name, same number of samples, different content.
    other = base_dir / "other"
    with Opened(other, positional_source("s10", 10, tag="changed"), ReaderConfig(seed=42)) as ds:
        assert ds.fingerprint != checkpoint["fingerprint"]
        with pytest.raises(StateError, match="another dataset"):
            ds.load_state_dict(checkpoint)
        assert ids(ds) == _native.epoch_order(42, 0, 10)


def test_state_of_another_cache_set_refused(base_dir: Path, checkpoint: dict[str, Any]) -> None:
    sources = [positional_source("s10", 10), positional_source("s3", 3)]
    with (
        Opened(base_dir, sources, ReaderConfig(seed=42)) as dataset,
        pytest.raises(StateError, match="another dataset"),
    ):
        dataset.load_state_dict(checkpoint)


def test_state_under_another_weight_table_refused(
    base_dir: Path, checkpoint: dict[str, Any]
) -> None:
    weights = [float(i + 1) for i in range(10)]
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset:
        weigh(dataset, weights)
        with pytest.raises(StateError, match="weight table"):
            dataset.load_state_dict(checkpoint)
        take(iter(dataset), 2)
        weighted_state = dataset.state_dict()
        assert weighted_state["weights_fingerprint"] != checkpoint["weights_fingerprint"]
    # And the other way round: a weighted state into the uniform dataset.
    assert_refused(base_dir, weighted_state, "weight table")
    # Other weights again: refused as well.
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset:
        weigh(dataset, [w + 1.0 for w in weights])
        with pytest.raises(StateError, match="weight table"):
            dataset.load_state_dict(weighted_state)
        weigh(dataset, weights)
        dataset.load_state_dict(weighted_state)
        assert dataset.state_dict()["position"] == 2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"position": 11}, "position 11"),
        ({"format_version": 999}, "version"),
        ({"sampler_version": 2}, "taken under sampler_version 2"),
        ({"sampler_version": None}, "names no sampler_version"),
        ({"seed": 43}, "seed"),
        ({"shuffle": False}, "shuffle"),
        ({"epoch_len": 12}, "epoch_len"),
        ({"surprise": 1}, "surprise"),
        ({"position": -1}, "iterator state"),
        ({"position": "3"}, "iterator state"),
        ({"epoch": 1.5}, "iterator state"),
        ({"fingerprint": "0" * 32}, "another dataset"),
        ({"world_size": 0}, "world_size 0 is not a world size"),
        ({"rank": 1}, "rank 1 is not below world_size 1"),
        ({"rank": 99, "world_size": 4}, "rank 99 is not below world_size 4"),
        ({"epoch": 2**64 - 1}, "epoch 18446744073709551615 is not an epoch"),
    ],
)
def test_tampered_state_refused(
    base_dir: Path, checkpoint: dict[str, Any], change: dict[str, Any], match: str
) -> None:
    assert_refused(base_dir, {**checkpoint, **change}, match)


@pytest.mark.parametrize("key", sorted(STATE_KEYS | {"weights_fingerprint"}))
def test_state_missing_a_key_refused(base_dir: Path, checkpoint: dict[str, Any], key: str) -> None:
    state = {k: v for k, v in checkpoint.items() if k != key}
    assert_refused(base_dir, state, key)


def test_state_of_other_reader_settings_refused(base_dir: Path, checkpoint: dict[str, Any]) -> None:
    assert_refused(base_dir, checkpoint, "seed", ReaderConfig(seed=41))
    assert_refused(base_dir, checkpoint, "shuffle", ReaderConfig(seed=42, shuffle=False))
    assert_refused(base_dir, checkpoint, "epoch_len", ReaderConfig(seed=42, samples_per_epoch=9))


def test_non_dict_state_refused(base_dir: Path) -> None:
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset:
        with pytest.raises(StateError):
            dataset.load_state_dict([1, 2, 3])  # type: ignore[arg-type]
        with pytest.raises(StateError):
            dataset.load_state_dict({})


def test_list_of_the_state_values_refused(base_dir: Path, checkpoint: dict[str, Any]) -> None:
    # The values in field order: a JSON array that serde alone would take as the state.
    assert_refused(base_dir, list(checkpoint.values()), "a state is a JSON object .a dict.")  # type: ignore[arg-type]


def previous_sampler_state(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint as the release before sampler_version 3 wrote it: without that key."""
    return {k: v for k, v in checkpoint.items() if k != "sampler_version"}


def test_a_checkpoint_of_the_previous_sampler_is_refused_clearly(
    base_dir: Path, checkpoint: dict[str, Any]
) -> None:
    # Its position points into a Fisher-Yates order this release no longer computes.
    assert_refused(
        base_dir,
        previous_sampler_state(checkpoint),
        r"names no sampler_version: an earlier DatasetRT took it, under sampler_version 2, and "
        r"this DatasetRT computes epoch orders with sampler_version 3: .* Call set_epoch",
    )


def impossible_states(checkpoint: dict[str, Any]) -> list[tuple[Any, str]]:
    return [
        (list(checkpoint.values()), "this is a list"),
        ({**checkpoint, "world_size": 0}, "world_size 0"),
        ({**checkpoint, "rank": 2, "world_size": 2}, "rank 2 is not below world_size 2"),
        ({**checkpoint, "epoch": 2**64 - 1}, "is not an epoch"),
        (previous_sampler_state(checkpoint), "names no sampler_version"),
    ]


def test_impossible_states_refused_by_the_loader(
    base_dir: Path, checkpoint: dict[str, Any]
) -> None:
    with (
        Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset,
        DataLoader(dataset, batch_size=3) as loader,
    ):
        before = loader.state_dict()
        for state, match in impossible_states(checkpoint):
            with pytest.raises(StateError, match=match):
                loader.load_state_dict(state)
            assert loader.state_dict() == before
        loader.load_state_dict(checkpoint)  # the real state still loads
        assert [s.metadata["sample_id"] for b in loader for s in b] == _native.epoch_order(
            42, 0, 10
        )[4:]


LAST_EPOCH = 2**64 - 2


def test_the_last_epoch_has_no_next_epoch(base_dir: Path) -> None:
    """A pass of the last epoch runs; the epoch after it is an error, never a wrap to 0."""
    with Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset:
        state = {**dataset.state_dict(), "epoch": LAST_EPOCH, "position": 3}
        dataset.load_state_dict(state)
        assert dataset.state_dict() == state
        assert ids(dataset) == _native.epoch_order(42, LAST_EPOCH, 10)[3:]
        for call in (dataset.state_dict, lambda: iter(dataset)):
            with pytest.raises(StateError, match=f"epoch {LAST_EPOCH} is the last.*set_epoch"):
                call()
        dataset.set_epoch(0)
        assert (dataset.state_dict()["epoch"], dataset.state_dict()["position"]) == (0, 0)
        assert ids(dataset) == _native.epoch_order(42, 0, 10)


def test_the_loader_stops_at_the_last_epoch(base_dir: Path) -> None:
    with (
        Opened(base_dir, positional_source("s10", 10), ReaderConfig(seed=42)) as dataset,
        DataLoader(dataset, batch_size=4) as loader,
    ):
        state = {**loader.state_dict(), "epoch": LAST_EPOCH, "position": 3}
        loader.load_state_dict(state)
        got = [s.metadata["sample_id"] for b in loader for s in b]
        assert got == _native.epoch_order(42, LAST_EPOCH, 10)[3:]
        for call in (loader.state_dict, lambda: iter(loader)):
            with pytest.raises(StateError, match=f"epoch {LAST_EPOCH} is the last epoch"):
                call()
        loader.set_epoch(1)
        assert [s.metadata["sample_id"] for b in loader for s in b] == _native.epoch_order(
            42, 1, 10
        )
        assert (loader.state_dict()["epoch"], loader.state_dict()["position"]) == (2, 0)
