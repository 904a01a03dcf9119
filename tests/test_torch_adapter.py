"""The PyTorch adapter: a sized IterableDataset yielding CachedSample, refusing torch worker
processes with a pointer to the right tool, and never imported by ``import dataset_rt``."""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import dataset_rt
from dataset_rt import CachedSample, Dataset, DatasetRuntime, ReaderConfig, WriterConfig, _native
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


@pytest.mark.torch
@pytest.mark.parametrize(
    "context",
    [
        # Torch waits about 5 s per worker that failed to start its iteration: slow.
        pytest.param(None, id="default", marks=pytest.mark.slow),
        pytest.param("spawn", id="spawn"),
    ],
)
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.timeout(120)
def test_dataloader_workers_refused_with_pointer(dataset: Dataset, context: str | None) -> None:
    torch = pytest.importorskip("torch")
    loader = torch.utils.data.DataLoader(
        dataset.to_torch_iterable_dataset(),
        batch_size=None,
        num_workers=2,
        multiprocessing_context=context,
    )
    with pytest.raises(dataset_rt.DatasetRTError) as refused:
        for _ in loader:
            pass
    message = str(refused.value)
    # The traceback holds torch's worker iterator: shut its workers down here, not in a later test.
    del refused
    gc.collect()
    assert WORKERS_HINT in message
    assert "num_workers=0" in message
    assert "dataset_rt.DataLoader" in message  # the shared-memory loader


@pytest.mark.torch
def test_adapter_is_not_picklable(dataset: Dataset) -> None:
    pytest.importorskip("torch")
    with pytest.raises(dataset_rt.DatasetRTError, match=r"DatasetRuntime\(num_workers=N\)"):
        pickle.dumps(dataset.to_torch_iterable_dataset())


def test_torch_iterable_dataset_importable_from_dataset_rt_torch() -> None:
    pytest.importorskip("torch")
    import dataset_rt.torch

    assert "TorchIterableDataset" in dataset_rt.torch.__all__
    assert not (REPO_ROOT / "dataset_rt" / "_torch.py").exists()
