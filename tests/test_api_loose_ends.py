"""The Python API as a new user meets it: loading existing caches without a source, clear errors
for a wrong DataLoader argument, a base directory that is a file and non-bool flags, metadata
as any Mapping, and which dependencies the package really imports."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import dataset_rt
from dataset_rt import (
    CacheLoaded,
    CacheMalformed,
    CacheMissing,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWriteError,
    CacheWritten,
    ConfigError,
    DatasetRuntime,
    ReaderConfig,
    WriterConfig,
)
from dataset_rt.testing import assert_cache_equal, make_source, truncate_file

REPO = Path(__file__).resolve().parents[1]
QUIET = WriterConfig(show_progress=False)
IN_ORDER = ReaderConfig(shuffle=False)


def write(runtime: DatasetRuntime, sources: Any, base: Path) -> Any:
    return runtime.from_cache_sources(sources, base, reader_config=IN_ORDER, writer_config=QUIET)


def samples(name: str, n: int = 3) -> Any:
    return make_source(name, [(bytes([i]) * (i + 1), {"i": i}) for i in range(n)])


def listing(base: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `base` (itself included): mode, size and mtime in nanoseconds."""
    seen = {}
    for root, dirs, files in os.walk(base):
        for entry in [root, *(os.path.join(root, n) for n in dirs + files)]:
            st = os.lstat(entry)
            seen[os.path.relpath(entry, base)] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


# --- open_caches: load only


def test_open_caches_returns_what_from_cache_sources_returns(runtime, tmp_path):
    base = tmp_path / "base"
    a, b = samples("a"), samples("b", 5)
    written = write(runtime, [a, b], base)
    assert [type(r) for r in written.results] == [CacheWritten, CacheWritten]

    loaded = write(runtime, [a, b], base)
    opened = runtime.open_caches(["a", "b"], base, reader_config=IN_ORDER)

    assert isinstance(opened, CacheSourcesDatasetSuccess)
    assert opened.results == loaded.results
    assert opened.results == [CacheLoaded("a", base / "a", 3), CacheLoaded("b", base / "b", 5)]
    assert opened.dataset.fingerprint == loaded.dataset.fingerprint
    assert opened.dataset.cache_names == ["a", "b"]
    assert_cache_equal(runtime.open_caches("b", base, reader_config=IN_ORDER).dataset, b)
    match runtime.open_caches(("a",), str(base)):
        case CacheSourcesDatasetSuccess(dataset, [CacheLoaded("a", path, 3)]):
            assert path == base / "a"
            assert len(dataset) == 3
        case other:
            pytest.fail(f"unexpected {other}")


def test_open_caches_takes_the_reader_config(runtime, tmp_path):
    base = tmp_path / "base"
    write(runtime, [samples("a", 10)], base)
    config = ReaderConfig(seed=7, rank=1, world_size=2, drop_last=True)
    opened = runtime.open_caches("a", base, reader_config=config)
    from_sources = runtime.from_cache_sources(samples("a", 10), base, reader_config=config)
    assert (opened.dataset.rank, opened.dataset.world_size) == (1, 2)
    order = [s.metadata["i"] for s in opened.dataset]
    assert order == [s.metadata["i"] for s in from_sources.dataset]
    assert len(order) == 5


def test_missing_caches_are_reported_and_nothing_is_created(runtime, tmp_path):
    base = tmp_path / "base"
    write(runtime, [samples("a")], base)
    before = listing(tmp_path)

    partly = runtime.open_caches(["a", "b"], base)
    assert isinstance(partly, CacheSourcesDatasetSuccess)
    assert partly.results[0] == CacheLoaded("a", base / "a", 3)
    match partly.results[1]:
        case CacheMissing("b", path, message):
            assert path == base / "b"
            assert str(base / "b") in message
            assert "from_cache_sources" in message
        case other:
            pytest.fail(f"unexpected {other}")

    nowhere = tmp_path / "nowhere" / "deeper"
    none = runtime.open_caches(["a"], nowhere)
    assert isinstance(none, CacheSourcesDatasetError)
    assert [type(r) for r in none.results] == [CacheMissing]
    assert "no cache could be loaded" in none.message
    assert listing(tmp_path) == before
    assert not (tmp_path / "nowhere").exists()


