"""The ``dataset-rt`` command line: inspect, verify, head, pack and demo."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import numpy as np
import pytest

import dataset_rt
from dataset_rt import (
    CacheInput,
    CacheSourcesDatasetSuccess,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
    _demo,
)
from dataset_rt.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main

REPO_ROOT = Path(dataset_rt.__file__).resolve().parents[1]
# What the shell reports for a process killed by SIGPIPE, and the command's status when its
# output is closed early.
EXIT_PIPE = 128 + signal.SIGPIPE


def payload(i: int) -> bytes:
    """Unique, findable bytes of sample ``i``; lengths are not multiples of 16, so every record
    ends in alignment padding."""
    return f"<payload {i:04d}>".encode() * (3 + i % 5) + b"#"


def labelled(i: int) -> dict[str, int | str]:
    return {"sample_id": i, "label": ("cat", "dog", "bird")[i % 3]}


class Source:
    def __init__(self, name: str, n: int) -> None:
        self.name = name
        self.n = n

    def __iter__(self) -> Iterator[CacheInput]:
        for i in range(self.n):
            yield CacheInput(data=payload(i), metadata=labelled(i))


class Existing:
    """A source that only names a cache: it loads and never writes."""

    def __init__(self, name: str) -> None:
        self.name = name


def write_cache(
    base: Path,
    name: str = "train",
    n: int = 20,
    *,
    algo: Literal["none", "lz4"] = "none",
    ratio: float = 1.0,
    shard_size: int = 256 * 1024 * 1024,
) -> Path:
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            Source(name, n),
            base,
            writer_config=WriterConfig(
                shard_compression=ShardCompression(algo=algo, ratio=ratio),
                show_progress=False,
                shard_size_bytes=shard_size,
            ),
        )
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return base / name


def read_all(base: Path, name: str) -> list[tuple[bytes, dict[str, object]]]:
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            Existing(name), base, reader_config=ReaderConfig(shuffle=False)
        )
        assert isinstance(result, CacheSourcesDatasetSuccess), result
        return [(bytes(s.data), dict(s.metadata)) for s in result.dataset]


def summary(text: str) -> dict[str, str]:
    rows = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    return {key.strip(): value.strip() for key, value in rows}


def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "dataset_rt", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.chmod(0o644)  # published read-only
    path.write_bytes(bytes(data))


# --- inspect ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_inspect_shows_an_older_cache_with_its_version_and_verifies_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], version: int
) -> None:
    """Caches of older formats stay readable; inspect names their version."""
    cache = tmp_path / "golden"
    golden = Path(__file__).parent / "data" / f"golden_v{version}" / "golden"
    shutil.copytree(golden, cache)
    assert main(["inspect", str(cache)]) == EXIT_OK
    assert summary(capsys.readouterr().out)["format"] == f"dataset-rt-cache v{version}"
    assert main(["verify", str(cache)]) == EXIT_OK


def test_inspect_summarises_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = write_cache(tmp_path, n=30, algo="lz4", ratio=0.9)
    manifest = json.loads((cache / "manifest.json").read_text())

    assert main(["inspect", str(cache)]) == EXIT_OK
    rows = summary(capsys.readouterr().out)

    raw = sum(len(payload(i)) for i in range(30))
    assert rows["name"] == "train"
    assert rows["format"] == "dataset-rt-cache v3"
    assert rows["writer"] == manifest["writer_version"]
    assert rows["samples"] == "30"
    assert rows["schema"] == "sample_id: int, label: str"
    assert rows["sample_id"] == "metadata key 'sample_id' (int)"
    assert rows["compression"] == "lz4 (ratio 0.9)"
    shard_bytes = sum(p.stat().st_size for p in (cache / "shards").iterdir())
    assert rows["shards"].startswith(f"1 file(s), {shard_bytes} bytes")
    assert rows["payload raw"].startswith(f"{raw} bytes")
    stored = manifest["stored_payload_bytes"]
    assert stored < raw  # the repeated payloads compress
    assert rows["payload stored"].startswith(f"{stored} bytes")
    assert f"stored/raw = {stored / raw:.3f}" in rows["payload stored"]
    assert rows["fingerprint"] == manifest["fingerprint"]


def test_inspect_json_prints_the_manifest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = write_cache(tmp_path)
    assert main(["inspect", "--json", str(cache)]) == EXIT_OK
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((cache / "manifest.json").read_text())


def test_inspect_refuses_a_malformed_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = write_cache(tmp_path)
    flip_byte(cache / "metadata.arrow", 100)
    assert main(["inspect", str(cache)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "metadata.arrow" in err
    assert "checksum mismatch" in err


# --- verify ----------------------------------------------------------------------------------


def test_verify_ok_counts_samples_and_shards(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = write_cache(tmp_path, n=40, shard_size=1024)
    shards = len(list((cache / "shards").iterdir()))
    assert shards > 1
    assert main(["verify", str(cache)]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"OK: 40 samples, {shards} shards verified"


def test_verify_names_shard_and_sample_of_a_flipped_payload_byte(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = write_cache(tmp_path, n=20)
    shard = cache / "shards" / "000000.bin"
    offset = shard.read_bytes().index(payload(7))
    flip_byte(shard, offset + 5)

    assert main(["verify", str(cache)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert str(shard) in err
    assert "sample 7" in err
    assert "checksum mismatch" in err


@pytest.mark.parametrize("module", ["dataset_rt", "dataset_rt.cli"])
def test_both_module_entry_points_run_the_command_line(tmp_path: Path, module: str) -> None:
    """``python -m dataset_rt.cli verify`` of a damaged cache fails as the command does; it
    once ran nothing and exited 0."""
    cache = write_cache(tmp_path, n=20)
    shard = cache / "shards" / "000000.bin"
    flip_byte(shard, shard.read_bytes().index(payload(7)) + 5)
    done = subprocess.run(
        [sys.executable, "-m", module, "verify", str(cache)],
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == EXIT_FAILED, done
    assert "sample 7" in done.stderr


def test_verify_catches_damage_between_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A byte of alignment padding belongs to no record: the shard checksum catches it."""
    cache = write_cache(tmp_path, n=5)
    shard = cache / "shards" / "000000.bin"
    end = shard.read_bytes().index(payload(2)) + len(payload(2))
    assert end % 16 != 0  # padding follows the payload
    flip_byte(shard, end)
    # Reading every record still succeeds: only verify's whole-shard checksum sees it.
    assert [data for data, _ in read_all(tmp_path, "train")] == [payload(i) for i in range(5)]

    assert main(["verify", str(cache)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert str(shard) in err
    assert "checksum mismatch" in err


def test_verify_names_a_truncated_index(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = write_cache(tmp_path, n=10)
    index = cache / "index.bin"
    index.chmod(0o644)  # published read-only
    index.write_bytes(index.read_bytes()[:-8])

    assert main(["verify", str(cache)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert str(index) in err
    assert "size is" in err


def test_every_command_gives_one_exit_status_for_one_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A cache that fails validation is 1 and a URL the tool cannot use is 2, whichever command
    meets it."""
    cache = write_cache(tmp_path, n=20, shard_size=1024)
    shard = cache / "shards" / "000001.bin"
    shard.chmod(0o644)
    os.truncate(shard, 100)
    out = tmp_path / "view.html"
    commands = [["inspect"], ["verify"], ["head"], ["view", "--out", str(out)]]
    for command in commands:
        assert main([command[0], str(cache), *command[1:]]) == EXIT_FAILED, command
        assert str(shard) in capsys.readouterr().err, command
    for command in commands:
        assert main([command[0], "http://example.com/x", *command[1:]]) == EXIT_USAGE, command
        err = capsys.readouterr().err
        assert "FAILED" not in err, (command, err)
        # head reads local caches only: for it the URL is a path that does not exist.
        assert ("scheme" if command[0] != "head" else "no DatasetRT cache") in err, err


def test_a_cache_under_a_name_that_is_not_utf8_is_shown_and_viewed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = Path(os.fsdecode(bytes(tmp_path) + b"/par\xffent"))
    cache = write_cache(base, n=3)
    out = tmp_path / "view.html"
    assert main(["view", str(cache), "--out", str(out)]) == EXIT_OK
    assert "par\\xffent" in out.read_text(encoding="utf-8")
    shard = cache / "shards" / "000000.bin"
    shard.chmod(0o644)
    os.truncate(shard, 10)
    assert main(["verify", str(cache)]) == EXIT_FAILED
    assert "FAILED: " + str(tmp_path) + "/par\\xffent/train" in capsys.readouterr().err


def test_verify_a_path_that_is_not_a_cache_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope"
    assert main(["verify", str(missing)]) == EXIT_USAGE
    assert f"no DatasetRT cache at {missing}" in capsys.readouterr().err

    (tmp_path / "plain").mkdir()
    assert main(["verify", str(tmp_path / "plain")]) == EXIT_USAGE
    assert "manifest.json" in capsys.readouterr().err

    (tmp_path / "file").write_bytes(b"x")
    assert main(["verify", str(tmp_path / "file")]) == EXIT_USAGE
    assert "not a directory" in capsys.readouterr().err


# --- head ------------------------------------------------------------------------------------


def parse_head(text: str) -> list[dict[str, str]]:
    records: list[dict[str, str]] = []
    for line in text.splitlines():
        if line.startswith("record "):
            records.append({"header": line})
        elif line.strip().startswith("metadata:"):
            records[-1]["metadata"] = line.split("metadata:", 1)[1].strip()
        elif line.strip().startswith("payload:"):
            records[-1]["payload"] = line.split("payload:", 1)[1].strip()
    return records


def test_head_shows_records_with_embedded_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = write_cache(tmp_path, n=10)
    assert main(["head", str(cache), "-n", "3"]) == EXIT_OK
    records = parse_head(capsys.readouterr().out)

    assert len(records) == 3
    for i, record in enumerate(records):
        assert record["header"].startswith(f"record {i}: shards/000000.bin offset ")
        assert "flags 0x0 (raw)" in record["header"]
        n = len(payload(i))
        assert f"stored {n} bytes, raw {n} bytes" in record["header"]
        assert json.loads(record["metadata"]) == labelled(i)
        assert record["payload"] == f"{n} bytes: {payload(i)[:32].hex()}..."

    # The default is 5 records, and asking for more than exist shows them all.
    assert main(["head", str(cache)]) == EXIT_OK
    assert len(parse_head(capsys.readouterr().out)) == 5
    assert main(["head", str(cache), "-n", "99"]) == EXIT_OK
    assert len(parse_head(capsys.readouterr().out)) == 10


def test_head_decodes_lz4_records(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = write_cache(tmp_path, n=4, algo="lz4", ratio=0.9)
    assert main(["head", str(cache), "-n", "4"]) == EXIT_OK
    records = parse_head(capsys.readouterr().out)
    for i, record in enumerate(records):
        raw = payload(i)
        assert "flags 0x1 (lz4)" in record["header"]
        stored = int(record["header"].split("stored ", 1)[1].split()[0])
        assert stored < len(raw)
        assert f"raw {len(raw)} bytes" in record["header"]
        assert record["payload"] == f"{len(raw)} bytes: {raw[:32].hex()}..."


def test_head_reads_metadata_from_the_record_itself(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Damaging record 1's embedded metadata (metadata.arrow stays intact) breaks head at
    record 1, naming it: head decodes and verifies the shard record, not the Arrow table."""
    cache = write_cache(tmp_path, n=4)
    shard = cache / "shards" / "000000.bin"
    data = shard.read_bytes()
    embedded = json.dumps(labelled(1), separators=(",", ":"), sort_keys=True).encode()
    start = data.index(payload(0)) + len(payload(0))
    flip_byte(shard, data.index(embedded, start) + 2)

    assert main(["head", str(cache), "-n", "1"]) == EXIT_OK
    assert len(parse_head(capsys.readouterr().out)) == 1

    assert main(["head", str(cache), "-n", "2"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert str(shard) in err
    assert "sample 1" in err


# --- pack ------------------------------------------------------------------------------------


def image_folder(root: Path) -> dict[str, bytes]:
    files = {
        "cat/001.jpg": b"\xff\xd8cat one",
        "cat/002.jpg": b"\xff\xd8cat two" * 50,
        "dog/001.jpg": b"\xff\xd8dog",
        "dog/puppies/a.png": b"\x89PNG puppy",
        "bird/x.bin": bytes(range(256)) * 3,
        "README.txt": b"top level\n",
        "empty/nothing.dat": b"",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


@pytest.mark.parametrize("compression", ["none", "lz4"])
def test_pack_image_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], compression: str
) -> None:
    src = tmp_path / "src"
    files = image_folder(src)
    cache = tmp_path / "caches" / "images"

    argv = ["pack", str(src), str(cache), "--compression", compression, "--quiet"]
    assert main(argv) == EXIT_OK
    out = capsys.readouterr().out
    assert f"CacheWritten: packed {len(files)} files" in out

    samples = read_all(tmp_path / "caches", "images")
    expected_order = sorted(files)
    assert [meta["sample_id"] for _, meta in samples] == expected_order
    for data, meta in samples:
        rel = str(meta["sample_id"])
        assert meta["path"] == rel
        assert data == files[rel]
        assert meta["size"] == len(files[rel])
        assert meta["label"] == (rel.split("/")[0] if "/" in rel else "")
    labels = {str(meta["sample_id"]): meta["label"] for _, meta in samples}
    assert labels["dog/puppies/a.png"] == "dog"
    assert labels["README.txt"] == ""

    if compression == "lz4":
        manifest = json.loads((cache / "manifest.json").read_text())
        assert manifest["compression"] == {"algo": "lz4", "ratio": 0.9}
        assert manifest["stored_payload_bytes"] < manifest["raw_payload_bytes"]

    # A second pack reuses the cache and does not read the directory.
    (src / "cat" / "003.jpg").write_bytes(b"new")
    assert main(argv) == EXIT_OK
    assert "CacheLoaded" in capsys.readouterr().out
    assert len(read_all(tmp_path / "caches", "images")) == len(files)


def test_pack_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "src"
    image_folder(src)

    assert main(["pack", str(tmp_path / "missing"), str(tmp_path / "c")]) == EXIT_USAGE
    assert "is not a directory" in capsys.readouterr().err

    assert main(["pack", str(src), str(src / "inner")]) == EXIT_USAGE
    assert "must not be inside" in capsys.readouterr().err

    argv = ["pack", str(src), str(tmp_path / "c"), "--compression", "none", "--ratio", "0.5"]
    assert main(argv) == EXIT_USAGE
    assert "requires ratio=1.0" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_pack_of_an_empty_directory_is_an_empty_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "src").mkdir()
    cache = tmp_path / "empty"
    assert main(["pack", str(tmp_path / "src"), str(cache), "--quiet"]) == EXIT_OK
    assert "packed 0 files" in capsys.readouterr().out
    assert main(["head", str(cache)]) == EXIT_OK
    assert capsys.readouterr().out.strip() == "(no records)"
    assert main(["verify", str(cache)]) == EXIT_OK
    assert capsys.readouterr().out.strip() == "OK: 0 samples, 0 shards verified"


def test_pack_refuses_to_overwrite_a_malformed_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    image_folder(src)
    broken = tmp_path / "caches" / "images"
    broken.mkdir(parents=True)
    (broken / "manifest.json").write_text("{not json")

    assert main(["pack", str(src), str(broken), "--quiet"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "CacheMalformed" in err
    assert "invalid JSON" in err
    assert (broken / "manifest.json").read_text() == "{not json"


def pack_quiet(src: Path, cache: Path, *flags: str) -> int:
    return main(["pack", str(src), str(cache), "--quiet", *flags])


def test_pack_refuses_a_file_link_leaving_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    image_folder(src)
    (src / "cat" / "env").symlink_to("/proc/self/environ")
    cache = tmp_path / "caches" / "images"

    assert pack_quiet(src, cache) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{src / 'cat' / 'env'} is a symbolic link to /proc/self/environ, outside" in err
    assert "--follow-symlinks" in err
    assert not cache.exists()
    assert sorted(p.name for p in cache.parent.iterdir()) == [".images.lock"]


def test_pack_refuses_a_folder_link_leaving_the_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    image_folder(src)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (src / "more").symlink_to(outside)

    assert pack_quiet(src, tmp_path / "c") == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{src / 'more'} is a symbolic link to {outside}, outside" in err
    assert not (tmp_path / "c").exists()


def test_pack_follow_symlinks_packs_what_outside_links_point_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    files = image_folder(src)
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "one.bin").write_bytes(b"one")
    (outside / "deep" / "two.bin").write_bytes(b"two")
    (src / "cat" / "linked.bin").symlink_to(outside / "one.bin")
    (src / "extra").symlink_to(outside)
    cache = tmp_path / "caches" / "images"

    assert pack_quiet(src, cache, "--follow-symlinks") == EXIT_OK
    capsys.readouterr()
    samples = {meta["path"]: data for data, meta in read_all(cache.parent, "images")}
    expected = {
        **files,
        "cat/linked.bin": b"one",
        "extra/one.bin": b"one",
        "extra/deep/two.bin": b"two",
    }
    assert samples == expected
    assert list(samples) == sorted(expected)


def test_pack_packs_links_inside_the_folder_as_their_targets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A link that stays inside is packed as what it points to, a folder link included: never
    skipped silently."""
    src = tmp_path / "src"
    files = image_folder(src)
    (src / "dog" / "alias.jpg").symlink_to(Path("..") / "cat" / "001.jpg")
    (src / "pets").symlink_to("dog")
    cache = tmp_path / "caches" / "images"

    assert pack_quiet(src, cache) == EXIT_OK
    capsys.readouterr()
    samples = {
        meta["path"]: (data, meta["label"]) for data, meta in read_all(cache.parent, "images")
    }
    assert samples["dog/alias.jpg"] == (files["cat/001.jpg"], "dog")
    assert samples["pets/001.jpg"] == (files["dog/001.jpg"], "pets")
    assert samples["pets/puppies/a.png"] == (files["dog/puppies/a.png"], "pets")
    assert samples["pets/alias.jpg"] == (files["cat/001.jpg"], "pets")
    assert len(samples) == len(files) + 1 + 3


@pytest.mark.parametrize("flags", [(), ("--follow-symlinks",)], ids=["default", "follow"])
def test_pack_refuses_link_loops_and_broken_links(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...]
) -> None:
    src = tmp_path / "src"
    image_folder(src)
    (src / "dog" / "puppies" / "up").symlink_to(Path("..") / "..")
    assert pack_quiet(src, tmp_path / "c", *flags) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{src / 'dog' / 'puppies' / 'up'} is a symbolic link back to a folder" in err
    assert "loop" in err

    (src / "dog" / "puppies" / "up").unlink()
    (src / "cat" / "gone").symlink_to(src / "cat" / "missing")
    assert pack_quiet(src, tmp_path / "c", *flags) == EXIT_FAILED
    assert "which does not exist" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()

    # A broken link that points outside is refused as broken, with or without
    # --follow-symlinks: following it could not pack it either.
    (src / "cat" / "gone").unlink()
    (src / "dog" / "broken").symlink_to("/nonexistent")
    assert pack_quiet(src, tmp_path / "c", *flags) == EXIT_FAILED
    err = capsys.readouterr().err
    assert (
        f"{src / 'dog' / 'broken'} is a symbolic link to /nonexistent, which does not exist; "
        "remove the link"
    ) in err
    assert "--follow-symlinks" not in err
    assert not (tmp_path / "c").exists()


def test_pack_refuses_a_name_that_is_not_utf8_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    image_folder(src)
    Path(os.fsdecode(bytes(src / "cat") + b"/f\xffe.txt")).write_bytes(b"x")
    assert pack_quiet(src, tmp_path / "c") == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{src / 'cat'}/f\\xffe.txt: the name is not UTF-8" in err, err
    assert not (tmp_path / "c").exists()


@pytest.mark.timeout(60)
def test_pack_refuses_a_fifo_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    image_folder(src)
    os.mkfifo(src / "cat" / "pipe")
    assert pack_quiet(src, tmp_path / "c") == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{src / 'cat' / 'pipe'} is not a regular file" in err


def test_pack_does_not_follow_a_link_swapped_in_after_listing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The listing and the read are apart in time: a file replaced by a link to a secret in
    between must not be read through the link (the read opens without following links)."""
    from dataset_rt import cli

    src = tmp_path / "src"
    image_folder(src)
    secret = tmp_path / "secret"
    secret.write_bytes(b"private key")
    listed = cli._list_files

    def list_then_swap(root: Path, *, follow_symlinks: bool) -> object:
        files = listed(root, follow_symlinks=follow_symlinks)
        (src / "cat" / "001.jpg").unlink()
        (src / "cat" / "001.jpg").symlink_to(secret)
        return files

    monkeypatch.setattr(cli, "_list_files", list_then_swap)
    cache = tmp_path / "caches" / "images"
    assert pack_quiet(src, cache) == EXIT_FAILED
    assert f"{src / 'cat' / '001.jpg'} became a symbolic link" in capsys.readouterr().err
    assert not cache.exists()


def test_pack_help_describes_links(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["pack", "--help"]) == EXIT_OK
    out = " ".join(capsys.readouterr().out.split())
    assert "--follow-symlinks" in out
    assert "a link leading out of DIR is refused unless --follow-symlinks" in out


# --- demo ------------------------------------------------------------------------------------


def test_demo_speaks_decimal_units(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The progress line and the summary both count in decimal units (kB, MB), and agree."""
    argv = ["demo", "--out", str(tmp_path / "demo"), "--samples", "150", "--workers", "2"]
    assert main(argv) == EXIT_OK
    captured = capsys.readouterr()
    assert "iB" not in captured.out + captured.err  # no KiB/MiB beside kB/MB
    finished = [line for line in captured.err.splitlines() if "written in" in line]
    assert len(finished) == 1, captured.err
    number, unit = finished[0].split(" samples, ")[1].split(" | ")[0].split()
    written = float(number) * {"B": 1, "kB": 1e3, "MB": 1e6}[unit]
    read = float(summary(captured.out)["epoch 0"].split(", ")[1].split(" MB;")[0]) * 1e6
    # One epoch reads every payload once: the bytes the progress line reported as written.
    assert read == pytest.approx(written, rel=0.02)


def test_demo_writes_then_reuses(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["demo", "--out", str(tmp_path / "demo"), "--samples", "150", "--workers", "2"]
    assert main(argv) == EXIT_OK
    first = capsys.readouterr()
    assert "CacheWritten: wrote 150 samples" in first.out
    assert "demo_images" in first.err  # the progress line
    assert main(argv) == EXIT_OK
    second = capsys.readouterr().out
    assert "CacheLoaded: reused the existing cache, 150 samples" in second

    for out in (first.out, second):
        rows = summary(out)
        assert rows["epoch 0"].startswith("150 samples")
        assert rows["epoch 1"].startswith("150 samples")
        assert rows["each epoch reads every sample exactly once"] == "yes"
        assert rows["epoch orders differ"] == "yes"
        assert rows["payloads and metadata match the generator"] == "300 of 300 reads"
        counts = dict(part.split() for part in rows["classes"].split(", "))
        assert sum(int(c) for c in counts.values()) == 150
        assert set(counts) <= {"cat", "dog", "bird", "fish"}
        state = json.loads(out.split("state_dict:", 1)[1].splitlines()[0])
        assert (state["epoch"], state["position"], state["seed"]) == (2, 0, 42)
        # The shared-memory loader: 150 samples are 5 batches of 32; a checkpoint after the
        # second, and a new loader resumed from it delivers the other three, as they were.
        assert rows["loader"].startswith("dataset_rt.DataLoader, 2 workers decoding, batch 32: 5 ")
        assert rows["loader"].count(" batches/s") == 1
        assert rows["resume"] == (
            "state_dict after batch 2 of 5; a new loader resumed from it delivered 3 batches, "
            "equal to the rest of the epoch: yes"
        )
        if importlib.util.find_spec("torch") is None:
            assert rows["torch"].startswith("not installed")
        else:
            assert "the same records in memory: 5 batches in " in rows["torch"]
            assert rows["torch"].endswith(" batches/s")
    # Both runs read the same cache in the same seeded orders.
    assert rows["epoch 0"] == summary(first.out)["epoch 0"]

    manifest = json.loads((tmp_path / "demo" / "demo_images" / "manifest.json").read_text())
    assert manifest["num_samples"] == 150
    assert manifest["stored_payload_bytes"] < manifest["raw_payload_bytes"]


def test_demo_compares_batches_by_ids_and_values() -> None:
    ids, means = ["img-000001", "img-000002"], np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    assert _demo._same([(ids, means)], [(list(ids), means.copy())])
    assert not _demo._same([(ids, means)], [(ids[::-1], means)])
    assert not _demo._same([(ids, means)], [(ids, means + 1)])
    assert not _demo._same([(ids, means)], [])


def test_demo_says_when_torch_is_not_installed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else find_spec(name, *a),
    )
    _demo._torch_beside(None)  # type: ignore[arg-type]  # not reached without torch
    assert capsys.readouterr().out.startswith("torch: not installed")


# --- the real command line -------------------------------------------------------------------


def test_python_m_dataset_rt_runs_every_command(tmp_path: Path) -> None:
    src = tmp_path / "src"
    files = image_folder(src)
    cache = tmp_path / "caches" / "images"

    packed = run_module("pack", str(src), str(cache), cwd=tmp_path)
    assert packed.returncode == EXIT_OK, packed.stderr
    assert f"packed {len(files)} files" in packed.stdout
    assert "images:" in packed.stderr  # progress is on by default

    inspected = run_module("inspect", str(cache), cwd=tmp_path)
    assert inspected.returncode == EXIT_OK, inspected.stderr
    assert summary(inspected.stdout)["samples"] == str(len(files))

    verified = run_module("verify", str(cache), cwd=tmp_path)
    assert verified.returncode == EXIT_OK, verified.stderr
    assert verified.stdout.strip() == f"OK: {len(files)} samples, 1 shards verified"

    head = run_module("head", str(cache), "-n", "1", cwd=tmp_path)
    assert head.returncode == EXIT_OK, head.stderr
    meta = json.loads(parse_head(head.stdout)[0]["metadata"])
    assert meta == {"label": "", "path": "README.txt", "sample_id": "README.txt", "size": 10}

    demo = run_module("demo", "--samples", "50", "--workers", "1", cwd=tmp_path)
    assert demo.returncode == EXIT_OK, demo.stderr
    assert "CacheWritten" in demo.stdout
    assert (tmp_path / "demo-cache" / "demo_images" / "manifest.json").is_file()

    flip_byte(cache / "index.bin", 20)
    broken = run_module("verify", str(cache), cwd=tmp_path)
    assert broken.returncode == EXIT_FAILED
    assert "index.bin" in broken.stderr

    missing = run_module("verify", str(tmp_path / "missing"), cwd=tmp_path)
    assert missing.returncode == EXIT_USAGE
    assert "no DatasetRT cache" in missing.stderr


@pytest.fixture(scope="module")
def many_records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache whose `head -n 1000` and `inspect --json` outputs exceed a one-page pipe."""
    return write_cache(tmp_path_factory.mktemp("pipe"), n=1000, shard_size=1024)


def start_module(*args: str, stdout: int, cwd: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "dataset_rt", *args],
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
    )


def finish(process: subprocess.Popen[bytes]) -> tuple[int, bytes]:
    """The exit status and standard error of ``process``, killed if it has not ended in 60 s."""
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        _, err = process.communicate()
        raise
    return process.returncode, err


@pytest.mark.parametrize(
    "args", [["inspect", "--json"], ["head", "-n", "1000"]], ids=["inspect-json", "head"]
)
def test_output_piped_into_head_ends_quietly_with_the_sigpipe_status(
    many_records: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """`dataset-rt ... | head -1`: the reader takes one line and closes the pipe while the
    command still has output to write."""
    import fcntl

    assert main([*args, str(many_records)]) == EXIT_OK
    whole = capsys.readouterr().out.encode()
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, 4096)  # the command blocks after one page
        assert len(whole) > 2 * 4096
        process = start_module(*args, str(many_records), stdout=write_end, cwd=tmp_path)
    finally:
        os.close(write_end)
    try:
        line = b""
        while not line.endswith(b"\n"):
            byte = os.read(read_end, 1)
            assert byte, "the output ended before its first line"
            line += byte
    finally:
        os.close(read_end)
    status, err = finish(process)
    assert line == whole.splitlines(keepends=True)[0]
    assert (status, err.decode()) == (EXIT_PIPE, "")


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "CACHE"],
        ["inspect", "--json", "CACHE"],
        ["verify", "CACHE"],
        ["head", "CACHE"],
        ["view", "CACHE", "--limit", "2"],
        ["--version"],
        ["--help"],
        ["pack", "SRC", "OUT", "--quiet"],
    ],
    ids=lambda args: "-".join(a for a in args if a.isalpha() or a.startswith("--")),
)
def test_every_command_writing_to_a_closed_pipe_ends_quietly_with_the_sigpipe_status(
    many_records: Path, tmp_path: Path, args: list[str]
) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_bytes(b"a")
    where = {"CACHE": str(many_records), "SRC": str(tmp_path / "src"), "OUT": str(tmp_path / "o")}
    read_end, write_end = os.pipe()
    os.close(read_end)  # no reader: the command's first write to its output fails
    try:
        process = start_module(*[where.get(a, a) for a in args], stdout=write_end, cwd=tmp_path)
    finally:
        os.close(write_end)
    status, err = finish(process)
    assert (status, err.decode()) == (EXIT_PIPE, "")


def test_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == EXIT_USAGE
    assert "COMMAND" in capsys.readouterr().err
    assert main(["head", "x", "-n", "-1"]) == EXIT_USAGE
    assert "expected an integer >= 0" in capsys.readouterr().err
    # One message for every value out of range, the one that names the bound.
    for value in ("-5", "0"):
        assert main(["demo", "--samples", value]) == EXIT_USAGE
        assert f"expected an integer >= 1, got '{value}'" in capsys.readouterr().err
    assert main(["--help"]) == EXIT_OK
    out = capsys.readouterr().out
    for command in ("inspect", "verify", "head", "pack", "demo"):
        assert command in out
    assert main(["--version"]) == EXIT_OK
    assert capsys.readouterr().out.strip() == f"dataset-rt {dataset_rt.__version__}"
