"""The read planner's settings from Python: `ReaderConfig(io_depth=, read_ahead_bytes=)` reach
every read path (in process, batches, the loader's producer with and without workers), which
read the same samples with the same bytes whatever the depth, from a cold page cache too."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loader_helpers import load, payload

from dataset_rt import ConfigError, DataLoader, ReaderConfig

N = 300
SIZE = 5000  # bytes: a record spans pages, so the planner advises ranges of several pages


def evict(base: Path) -> None:
    """Drops every file of the cache from the page cache (they are clean: written and synced)."""
    for root, _, files in os.walk(base):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def in_process(dataset) -> list[tuple[int, bytes]]:
    return [(s.metadata["i"], bytes(s.data)) for s in dataset]


def batched(dataset) -> list[tuple[int, bytes]]:
    # One cache written in source order: a sample's index is its "i".
    return [
        (int(i), bytes(data))
        for b in dataset.iter_batches(16)
        for i, data in zip(b.indices, b.data, strict=True)
    ]


def keyed(sample):
    """A picklable, module-level transform."""
    return sample.metadata["i"], bytes(sample.data)


def loaded(dataset, num_workers: int) -> list[tuple[int, bytes]]:
    with DataLoader(
        dataset, batch_size=16, num_workers=num_workers, transform=keyed, collate_fn=list
    ) as loader:
        return [pair for batch in loader for pair in batch]


PATHS = {
    "iter": in_process,
    "iter_batches": batched,
    "loader-0": lambda ds: loaded(ds, 0),
    "loader-2": lambda ds: loaded(ds, 2),
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("planner-cache")
    load(path, N, SIZE)
    return path


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize(
    "io",
    [
        {"io_depth": 1, "read_ahead_bytes": 1},
        {"io_depth": 1024},
        {"io_depth": 8, "read_ahead_bytes": 3 * SIZE},
    ],
    ids=["depth-1-one-byte", "depth-1024", "depth-8-three-records"],
)
def test_every_path_reads_the_same_samples_at_any_depth_cold_or_warm(base, path, io):
    read = PATHS[path]
    expected = read(load(base, N, SIZE))
    assert sorted(i for i, _ in expected) == list(range(N))
    assert all(data == payload(i, SIZE) for i, data in expected)
    dataset = load(base, N, SIZE, **io)
    evict(base)
    dataset.set_epoch(0)
    assert read(dataset) == expected, "cold"
    dataset.set_epoch(0)
    assert read(dataset) == expected, "warm"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("io_depth", 0),
        ("io_depth", 65537),
        ("io_depth", 2.0),
        ("io_depth", True),
        ("read_ahead_bytes", 0),
        ("read_ahead_bytes", 2**40 + 1),
        ("read_ahead_bytes", -1),
        ("read_ahead_bytes", None),
    ],
)
def test_bad_settings_are_config_errors_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=f"ReaderConfig.{field}"):
        ReaderConfig(**{field: value})


def test_the_bounds_are_accepted():
    ReaderConfig(io_depth=1, read_ahead_bytes=1)
    ReaderConfig(io_depth=65536, read_ahead_bytes=2**40)