def test_malformed_caches_are_reported_as_from_cache_sources_reports_them(runtime, tmp_path):
    base = tmp_path / "base"
    write(runtime, [samples("good"), samples("bad")], base)
    truncate_file(base / "bad" / "index.bin")

    opened = runtime.open_caches(["good", "bad"], base)
    via_sources = write(runtime, [samples("good"), samples("bad")], base)

    assert isinstance(opened, CacheSourcesDatasetSuccess)
    assert isinstance(opened.results[1], CacheMalformed)
    assert "index.bin" in opened.results[1].message
    assert opened.results == via_sources.results
    only_bad = runtime.open_caches("bad", base)
    assert isinstance(only_bad, CacheSourcesDatasetError)
    assert "bad: CacheMalformed" in only_bad.message


def test_open_caches_writes_nothing_under_the_base_directory(runtime, tmp_path):
    base = tmp_path / "base"
    write(runtime, [samples("a"), samples("b")], base)
    # What a load could create or remove: the lock file (removed here, so that creating it
    # shows) and a dead writer's temporary directory, which from_cache_sources reaps.
    (base / ".a.lock").unlink()
    leftover = base / ".a.tmp-999999-1"
    leftover.mkdir()
    (leftover / "shard").write_bytes(b"partial")
    before = listing(base)

    for validate in (False, True):
        opened = runtime.open_caches(
            ["a", "b", "c"], base, reader_config=ReaderConfig(validate_cache=validate)
        )
        assert [type(r) for r in opened.results] == [CacheLoaded, CacheLoaded, CacheMissing]
        assert len(list(opened.dataset)) == 6
        opened.dataset.samples_metadata()
    assert listing(base) == before

    # The same listing does see what from_cache_sources does when it loads (its reaping needs
    # the lock file, proof that no writer is alive).
    (base / ".a.lock").touch()
    write(runtime, [samples("a")], base)
    assert not leftover.exists()
    assert listing(base) != before


CHILD = textwrap.dedent(
    """
    import sys
    from dataset_rt import CacheLoaded, CacheMissing, DatasetRuntime

    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.open_caches(["a", "missing"], sys.argv[1])
        assert [type(r) for r in result.results] == [CacheLoaded, CacheMissing], result
        print(sum(len(bytes(s.data)) for s in result.dataset))
    """
)


