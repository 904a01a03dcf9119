"""The PyTorch adapter: a sized IterableDataset yielding CachedSample, refusing torch worker
processes with a pointer to the right tool, and never imported by ``import dataset_rt``."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loader_helpers import views_a_shard_map

import dataset_rt
from dataset_rt import (
    CachedSample,
    ConfigError,
    Dataset,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
    _native,
)
from dataset_rt.testing import make_source

REPO_ROOT = Path(dataset_rt.__file__).resolve().parent.parent
QUIET = WriterConfig(show_progress=False)
WORKERS_HINT = "DatasetRuntime(num_workers=N)"


def source(n: int = 12):  # type: ignore[no-untyped-def]
    return make_source(
        "torch_src", [(b"p%03d" % i, {"sample_id": i, "y": i % 2}) for i in range(n)]
    )


@pytest.fixture
def dataset(tmp_path: Path) -> Iterator[Dataset]:
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            source(), tmp_path, reader_config=ReaderConfig(seed=42), writer_config=QUIET
        )
        yield result.dataset


def test_import_dataset_rt_does_not_import_torch() -> None:
    code = (
        "import sys, dataset_rt\n"
        "from dataset_rt import DatasetRuntime, ReaderConfig, Dataset\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_loading_and_reading_do_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from dataset_rt import DatasetRuntime, ReaderConfig, WriterConfig\n"
        "from dataset_rt.testing import make_source\n"
        "src = make_source('s', [(b'abc', {'sample_id': 1})])\n"
        "with DatasetRuntime(num_workers=1) as rt:\n"
        "    ds = rt.from_cache_sources(src, Path(sys.argv[1]),\n"
        "        writer_config=WriterConfig(show_progress=False)).dataset\n"
        "    assert [bytes(s.data) for s in ds] == [b'abc']\n"
        "    ds.state_dict(); ds.samples_metadata()\n"
        "assert 'torch' not in sys.modules\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


@pytest.mark.torch
def test_is_a_sized_iterable_dataset(dataset: Dataset) -> None:
    torch = pytest.importorskip("torch")
    torch_dataset = dataset.to_torch_iterable_dataset()
    assert isinstance(torch_dataset, torch.utils.data.IterableDataset)
    assert len(torch_dataset) == len(dataset) == 12
    samples = list(torch_dataset)
    assert all(isinstance(s, CachedSample) for s in samples)
    assert [s.metadata["sample_id"] for s in samples] == _native.epoch_order(42, 0, 12)


@pytest.mark.torch
def test_len_follows_rank_and_epoch_length(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    with DatasetRuntime(num_workers=1) as runtime:
        reader = ReaderConfig(seed=1, rank=1, world_size=5, samples_per_epoch=23)
        ds = runtime.from_cache_sources(
            source(), tmp_path, reader_config=reader, writer_config=QUIET
        ).dataset
        torch_dataset = ds.to_torch_iterable_dataset()
        assert len(torch_dataset) == len(ds) == 5
        assert len(list(torch_dataset)) == 5


@pytest.mark.torch
def test_dataloader_without_workers_equals_direct_iteration(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with DatasetRuntime(num_workers=2) as runtime:
        direct = runtime.from_cache_sources(
            source(), tmp_path, reader_config=ReaderConfig(seed=42), writer_config=QUIET
        ).dataset
        adapted = runtime.from_cache_sources(
            source(), tmp_path, reader_config=ReaderConfig(seed=42), writer_config=QUIET
        ).dataset
        loader = torch.utils.data.DataLoader(
            adapted.to_torch_iterable_dataset(), batch_size=None, num_workers=0
        )
        assert len(loader) == 12
        for _epoch in range(2):  # each pass over the loader is the dataset's next epoch
            expected = list(direct)
            received = list(loader)
            assert all(type(s) is CachedSample for s in received)
            assert [s.metadata for s in received] == [s.metadata for s in expected]
            assert [bytes(s.data) for s in received] == [bytes(s.data) for s in expected]
            # Payloads are passed through untouched: still the zero-copy views.
            assert all(isinstance(s.data, memoryview) for s in received)
        assert adapted.state_dict() == {**direct.state_dict()}


@pytest.mark.torch
def test_set_epoch_and_state_through_the_adapter(dataset: Dataset) -> None:
    torch = pytest.importorskip("torch")
    loader = torch.utils.data.DataLoader(
        dataset.to_torch_iterable_dataset(), batch_size=None, num_workers=0
    )
    dataset.set_epoch(4)
    iterator = iter(loader)
    head = [next(iterator).metadata["sample_id"] for _ in range(5)]
    state = dataset.state_dict()
    assert (state["epoch"], state["position"]) == (4, 5)
    assert head == _native.epoch_order(42, 4, 12)[:5]


def _run_refused(dataset: Dataset, context: str) -> tuple[str, str, float]:
    """Iterates torch's DataLoader with 2 workers over the adapter; returns where the refusal
    was raised ("iter" or "next"), its message and the seconds it took. No batch may arrive."""
    torch = pytest.importorskip("torch")
    loader = torch.utils.data.DataLoader(
        dataset.to_torch_iterable_dataset(),
        batch_size=4,
        num_workers=2,
        multiprocessing_context=context,
    )
    started = time.monotonic()
    stage, message = "iter", ""
    try:
        iterator = iter(loader)
        stage = "next"
        batch = next(iterator)
        pytest.fail(f"a batch arrived through torch workers: {batch!r}")
    except ConfigError as refused:
        message = str(refused)
    seconds = time.monotonic() - started
    # The handled exception's traceback held torch's iterator: shut its workers down here, not
    # in a later test.
    iterator = None
    gc.collect()
    assert message
    return stage, message, seconds


def _assert_points_to_parallel_path(message: str) -> None:
    assert "dataset_rt.torch.DataLoader" in message  # the parallel path
    assert "num_workers=0" in message
    assert WORKERS_HINT in message


@pytest.mark.torch
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
@pytest.mark.timeout(120)
def test_torch_workers_refused_by_iter_in_the_training_process(
    dataset: Dataset, context: str
) -> None:
    # Torch pickles the dataset for spawn/forkserver workers in the training process, before any
    # worker runs: the adapter's refusal is raised there, by iter(), with its own message.
    stage, message, _ = _run_refused(dataset, context)
    assert stage == "iter"
    assert "DataLoader worker process" not in message  # not wrapped in a worker's traceback
    assert message.startswith("DatasetRT's torch IterableDataset runs in the training process")
    _assert_points_to_parallel_path(message)


@pytest.mark.torch
# Torch's own shutdown of workers whose iteration failed to start waits about 5 s per worker
# (the refusal itself arrives at once): slow.
@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.timeout(120)
def test_torch_fork_workers_refused_at_the_first_batch(dataset: Dataset) -> None:
    # With fork torch calls nothing of the dataset in the training process before its workers
    # run: the earliest place is the first next(), where torch re-raises the workers' refusal
    # (the same ConfigError, the worker's traceback around the message), at once.
    stage, message, seconds = _run_refused(dataset, "fork")
    assert stage == "next"
    assert "DataLoader worker process" in message
    _assert_points_to_parallel_path(message)
    assert seconds < 10, seconds


@pytest.mark.torch
def test_adapter_is_not_picklable(dataset: Dataset) -> None:
    pytest.importorskip("torch")
    with pytest.raises(dataset_rt.DatasetRTError, match=r"DatasetRuntime\(num_workers=N\)"):
        pickle.dumps(dataset.to_torch_iterable_dataset())


def typed_source(n: int, name: str = "typed_src"):  # type: ignore[no-untyped-def]
    return make_source(
        name,
        [
            (
                b"payload-%03d" % i * (1 + i % 3),
                {"sample_id": i, "f": i / 4, "b": i % 2 == 0, "s": f"n{i}"},
            )
            for i in range(n)
        ],
    )


def open_dataset(runtime: DatasetRuntime, base: Path, source: Any, **writer: Any) -> Dataset:
    return runtime.from_cache_sources(
        source,
        base,
        reader_config=ReaderConfig(seed=7),
        writer_config=WriterConfig(show_progress=False, **writer),
    ).dataset


@pytest.mark.torch
@pytest.mark.parametrize("batch_size", [64, 1, 150])
def test_torch_batches_equal_per_sample_iteration(tmp_path: Path, batch_size: int) -> None:
    torch = pytest.importorskip("torch")
    with DatasetRuntime(num_workers=2) as runtime:
        direct = open_dataset(runtime, tmp_path, typed_source(150))
        adapted = open_dataset(runtime, tmp_path, typed_source(150))
        loader = torch.utils.data.DataLoader(
            adapted.to_torch_iterable_dataset(), batch_size=batch_size
        )
        assert len(loader) == -(-150 // batch_size)
        for _epoch in range(2):  # each pass over the loader is the dataset's next epoch
            expected = list(direct)
            batches = list(loader)
            sizes = [len(b["data"]) for b in batches]
            assert sizes == [batch_size] * (150 // batch_size) + [150 % batch_size] * (
                150 % batch_size > 0
            )
            received_ids = [i for b in batches for i in b["metadata"]["sample_id"].tolist()]
            assert received_ids == [s.metadata["sample_id"] for s in expected]
            received = [bytes(d) for b in batches for d in b["data"]]
            assert received == [bytes(s.data) for s in expected]
            for b in batches:
                assert set(b) == {"data", "metadata"}
                assert isinstance(b["data"], list)
                # The samples' own zero-copy views of the shard's mapping, not copies.
                assert all(isinstance(d, memoryview) for d in b["data"])
                assert all(views_a_shard_map(d) for d in b["data"])
        assert adapted.state_dict() == direct.state_dict()


@pytest.mark.torch
def test_torch_batch_metadata_dtypes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with DatasetRuntime(num_workers=1) as runtime:
        ds = open_dataset(runtime, tmp_path, typed_source(10))
        loader = torch.utils.data.DataLoader(ds.to_torch_iterable_dataset(), batch_size=4)
        batch = next(iter(loader))
    metadata = batch["metadata"]
    assert list(metadata) == ["sample_id", "f", "b", "s"]  # schema order
    assert metadata["sample_id"].dtype == torch.int64
    assert metadata["f"].dtype == torch.float64
    assert metadata["b"].dtype == torch.bool
    assert isinstance(metadata["s"], list)
    ids = metadata["sample_id"].tolist()
    assert metadata["f"].tolist() == [i / 4 for i in ids]
    assert metadata["b"].tolist() == [i % 2 == 0 for i in ids]
    assert metadata["s"] == [f"n{i}" for i in ids]


@pytest.mark.torch
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize(("n", "batch_size"), [(150, 64), (128, 64), (10, 64)])
def test_torch_drop_last_as_torch_does(
    tmp_path: Path, drop_last: bool, n: int, batch_size: int
) -> None:
    torch = pytest.importorskip("torch")

    class Reference(torch.utils.data.IterableDataset):  # type: ignore[misc]
        def __iter__(self) -> Iterator[int]:
            return iter(range(n))

        def __len__(self) -> int:
            return n

    reference = torch.utils.data.DataLoader(Reference(), batch_size=batch_size, drop_last=drop_last)
    with DatasetRuntime(num_workers=1) as runtime:
        ds = open_dataset(runtime, tmp_path, typed_source(n))
        loader = torch.utils.data.DataLoader(
            ds.to_torch_iterable_dataset(), batch_size=batch_size, drop_last=drop_last
        )
        assert len(loader) == len(reference)
        assert [len(b["data"]) for b in loader] == [len(b) for b in reference]
        order = _native.epoch_order(7, 1, n)  # the second pass reads epoch 1
        kept = [i for b in loader for i in b["metadata"]["sample_id"].tolist()]
        assert kept == order[: len(kept)]


@pytest.mark.torch
def test_torch_batch_views_outlive_later_batches_epochs_and_the_runtime(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    runtime = DatasetRuntime(num_workers=2)
    try:
        ds = open_dataset(runtime, tmp_path, typed_source(150))
        loader = torch.utils.data.DataLoader(ds.to_torch_iterable_dataset(), batch_size=64)
        kept = next(iter(loader))
        for _epoch in range(2):
            assert len(list(loader)) == 3
    finally:
        runtime.close()
    del ds, loader
    gc.collect()
    ids = kept["metadata"]["sample_id"].tolist()
    assert [bytes(d) for d in kept["data"]] == [b"payload-%03d" % i * (1 + i % 3) for i in ids]


@pytest.mark.torch
def test_torch_compressed_payloads_collate_as_bytes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with DatasetRuntime(num_workers=1) as runtime:
        source = make_source("lz4_src", [(b"a" * 4096, {"sample_id": i}) for i in range(8)])
        ds = open_dataset(
            runtime, tmp_path, source, shard_compression=ShardCompression(algo="lz4", ratio=0.9)
        )
        batch = next(
            iter(torch.utils.data.DataLoader(ds.to_torch_iterable_dataset(), batch_size=8))
        )
    assert [type(d) for d in batch["data"]] == [bytes] * 8
    assert all(d == b"a" * 4096 for d in batch["data"])


@pytest.mark.torch
def test_torch_pin_memory_keeps_the_payload_views(dataset: Dataset) -> None:
    torch = pytest.importorskip("torch")
    from torch.utils.data._utils.pin_memory import pin_memory

    batch = next(
        iter(torch.utils.data.DataLoader(dataset.to_torch_iterable_dataset(), batch_size=5))
    )
    # Tensors need an accelerator to pin; the payload list is what must come through unchanged.
    pinned = pin_memory(batch["data"])
    assert [type(d) for d in pinned] == [memoryview] * 5
    assert [bytes(d) for d in pinned] == [bytes(d) for d in batch["data"]]


@pytest.mark.torch
def test_torch_batch_mixing_metadata_schemas_names_the_fields(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    with DatasetRuntime(num_workers=1) as runtime:
        first = make_source("first", [(b"x", {"sample_id": i, "label": i}) for i in range(3)])
        second = make_source("second", [(b"y", {"sample_id": i, "name": "n"}) for i in range(3)])
        ds = runtime.from_cache_sources(
            [first, second],
            tmp_path,
            reader_config=ReaderConfig(shuffle=False),
            writer_config=QUIET,
        ).dataset
        loader = torch.utils.data.DataLoader(ds.to_torch_iterable_dataset(), batch_size=6)
        with pytest.raises(
            ValueError,
            match=(
                r"sample 3 of the batch has the fields \['name', 'sample_id'\], "
                r"sample 0 has \['label', 'sample_id'\]"
            ),
        ):
            next(iter(loader))


@pytest.mark.torch
def test_torch_default_collate_registered_by_creating_the_adapter(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from dataset_rt import DatasetRuntime, WriterConfig\n"
        "from dataset_rt.testing import make_source\n"
        "src = make_source('s', [(b'abc', {'sample_id': 1}), (b'de', {'sample_id': 2})])\n"
        "with DatasetRuntime(num_workers=1) as rt:\n"
        "    ds = rt.from_cache_sources(src, Path(sys.argv[1]),\n"
        "        writer_config=WriterConfig(show_progress=False)).dataset\n"
        "    assert 'dataset_rt.torch' not in sys.modules\n"
        "    adapter = ds.to_torch_iterable_dataset()\n"
        "    from torch.utils.data import default_collate\n"
        "    batch = default_collate(list(adapter))\n"
        "    print(sorted(bytes(d) for d in batch['data']), batch['metadata']['sample_id'].dtype)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[b'abc', b'de'] torch.int64"


@pytest.mark.torch
def test_torch_collate_registration_keeps_the_users_own() -> None:
    code = (
        "from torch.utils.data import default_collate\n"
        "from torch.utils.data._utils.collate import default_collate_fn_map\n"
        "from dataset_rt import CachedSample\n"
        "default_collate_fn_map[CachedSample] = lambda batch, collate_fn_map: 'mine'\n"
        "import dataset_rt.torch\n"
        "print(default_collate([CachedSample(b'x', {'a': 1})]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "mine"


@pytest.mark.torch
def test_adapter_and_loader_collate_to_the_same_structure(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from dataset_rt.torch import DataLoader

    with DatasetRuntime(num_workers=1) as runtime:
        ds = open_dataset(runtime, tmp_path, typed_source(20))
        ds.set_epoch(3)
        through_torch = list(
            torch.utils.data.DataLoader(ds.to_torch_iterable_dataset(), batch_size=8)
        )
        with DataLoader(ds, batch_size=8) as loader:
            loader.set_epoch(3)
            through_loader = list(loader)
    assert len(through_torch) == len(through_loader) == 3
    for a, b in zip(through_torch, through_loader, strict=True):
        assert set(a) == set(b) == {"data", "metadata"}
        assert [bytes(d) for d in a["data"]] == [bytes(d) for d in b["data"]]
        assert list(a["metadata"]) == list(b["metadata"])
        for field, value in a["metadata"].items():
            other = b["metadata"][field]
            assert type(value) is type(other)
            if isinstance(value, torch.Tensor):
                assert value.dtype == other.dtype
                assert torch.equal(value, other)
            else:
                assert value == other


def test_torch_iterable_dataset_importable_from_dataset_rt_torch() -> None:
    pytest.importorskip("torch")
    import dataset_rt.torch

    assert "TorchIterableDataset" in dataset_rt.torch.__all__
    assert not (REPO_ROOT / "dataset_rt" / "_torch.py").exists()
