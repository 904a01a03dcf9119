"""Cache sets on object storage, over ``file://`` and moto's S3 server: a set written by
``from_cache_sources`` on a URL or pushed with ``dataset-rt push`` reads exactly as its local copy
(fingerprint, shuffled epochs, the shared-memory loader), appears only once its set manifest is
written, and refuses a part that changed after it was published."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from set_helpers import parts
from test_remote_publish import (  # noqa: F401 (fixtures, used by name)
    Store,
    s3_endpoint,
    s3_env,
    store,
    write_cache,
)

from dataset_rt import (
    CacheLoaded,
    CacheMalformed,
    CacheMissing,
    CacheSet,
    CacheSourcesDatasetSuccess,
    CacheWritten,
    DatasetRuntime,
    ReaderConfig,
    RemoteConfig,
    WriterConfig,
    _native,
)
from dataset_rt.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from dataset_rt.torch import DataLoader

WRITER = WriterConfig(show_progress=False, shard_size_bytes=1024)
READER = ReaderConfig(seed=5)


@pytest.fixture(scope="module")
def runtime() -> Iterator[DatasetRuntime]:
    with DatasetRuntime(num_workers=2) as runtime:
        yield runtime


def epochs(result: Any, count: int = 2) -> list[list[tuple[bytes, dict[str, Any]]]]:
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    out = []
    for epoch in range(count):
        result.dataset.set_epoch(epoch)
        out.append([(bytes(s.data), s.metadata) for s in result.dataset])
    return out


@pytest.fixture
def local_set(runtime: DatasetRuntime, tmp_path: Path) -> Path:
    """The set ``s`` of 3 parts, written locally: its directory."""
    built = runtime.from_cache_sources(
        CacheSet("s", parts(3, 20)), tmp_path / "local", writer_config=WRITER
    )
    assert isinstance(built, CacheSourcesDatasetSuccess), built
    return tmp_path / "local" / "s"


def test_a_set_written_on_a_url_reads_exactly_as_the_local_set(
    runtime: DatasetRuntime,
    local_set: Path,
    store: Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    node = RemoteConfig(local_dir=tmp_path / "node")
    base = store.url("s")[: -len("/s")]
    local = runtime.open_caches("s", local_set.parent, reader_config=READER)
    written = runtime.from_cache_sources(
        CacheSet("s", parts(3, 20)),
        base,
        reader_config=READER,
        writer_config=WriterConfig(show_progress=False, shard_size_bytes=1024, processes=2),
        remote=node,
    )
    assert isinstance(written, CacheSourcesDatasetSuccess), written
    assert [type(r) for r in written.results] == [CacheWritten]
    assert written.results[0].path == f"{base}/s" and written.results[0].num_samples == 60
    assert "s/set.json" in store.objects()
    assert {o.split("/")[1] for o in store.objects() if o.count("/") > 1} == {
        "s.part-000000",
        "s.part-000001",
        "s.part-000002",
    }
    assert written.dataset.fingerprint == local.dataset.fingerprint  # type: ignore[union-attr]
    assert epochs(written) == epochs(local)
    # The staging copy is gone, and the next call loads what is published.
    assert not any((tmp_path / "node" / ".publish").iterdir())
    again = runtime.from_cache_sources(
        CacheSet("s", parts(3, 20)), base, reader_config=READER, writer_config=WRITER, remote=node
    )
    assert [type(r) for r in again.results] == [CacheLoaded]
    assert epochs(again) == epochs(local)


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_reads_a_published_set_as_the_local_set(
    runtime: DatasetRuntime,
    local_set: Path,
    store: Store,  # noqa: F811
    tmp_path: Path,
    workers: int,
) -> None:
    node = RemoteConfig(local_dir=tmp_path / "node")
    _native.push_cache(local_set, store.url("s"), node)
    expected = epochs(runtime.open_caches("s", local_set.parent, reader_config=READER))
    remote = runtime.open_caches("s", store.url("s")[:-2], reader_config=READER, remote=node)
    assert isinstance(remote, CacheSourcesDatasetSuccess), remote
    loader = DataLoader(
        remote.dataset,
        batch_size=7,
        num_workers=workers,
        transform=lambda s: (bytes(s.data), s.metadata),
        collate_fn=list,
        persistent_workers=workers > 0,
    )
    with loader:
        for epoch in (0, 1):
            loader.set_epoch(epoch)
            assert [x for batch in loader for x in batch] == expected[epoch]


def test_push_inspect_verify_and_the_refusals_of_a_set(
    local_set: Path,
    store: Store,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DATASET_RT_REMOTE_DIR", str(tmp_path / "node"))
    url = store.url("s")
    assert main(["push", str(local_set), url]) == EXIT_OK
    assert "published" in capsys.readouterr().out
    assert main(["push", str(local_set), url]) == EXIT_OK  # the same set: nothing to do
    capsys.readouterr()
    assert main(["inspect", "--json", url]) == EXIT_OK
    shown = json.loads(capsys.readouterr().out)
    assert shown == json.loads((local_set / "set.json").read_text())
    assert main(["inspect", url]) == EXIT_OK
    text = capsys.readouterr().out
    assert "cache set:" in text and url in text and "s.part-000002" in text
    assert main(["verify", url]) == EXIT_OK
    assert "OK: 60 samples" in capsys.readouterr().out

    # A cache never goes over a set, nor a set over a cache, even with --replace.
    cache = write_cache(tmp_path / "single", name="s", n=10)
    assert main(["push", "--replace", str(cache), url]) == EXIT_FAILED
    assert "holds a cache set" in capsys.readouterr().err
    assert main(["push", str(cache), store.url("c/s")]) == EXIT_OK
    assert main(["push", "--replace", str(local_set), store.url("c/s")]) == EXIT_FAILED
    assert "holds a cache (" in capsys.readouterr().err

    # Another set of that name is refused without --replace.
    other = tmp_path / "other"
    with DatasetRuntime(num_workers=1) as runtime:
        runtime.from_cache_sources(CacheSet("s", parts(2, 20)), other, writer_config=WRITER)
    assert main(["push", str(other / "s"), url]) == EXIT_FAILED
    assert "already holds a cache" in capsys.readouterr().err


def test_a_set_appears_only_with_its_manifest_and_refuses_a_replaced_part(
    runtime: DatasetRuntime,
    local_set: Path,
    store: Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    node = RemoteConfig(local_dir=tmp_path / "node")
    url = store.url("s")
    base = url[: -len("/s")]
    # The parts alone, as an interrupted push leaves them: no set there.
    for part in sorted(p.name for p in local_set.iterdir() if p.is_dir()):
        _native.push_cache(local_set / part, f"{url}/{part}", node)
    missing = runtime.open_caches("s", base, remote=node)
    assert [type(r) for r in missing.results] == [CacheMissing]
    # The next push commits the set.
    report = _native.push_cache(local_set, url, node)
    assert report["uploaded"] == ["set.json"]  # the parts were there: only the commit
    assert [type(r) for r in runtime.open_caches("s", base, remote=node).results] == [CacheLoaded]
    # Part 1 replaced by another cache of its name: the set no longer opens.
    impostor = write_cache(tmp_path / "impostor", name="s.part-000001", n=20, salt="x")
    _native.push_cache(impostor, f"{url}/s.part-000001", node, True)
    broken = runtime.open_caches("s", base, remote=RemoteConfig(local_dir=tmp_path / "node2"))
    [result] = broken.results
    assert isinstance(result, CacheMalformed)
    assert "part 1" in result.message and "replaced" in result.message
    # `ls` says so too, and fails.
    [listed] = _native.list_caches(base, node)
    assert listed["error"] is not None and "replaced" in listed["error"]
    assert main(["ls", base]) == EXIT_FAILED


def test_sets_and_caches_on_one_url_share_the_budget(
    runtime: DatasetRuntime,
    local_set: Path,
    store: Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    """A set and a cache opened together read exactly as locally, through one local directory."""
    node = RemoteConfig(local_dir=tmp_path / "node")
    _native.push_cache(local_set, store.url("s"), node)
    cache = write_cache(tmp_path / "local", name="train", n=30)
    _native.push_cache(cache, store.url("train"), node)
    base = store.url("s")[: -len("/s")]
    local = runtime.open_caches(["train", "s"], tmp_path / "local", reader_config=READER)
    remote = runtime.open_caches(["train", "s"], base, reader_config=READER, remote=node)
    assert [type(r) for r in remote.results] == [CacheLoaded, CacheLoaded]
    assert [r.num_samples for r in remote.results] == [30, 60]
    assert epochs(remote) == epochs(local)


def test_a_failing_part_publishes_nothing_and_the_rerun_completes_the_set(
    runtime: DatasetRuntime,
    store: Store,  # noqa: F811
    tmp_path: Path,
) -> None:
    node = RemoteConfig(local_dir=tmp_path / "node")
    base = store.url("s")[: -len("/s")]
    failed = runtime.from_cache_sources(
        CacheSet("s", parts(3, 20, p1={"fail_at": 4})),
        base,
        writer_config=WRITER,
        remote=node,
    )
    assert not isinstance(failed, CacheSourcesDatasetSuccess)
    [result] = failed.results
    assert result.path == f"{base}/s"
    assert "s.part-000001" in result.message and "cannot read sample 4" in result.message
    assert "s/set.json" not in store.objects()
    done = runtime.from_cache_sources(
        CacheSet("s", parts(3, 20)), base, writer_config=WRITER, remote=node
    )
    assert [type(r) for r in done.results] == [CacheWritten]
    assert "s/set.json" in store.objects()


def test_pull_and_ls_of_a_set(
    runtime: DatasetRuntime,
    local_set: Path,
    store: Store,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DATASET_RT_REMOTE_DIR", str(tmp_path / "node"))
    url = store.url("s")
    assert main(["push", str(local_set), url]) == EXIT_OK
    cache = write_cache(tmp_path / "single", name="c", n=10)
    assert main(["push", str(cache), store.url("c")]) == EXIT_OK
    capsys.readouterr()

    # ls lists the set beside the cache, with its parts and the bytes of every part.
    assert main(["ls", "--json", url[: -len("/s")]]) == EXIT_OK
    listed = {entry["name"]: entry for entry in json.loads(capsys.readouterr().out)}
    assert set(listed) == {"c", "s"}
    local_manifest = json.loads((local_set / "set.json").read_text())
    assert listed["s"]["parts"] == 3 and listed["c"]["parts"] == 0
    assert listed["s"]["num_samples"] == 60
    assert listed["s"]["fingerprint"] == local_manifest["fingerprint"]
    on_disk = sum(f.stat().st_size for f in local_set.rglob("*") if f.is_file())
    assert listed["s"]["bytes"] == on_disk
    assert main(["ls", url]) == EXIT_OK
    assert "cache set of 3 parts, 60 samples" in capsys.readouterr().out

    # pull: the whole set, reading exactly as the set it came from.
    dest = tmp_path / "pulled" / "s"
    assert main(["pull", url, str(dest)]) == EXIT_OK
    assert "cache set of 3 parts" in capsys.readouterr().out
    assert (dest / "set.json").read_bytes() == (local_set / "set.json").read_bytes()
    pulled = runtime.open_caches("s", dest.parent, reader_config=READER)
    original = runtime.open_caches("s", local_set.parent, reader_config=READER)
    assert epochs(pulled) == epochs(original)
    assert main(["pull", url, str(dest)]) == EXIT_OK
    assert "nothing was downloaded" in capsys.readouterr().out

    # Interrupted after some parts: the set is not there until the rerun completes it, which
    # downloads only the missing parts.
    partial = tmp_path / "partial" / "s"
    assert main(["pull", url, str(partial)]) == EXIT_OK
    (partial / "set.json").unlink()
    for part in ("s.part-000001", "s.part-000002"):
        for f in (partial / part).rglob("*"):
            f.chmod(0o700 if f.is_dir() else 0o600)
        shutil.rmtree(partial / part)
    capsys.readouterr()
    missing = runtime.open_caches("s", partial.parent, reader_config=READER)
    assert [type(r) for r in missing.results] != [CacheLoaded]
    report = _native.pull_cache(url, partial, RemoteConfig(local_dir=tmp_path / "node"))
    # The data files of the two missing parts (their manifests are read, not counted).
    assert report["bytes"] == sum(
        f.stat().st_size
        for part in ("s.part-000001", "s.part-000002")
        for f in (local_set / part).rglob("*")
        if f.is_file() and f.name != "manifest.json"
    )
    assert epochs(runtime.open_caches("s", partial.parent, reader_config=READER)) == epochs(pulled)

    # A directory named otherwise, or holding a cache, is refused.
    assert main(["pull", url, str(tmp_path / "pulled" / "t")]) == EXIT_USAGE
    assert "must end in the cache set's name" in capsys.readouterr().err
    assert main(["pull", url, str(cache.parent / "s")]) == EXIT_OK
    shutil.rmtree(cache.parent / "s")
    shutil.copytree(cache, cache.parent / "s")
    assert main(["pull", url, str(cache.parent / "s")]) == EXIT_FAILED
    assert "holds a cache" in capsys.readouterr().err