def unprivileged() -> list[str]:
    """The prefix that runs a child without root's bypass of mode bits (skips without
    setpriv)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only directory is not read-only")
    caps = "-dac_override,-dac_read_search,-fowner"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}"]


def test_open_caches_works_on_a_read_only_base_directory(runtime, tmp_path):
    base = tmp_path / "base"
    write(runtime, [samples("a", 4)], base)
    (base / ".a.lock").unlink()
    base.chmod(0o555)
    # Root ignores mode bits: as root, the loading child runs without the capabilities that
    # bypass them (it would write where others cannot).
    prefix = unprivileged()
    try:
        before = listing(base)
        child = subprocess.run(
            [*prefix, sys.executable, "-c", CHILD, str(base)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert child.returncode == 0, child.stderr
        assert child.stdout.strip() == "10"  # 1 + 2 + 3 + 4 bytes
        assert listing(base) == before
        assert stat.S_IMODE(base.stat().st_mode) == 0o555
        # The same child really cannot write there.
        refused = subprocess.run(
            [*prefix, sys.executable, "-c", f"open({str(base / 'x')!r}, 'w')"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "PermissionError" in refused.stderr
    finally:
        base.chmod(0o755)


DENIED_CHILD = textwrap.dedent(
    """
    import sys
    from dataset_rt import CacheInput, DatasetRuntime, WriterConfig
    class Source:
        name = sys.argv[2]
        def __iter__(self):
            yield CacheInput(b"x")
    with DatasetRuntime(num_workers=1) as runtime:
        try:
            result = runtime.from_cache_sources(
                Source(), sys.argv[1], writer_config=WriterConfig(show_progress=False)
            )
            print(type(result.results[0]).__name__, result.results[0].message)
        except OSError as e:
            print(type(e).__name__, e)
    """
)


@pytest.mark.parametrize(("mode", "name"), [(0o555, "new"), (0o000, "a")])
def test_a_base_directory_that_denies_access_is_reported_as_denied(runtime, tmp_path, mode, name):
    """A read-only base directory refuses the lock file of a new cache: the write error says
    so (not that the lock file does not exist). One that may not be searched holds a published
    cache that cannot be read: ``PermissionError``, as ``open_caches`` raises, never a write."""
    base = tmp_path / "base"
    write(runtime, [samples("a", 4)], base)
    prefix = unprivileged()
    base.chmod(mode)
    try:
        child = subprocess.run(
            [*prefix, sys.executable, "-c", DENIED_CHILD, str(base), name],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    finally:
        base.chmod(0o755)
    assert child.returncode == 0, child.stderr
    out = child.stdout.strip()
    if mode == 0o555:
        assert out.startswith("CacheWriteError") and "Permission denied" in out, out
        assert "No such file" not in out, out
    else:
        assert out.startswith("PermissionError") and str(base / "a") in out, out
    assert sorted(p.name for p in base.iterdir()) == [".a.lock", "a"]


@pytest.mark.parametrize(
    ("names", "needle"),
    [
        (["a", "a"], 'two caches are named "a"'),
        ([], "at least one name"),
        (3, "names must be a str or a list or tuple of str, got int"),
        (Path("a"), "got PosixPath"),
        (["a", 1], "name 1 must be a str, got int 1"),
        (["../a"], "invalid cache name"),
        ([".hidden"], "invalid cache name"),
        (["bad\udcff"], "not valid UTF-8"),
    ],
)
def test_bad_names_are_refused_before_anything_is_read(runtime, tmp_path, names, needle):
    with pytest.raises(ConfigError, match=needle):
        runtime.open_caches(names, tmp_path / "base")
    assert not (tmp_path / "base").exists()


def test_open_caches_on_a_closed_runtime_raises(tmp_path):
    runtime = DatasetRuntime(num_workers=1)
    runtime.close()
    with pytest.raises(dataset_rt.RuntimeStateError):
        runtime.open_caches("a", tmp_path)


# --- a base directory that is a file


@pytest.mark.parametrize("below", [False, True], ids=["the_file", "below_the_file"])
@pytest.mark.parametrize("call", ["from_cache_sources", "open_caches"])
def test_a_base_directory_that_is_a_file_says_not_a_directory(runtime, tmp_path, below, call):
    file = tmp_path / "file"
    file.write_bytes(b"x")
    base = file / "below" if below else file
    with pytest.raises(ConfigError, match="not a directory") as info:
        if call == "open_caches":
            runtime.open_caches("c", base)
        else:
            write(runtime, samples("c"), base)
    assert str(file) in str(info.value)
    assert "base_cache_dir" in str(info.value)
    assert file.read_bytes() == b"x"


@pytest.mark.parametrize("call", ["from_cache_sources", "open_caches"])
def test_a_file_where_a_cache_should_be_is_a_malformed_cache_and_the_others_go_on(
    runtime, tmp_path, call
):
    base = tmp_path / "base"
    write(runtime, samples("first"), base)
    (base / "clash").write_bytes(b"not a cache")
    if call == "open_caches":
        write(runtime, samples("last"), base)
        result = runtime.open_caches(["first", "clash", "last"], base)
    else:
        result = write(runtime, [samples("first"), samples("clash"), samples("last")], base)
    assert isinstance(result, CacheSourcesDatasetSuccess)
    first, clash, last = result.results
    assert first == CacheLoaded("first", base / "first", 3)
    assert isinstance(last, CacheWritten if call == "from_cache_sources" else CacheLoaded)
    match clash:
        case CacheMalformed("clash", path, message):
            assert path == base / "clash"
            assert "not a directory" in message and str(base / "clash") in message
        case other:
            pytest.fail(f"unexpected {other}")
    assert (base / "clash").read_bytes() == b"not a cache"
    assert len(result.dataset) == 6


def test_a_directory_where_a_manifest_should_be_is_a_malformed_cache_and_the_others_go_on(
    runtime, tmp_path
):
    base = tmp_path / "base"
    write(runtime, [samples("first"), samples("bad"), samples("last")], base)
    manifest = base / "bad" / "manifest.json"
    manifest.chmod(0o644)
    manifest.unlink()
    manifest.mkdir()
    result = runtime.from_cache_sources([samples("first"), samples("bad"), samples("last")], base)
    assert isinstance(result, CacheSourcesDatasetSuccess)
    first, bad, last = result.results
    assert isinstance(first, CacheLoaded) and isinstance(last, CacheLoaded)
    match bad:
        case CacheMalformed("bad", path, message):
            assert path == base / "bad"
            assert str(manifest) in message and "not a regular file" in message
        case other:
            pytest.fail(f"unexpected {other}")
    assert len(result.dataset) == 6


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cache_opened_by_a_relative_path_is_read_after_the_process_changes_directory(
    runtime, tmp_path, monkeypatch, num_workers
):
    # Hydra, for one, changes the working directory after the data is set up.
    monkeypatch.chdir(tmp_path)
    result = write(runtime, samples("c", 7), Path("caches"))
    assert result.results[0].path == Path("caches") / "c"
    elsewhere = tmp_path / "run"
    # The same relative path there names another cache, which must not be read instead.
    write(runtime, samples("c", 5), elsewhere / "caches")
    monkeypatch.chdir(elsewhere)
    loader = dataset_rt.DataLoader(result.dataset, 3, num_workers=num_workers)
    try:
        got = [bytes(s.data) for batch in loader for s in batch]
    finally:
        loader.close()
    assert got == [bytes([i]) * (i + 1) for i in range(7)]
    assert [bytes(s.data) for s in result.dataset] == got


def test_a_batch_size_beyond_the_epoch_sizes_slots_for_the_epoch(runtime, tmp_path):
    result = write(runtime, samples("c", 50), tmp_path)
    for batch_size in [2**24, 2**40]:
        loader = dataset_rt.DataLoader(result.dataset, batch_size, num_workers=0)
        try:
            it = iter(loader)
            (batch,) = list(it)
            assert len(batch) == 50
            # A batch of 50 of these samples fits a few pages, not gigabytes.
            assert it.slot_size < 1 << 20, it.slot_size
        finally:
            loader.close()


# --- bool config fields


READER_BOOLS = ["shuffle", "validate_cache", "drop_last"]
WRITER_BOOLS = ["show_progress", "validate_cache"]


@pytest.mark.parametrize("value", [1, 0, None, "yes", 1.0, [True]])
@pytest.mark.parametrize(
    ("config", "field"),
    [(ReaderConfig, f) for f in READER_BOOLS] + [(WriterConfig, f) for f in WRITER_BOOLS],
)
def test_bool_fields_refuse_other_types(config, field, value):
    with pytest.raises(ConfigError) as info:
        config(**{field: value})
    assert str(info.value) == (f"invalid {config.__name__}.{field}: expected a bool, got {value!r}")


@pytest.mark.parametrize(
    ("config", "field"),
    [(ReaderConfig, f) for f in READER_BOOLS] + [(WriterConfig, f) for f in WRITER_BOOLS],
)
def test_bool_fields_take_bools_and_numpy_bools(config, field):
    for value in (True, False, np.True_, np.False_):
        assert getattr(config(**{field: value}), field) == value


def test_numpy_bools_act_as_bools(runtime, tmp_path):
    write(runtime, [samples("a", 8)], tmp_path)
    storage = runtime.open_caches("a", tmp_path, reader_config=ReaderConfig(shuffle=np.False_))
    assert [s.metadata["i"] for s in storage.dataset] == list(range(8))
    dropped = runtime.open_caches(
        "a",
        tmp_path,
        reader_config=ReaderConfig(rank=0, world_size=3, drop_last=np.True_),
    )
    assert len(dropped.dataset) == 2


# --- CacheInput.metadata: any Mapping


class Frozen(Mapping[str, Any]):
    """A Mapping that is not a dict."""

    def __init__(self, **items: Any) -> None:
        self._items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


@pytest.mark.parametrize(
    "wrap",
    [
        pytest.param(dict, id="dict"),
        pytest.param(types.MappingProxyType, id="MappingProxyType"),
        pytest.param(lambda d: Frozen(**d), id="custom Mapping"),
    ],
)
def test_metadata_may_be_any_mapping(runtime, tmp_path, wrap):
    inputs = [
        dataset_rt.CacheInput(b"x" * i, wrap({"label": f"l{i}", "i": i, "ok": i % 2 == 0}))
        for i in range(3)
    ]
    result = write(runtime, make_source("m", inputs), tmp_path)
    assert result.results == [CacheWritten("m", tmp_path / "m", 3)]
    got = [s.metadata for s in result.dataset]
    assert got == [{"label": f"l{i}", "i": i, "ok": i % 2 == 0} for i in range(3)]


@pytest.mark.parametrize("metadata", [[("a", 1)], "a=1", 5])
def test_metadata_that_is_not_a_mapping_is_refused_clearly(runtime, tmp_path, metadata):
    result = write(runtime, make_source("m", [dataset_rt.CacheInput(b"x", metadata)]), tmp_path)
    match result.results:
        case [CacheWriteError("m", _, message)]:
            assert 'source "m", sample 0' in message
            assert "metadata must be a mapping" in message
            assert type(metadata).__name__ in message
        case other:
            pytest.fail(f"unexpected {other}")


def test_a_mapping_whose_items_fail_is_a_write_error(runtime, tmp_path):
    class Broken(Frozen):
        def __iter__(self) -> Iterator[str]:
            raise RuntimeError("cannot list keys")

    result = write(runtime, make_source("m", [dataset_rt.CacheInput(b"x", Broken(a=1))]), tmp_path)
    match result.results:
        case [CacheWriteError("m", _, message)]:
            assert "cannot list keys" in message
            assert "Broken" in message
        case other:
            pytest.fail(f"unexpected {other}")
    assert not (tmp_path / "m").exists()


# --- DataLoader given something that is not a Dataset


@pytest.fixture
def loaded(runtime, tmp_path):
    return write(runtime, [samples("a")], tmp_path)


@pytest.mark.parametrize(
    ("wrong", "got", "hint"),
    [
        (lambda r: r, "CacheSourcesDatasetSuccess", "pass its .dataset"),
        (lambda r: None, "builtins.NoneType", "pass result.dataset"),
        (lambda r: list(r.dataset), "builtins.list", "pass result.dataset"),
    ],
)
def test_dataloader_of_a_non_dataset_raises_type_error(loaded, wrong, got, hint):
    with pytest.raises(TypeError) as info:
        dataset_rt.DataLoader(wrong(loaded), batch_size=2)
    message = str(info.value)
    assert "dataset_rt.DataLoader takes a dataset_rt Dataset" in message
    assert got in message
    assert hint in message


@pytest.mark.torch
def test_dataloaders_of_the_torch_adapter_say_to_pass_the_dataset(loaded):
    pytest.importorskip("torch")
    import dataset_rt.torch

    adapter = loaded.dataset.to_torch_iterable_dataset()
    loaders = {
        "dataset_rt.DataLoader": dataset_rt.DataLoader,
        "dataset_rt.torch.DataLoader": dataset_rt.torch.DataLoader,
    }
    for name, loader in loaders.items():
        with pytest.raises(TypeError) as info:
            loader(adapter, batch_size=2)
        message = str(info.value)
        assert message.startswith(f"{name} takes a dataset_rt Dataset, got ")
        assert "TorchIterableDataset" in message
        assert "not its to_torch_iterable_dataset()" in message


# --- dependencies


def test_the_package_never_imports_pyarrow(tmp_path):
    # pyarrow is a test dependency only (an independent reader of metadata.arrow): no user path,
    # the samples-metadata table included, may need it.
    script = textwrap.dedent(
        """
        import sys
        import dataset_rt, dataset_rt.cli, dataset_rt.testing
        from dataset_rt import DatasetRuntime, ReaderConfig, WriterConfig
        from dataset_rt.testing import make_source

        with DatasetRuntime(num_workers=1) as runtime:
            result = runtime.from_cache_sources(
                make_source("a", [(b"x", {"k": 1})]), sys.argv[1],
                writer_config=WriterConfig(show_progress=False),
            )
            table = result.dataset.samples_metadata()
            result.dataset.set_samples_metadata(table)
            runtime.open_caches("a", sys.argv[1])
        assert "pyarrow" not in sys.modules, "pyarrow was imported"
        print("ok")
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "ok"
