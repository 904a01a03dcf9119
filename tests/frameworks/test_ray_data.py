"""Cache sets built by Ray Data on a local cluster (``ray.init(num_cpus=2)``, one per module):
the same blocks give the set that ``CacheSet`` parts give, byte for byte, a failing block is
reported alone, and a rerun writes only what is missing."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from framework_helpers import require

require("ray.data")
import ray  # noqa: E402 (after the skip)

from dataset_rt import (  # noqa: E402
    CacheInput,
    CacheLoaded,
    CacheSet,
    CacheSourcesDatasetSuccess,
    CacheWritten,
    ConfigError,
    DatasetRuntime,
    ReaderConfig,
    RemoteConfig,
    WriterConfig,
)
from dataset_rt.ray import write_cache_set  # noqa: E402
from dataset_rt.testing import ListSource  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    # Ray Data warns about its own deprecated settings when it reads its context.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray.*"),
]

ROOT = Path(__file__).resolve().parents[2]
BLOCKS, PER_BLOCK = 3, 20


def rows() -> list[dict[str, object]]:
    return [
        {"i": i, "label": f"c{i % 4}", "data": bytes((i * 13 + k) % 256 for k in range(40 + i))}
        for i in range(BLOCKS * PER_BLOCK)
    ]


def to_input(row) -> CacheInput:
    return CacheInput(bytes(row["data"]), {"sample_id": int(row["i"]), "label": row["label"]})


@pytest.fixture(scope="module", autouse=True)
def cluster(tmp_path_factory):
    # The workers import this checkout's dataset_rt and this module (its functions), as the
    # driver does.
    extra = filter(None, [os.environ.get("PYTHONPATH")])
    path = os.pathsep.join([str(ROOT), str(Path(__file__).parent), *extra])
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _temp_dir=str(tmp_path_factory.mktemp("ray")),
        runtime_env={"env_vars": {"PYTHONPATH": path}},
    )
    yield
    ray.shutdown()


def files(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def test_ray_writes_the_set_that_processes_write(tmp_path):
    data = rows()
    ds = ray.data.from_items(data, override_num_blocks=BLOCKS)
    results = write_cache_set(
        ds, "s", tmp_path / "ray", to_input, writer_config=WriterConfig(show_progress=False)
    )
    assert [type(r).__name__ for r in results] == ["CacheWritten"] * (BLOCKS + 1)
    assert results[-1].name == "s" and results[-1].num_samples == len(data)

    # The same blocks as CacheSet parts, written by 2 processes.
    parts = [
        ListSource(f"b{b}", [to_input(r) for r in data[b * PER_BLOCK : (b + 1) * PER_BLOCK]])
        for b in range(BLOCKS)
    ]
    with DatasetRuntime(num_workers=2) as runtime:
        built = runtime.from_cache_sources(
            CacheSet("s", parts),
            tmp_path / "procs",
            reader_config=ReaderConfig(seed=3),
            writer_config=WriterConfig(processes=2, show_progress=False),
        )
        assert isinstance(built, CacheSourcesDatasetSuccess)
        opened = runtime.open_caches("s", tmp_path / "ray", reader_config=ReaderConfig(seed=3))
        assert isinstance(opened, CacheSourcesDatasetSuccess)
        assert opened.dataset.fingerprint == built.dataset.fingerprint
        assert [bytes(s.data) for s in opened.dataset] == [bytes(s.data) for s in built.dataset]
    assert files(tmp_path / "ray" / "s") == files(tmp_path / "procs" / "s")

    # Published: a second call writes nothing and reports the set loaded.
    again = write_cache_set(ds, "s", tmp_path / "ray", to_input)
    assert again == [CacheLoaded("s", tmp_path / "ray" / "s", len(data))]


def failing_input(row) -> CacheInput:
    if row["i"] == PER_BLOCK + 5:  # in block 1
        raise ValueError("cannot convert row 25")
    return to_input(row)


def test_a_failing_block_is_reported_and_the_rerun_writes_only_it(tmp_path):
    ds = ray.data.from_items(rows(), override_num_blocks=BLOCKS)
    quiet = WriterConfig(show_progress=False)
    results = write_cache_set(ds, "s", tmp_path, failing_input, writer_config=quiet)
    assert [type(r).__name__ for r in results] == [
        "CacheWritten",
        "CacheWriteError",
        "CacheWritten",
        "CacheWriteError",
    ]
    assert "cannot convert row 25" in results[1].message
    assert "was not published" in results[-1].message
    assert not (tmp_path / "s").exists()
    results = write_cache_set(ds, "s", tmp_path, to_input, writer_config=quiet)
    assert [type(r).__name__ for r in results] == [
        "CacheLoaded",
        "CacheWritten",
        "CacheLoaded",
        "CacheWritten",
    ]
    assert (tmp_path / "s" / "set.json").is_file()


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2", True, None, 3])
def test_threads_per_task_is_checked_before_anything_is_written(tmp_path, threads):
    """An int of at least 1 that a node of the cluster (2 CPUs here) can run: a task asking for
    more CPUs than any node has would wait for ever."""
    ds = ray.data.from_items(rows(), override_num_blocks=BLOCKS)
    quiet = WriterConfig(show_progress=False)
    with pytest.raises(ConfigError, match=r"write_cache_set\.threads_per_task") as raised:
        write_cache_set(
            ds, "s", tmp_path / "b", to_input, writer_config=quiet, threads_per_task=threads
        )
    if threads == 3:
        assert "largest node of the Ray cluster has 2" in str(raised.value)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("argument", "value"),
    [("ray_dataset", [{"x": 1}]), ("name", 5), ("name", None), ("base_cache_dir", 5)],
)
def test_arguments_of_the_wrong_type_are_named(tmp_path, argument, value):
    args = {
        "ray_dataset": ray.data.from_items(rows(), override_num_blocks=BLOCKS),
        "name": "s",
        "base_cache_dir": tmp_path / "b",
        argument: value,
    }
    quiet = WriterConfig(show_progress=False)
    with pytest.raises(ConfigError, match=rf"write_cache_set: {argument} must be"):
        write_cache_set(**args, to_input=to_input, writer_config=quiet)
    assert not (tmp_path / "b").exists()


def test_a_to_input_ray_cannot_send_is_refused_before_anything_is_written(tmp_path):
    """A closure over a lock (or a file, a socket) cannot reach Ray's tasks: the call says so
    and leaves no directory behind, rather than failing half-way with an empty staging area."""
    lock = threading.Lock()

    def holds_a_lock(row) -> CacheInput:
        with lock:
            return to_input(row)

    ds = ray.data.from_items(rows(), override_num_blocks=BLOCKS)
    quiet = WriterConfig(show_progress=False)
    for base in (str(tmp_path / "b"), (tmp_path / "u").as_uri()):
        with pytest.raises(ConfigError, match=r"write_cache_set: to_input cannot be sent to Ray"):
            write_cache_set(ds, "s", base, holds_a_lock, writer_config=quiet)
    assert list(tmp_path.iterdir()) == []


def test_ray_publishes_a_set_at_a_url_that_reads_as_the_local_one(tmp_path):
    """Each task publishes its part at the URL; the set appears once all are, by its manifest.
    A failing block publishes no set, and the rerun writes only that block's part."""
    url = (tmp_path / "bucket").as_uri()
    remote = RemoteConfig(local_dir=tmp_path / "node")
    ds = ray.data.from_items(rows(), override_num_blocks=BLOCKS)
    quiet = WriterConfig(show_progress=False)
    failed = write_cache_set(ds, "s", url, failing_input, writer_config=quiet, remote=remote)
    assert [type(r).__name__ for r in failed] == [
        "CacheWritten",
        "CacheWriteError",
        "CacheWritten",
        "CacheWriteError",
    ]
    assert failed[0].path == f"{url}/s/s.part-000000"
    assert "cannot convert row 25" in failed[-1].message
    assert not (tmp_path / "bucket" / "s" / "set.json").exists()
    results = write_cache_set(ds, "s", url, to_input, writer_config=quiet, remote=remote)
    assert [type(r).__name__ for r in results] == [
        "CacheLoaded",
        "CacheWritten",
        "CacheLoaded",
        "CacheWritten",
    ]
    assert results[-1] == CacheWritten("s", f"{url}/s", len(rows()))
    assert (tmp_path / "bucket" / "s" / "set.json").is_file()

    # The same set as the one Ray writes to a shared directory, sample for sample.
    local = write_cache_set(ds, "s", tmp_path / "shared", to_input, writer_config=quiet)
    assert type(local[-1]).__name__ == "CacheWritten"
    with DatasetRuntime(num_workers=2) as runtime:
        reader = ReaderConfig(seed=3)
        a = runtime.open_caches("s", tmp_path / "shared", reader_config=reader)
        b = runtime.open_caches("s", url, reader_config=reader, remote=remote)
        assert isinstance(a, CacheSourcesDatasetSuccess) and isinstance(
            b, CacheSourcesDatasetSuccess
        )
        assert a.dataset.fingerprint == b.dataset.fingerprint
        assert [bytes(s.data) for s in a.dataset] == [bytes(s.data) for s in b.dataset]
    # Published: a second call writes nothing.
    again = write_cache_set(ds, "s", url, to_input, writer_config=quiet, remote=remote)
    assert again == [CacheLoaded("s", f"{url}/s", len(rows()))]
