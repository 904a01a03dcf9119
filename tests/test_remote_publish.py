"""Caches published on object storage: ``dataset-rt push``, ``pull`` and ``ls`` (and the native
functions under them) over ``file://`` URLs and a real S3 server, and ``RemoteConfig``.

The S3 server is moto's (``moto[server]``, installed by ``make install``), started once for this
module in a thread of this process on 127.0.0.1 and stopped after it. Since it serves from a
thread of this process, every S3 test also checks that the native calls release the GIL while
they wait: otherwise the server could not answer and the test would hang until its timeout.
Objects are kept small: moto reads a whole object for each request.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import boto3
import pytest
from moto.server import ThreadedMotoServer

from dataset_rt import (
    CacheInput,
    CacheMalformedError,
    CacheSourcesDatasetSuccess,
    ConfigError,
    DatasetRTError,
    DatasetRuntime,
    ReaderConfig,
    RemoteConfig,
    ShardCompression,
    WriterConfig,
    _native,
)
from dataset_rt.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from dataset_rt.testing import make_source

BUCKET = "dataset-rt-test"
# Dummy credentials, distinctive enough that a message quoting them would be caught.
ACCESS_KEY = "AKIADATASETRTTEST0001"
SECRET_KEY = "dataset-rt-secret-key-never-shown-0123456789"
SESSION_TOKEN = "dataset-rt-session-token-never-shown-abcdef"
SECRETS = (SECRET_KEY, SESSION_TOKEN, ACCESS_KEY)
# Variables of the AWS tools that would change where requests go, cleared for every test.
OTHER_AWS_VARIABLES = (
    "AWS_PROFILE",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_ARN",
)
# A generous bound for an error that must come "within seconds".
QUICK_SECONDS = 20


# --- caches ------------------------------------------------------------------------------------


def payload(i: int) -> bytes:
    return f"<sample {i:03d}>".encode() * (2 + i % 7)


class Source:
    def __init__(self, name: str, n: int, salt: str = "") -> None:
        self.name = name
        self.n = n
        self.salt = salt

    def __iter__(self) -> Iterator[CacheInput]:
        for i in range(self.n):
            yield CacheInput(data=payload(i) + self.salt.encode(), metadata={"label": i % 3})


def write_cache(
    base: Path,
    name: str = "train",
    n: int = 24,
    salt: str = "",
    compression: ShardCompression | None = None,
) -> Path:
    """A small cache of several shards at ``base / name``."""
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            Source(name, n, salt),
            base,
            writer_config=WriterConfig(
                show_progress=False,
                shard_size_bytes=512,
                shard_compression=compression or ShardCompression(),
            ),
        )
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return base / name


def epochs(base: Path, name: str = "train") -> tuple[str, list[list[tuple[bytes, Any]]]]:
    """The fingerprint of the cache ``base / name`` and its first two shuffled epochs."""
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.open_caches(name, base, reader_config=ReaderConfig(seed=11))
        assert isinstance(result, CacheSourcesDatasetSuccess), result
        dataset = result.dataset
        read = []
        for epoch in (0, 1):
            dataset.set_epoch(epoch)
            read.append([(bytes(s.data), s.metadata) for s in dataset])
        return dataset.fingerprint, read


def manifest_fingerprint(cache: Path) -> str:
    fingerprint: str = json.loads((cache / "manifest.json").read_text())["fingerprint"]
    return fingerprint


# --- where caches are published ----------------------------------------------------------------


class Store(Protocol):
    """A place to publish, and raw access to its objects (to damage them, or to see them)."""

    def url(self, rel: str) -> str: ...
    def objects(self) -> list[str]: ...
    def read(self, rel: str) -> bytes: ...
    def write(self, rel: str, data: bytes) -> None: ...
    def delete(self, rel: str) -> None: ...


class FileStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def url(self, rel: str) -> str:
        return f"{self.root.as_uri()}/{rel}"

    def objects(self) -> list[str]:
        if not self.root.exists():
            return []
        return sorted(
            p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file()
        )

    def read(self, rel: str) -> bytes:
        return (self.root / rel).read_bytes()

    def write(self, rel: str, data: bytes) -> None:
        path = self.root / rel
        path.chmod(0o644)
        path.write_bytes(data)

    def delete(self, rel: str) -> None:
        (self.root / rel).unlink()


class S3Store:
    def __init__(self, client: Any, prefix: str) -> None:
        self.client = client
        self.prefix = prefix

    def url(self, rel: str) -> str:
        return f"s3://{BUCKET}/{self.prefix}/{rel}"

    def objects(self) -> list[str]:
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix=f"{self.prefix}/")
        return sorted(o["Key"][len(self.prefix) + 1 :] for o in listed.get("Contents", []))

    def read(self, rel: str) -> bytes:
        body = self.client.get_object(Bucket=BUCKET, Key=f"{self.prefix}/{rel}")["Body"]
        return bytes(body.read())

    def write(self, rel: str, data: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=f"{self.prefix}/{rel}", Body=data)

    def delete(self, rel: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=f"{self.prefix}/{rel}")


def free_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 for this module, with the test bucket; stopped after."""
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id=ACCESS_KEY,
            aws_secret_access_key=SECRET_KEY,
        ).create_bucket(Bucket=BUCKET)
        yield endpoint
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The AWS environment pointing at the server, as a user would set it."""
    for name in OTHER_AWS_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SESSION_TOKEN", SESSION_TOKEN)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    return s3_endpoint


def s3_store(endpoint: str) -> S3Store:
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
    )
    return S3Store(client, f"run-{uuid.uuid4().hex[:12]}")


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    """Each test that takes it runs over a ``file://`` URL and over the S3 server."""
    if request.param == "file":
        return FileStore(tmp_path / "published")
    endpoint = request.getfixturevalue("s3_env")
    return s3_store(endpoint)


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, text


# --- push, ls, pull ----------------------------------------------------------------------------


def test_push_ls_pull_gives_the_same_cache_and_epochs(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = write_cache(tmp_path / "src")
    assert len(list((original / "shards").iterdir())) > 1
    url = store.url("train")

    assert main(["push", str(original), url]) == EXIT_OK
    out = capsys.readouterr().out
    assert f"published {original} at {url}" in out
    assert {"manifest.json", "index.bin", "metadata.arrow"} <= {
        k.split("/")[-1] for k in store.objects()
    }
    # The manifest is the local one, byte for byte; the files sit under the build's prefix.
    assert store.read("train/manifest.json") == (original / "manifest.json").read_bytes()
    assert all(
        k == "train/manifest.json" or k.startswith("train/.builds/") for k in store.objects()
    )

    assert main(["ls", store.url("")[:-1]]) == EXIT_OK
    listed = capsys.readouterr().out
    assert f"{url}: 24 samples" in listed
    [cache] = _native.list_caches(url, RemoteConfig())
    assert cache["fingerprint"] == manifest_fingerprint(original)
    assert cache["num_samples"] == 24 and cache["error"] is None

    dest = tmp_path / "dst" / "train"
    assert main(["pull", url, str(dest)]) == EXIT_OK
    assert "downloaded and verified" in capsys.readouterr().out
    for path in original.rglob("*"):
        if path.is_file():
            assert (dest / path.relative_to(original)).read_bytes() == path.read_bytes()
    assert epochs(dest.parent) == epochs(original.parent)
    # Again: the directory already holds this cache, nothing is downloaded.
    report = _native.pull_cache(url, dest, RemoteConfig())
    assert report["already_present"] and report["bytes"] == 0 and report["dir"] == dest


def test_a_second_push_of_the_same_cache_uploads_nothing(store: Store, tmp_path: Path) -> None:
    original = write_cache(tmp_path / "src")
    first = _native.push_cache(original, store.url("train"), RemoteConfig())
    assert len(first["uploaded"]) == len(store.objects()) - 1 and not first["already_published"]
    again = _native.push_cache(original, store.url("train"), RemoteConfig())
    assert again["already_published"] and again["uploaded"] == []


def test_an_interrupted_push_is_invisible_and_the_next_push_resumes_it(
    store: Store, tmp_path: Path
) -> None:
    original = write_cache(tmp_path / "src")
    url = store.url("train")
    _native.push_cache(original, url, RemoteConfig())
    # What a push interrupted before its commit leaves: some build files, no manifest.
    store.delete("train/manifest.json")
    builds = [k for k in store.objects() if "/shards/" in k]
    store.delete(builds[0])
    assert _native.list_caches(url, RemoteConfig()) == []
    with pytest.raises(FileNotFoundError, match="no cache is published there"):
        _native.pull_cache(url, tmp_path / "dst" / "train", RemoteConfig())
    assert not (tmp_path / "dst" / "train").exists()

    report = _native.push_cache(original, url, RemoteConfig())
    assert report["uploaded"] == [builds[0].split("/", 3)[3]]
    assert len(report["resumed"]) == len(store.objects()) - 2
    assert _native.list_caches(url, RemoteConfig())[0]["fingerprint"] == report["fingerprint"]


def test_push_to_a_url_holding_a_cache_is_refused_unless_replace(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = write_cache(tmp_path / "a")
    second = write_cache(tmp_path / "b", salt="other")
    url = store.url("train")
    assert main(["push", str(first), url]) == EXIT_OK
    first_fingerprint = _native.list_caches(url, RemoteConfig())[0]["fingerprint"]
    capsys.readouterr()

    assert main(["push", str(second), url]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"{url} already holds a cache (fingerprint {first_fingerprint})" in err
    assert "--replace" in err
    with pytest.raises(FileExistsError, match="already holds a cache"):
        _native.push_cache(second, url, RemoteConfig())
    assert _native.list_caches(url, RemoteConfig())[0]["fingerprint"] == first_fingerprint

    assert main(["push", str(second), url, "--replace"]) == EXIT_OK
    assert f"replaced the cache with fingerprint {first_fingerprint}" in capsys.readouterr().out
    [listed] = _native.list_caches(url, RemoteConfig())
    assert listed["fingerprint"] == manifest_fingerprint(second) != first_fingerprint
    dest = tmp_path / "dst" / "train"
    _native.pull_cache(url, dest, RemoteConfig())
    assert epochs(dest.parent) == epochs(second.parent)


def test_a_cache_damaged_on_the_server_is_named_and_pull_leaves_nothing(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    original = write_cache(tmp_path / "src")
    url = store.url("train")
    _native.push_cache(original, url, RemoteConfig())
    shard = next(k for k in store.objects() if k.endswith("/shards/000001.bin"))
    data = bytearray(store.read(shard))
    data[len(data) // 2] ^= 0x20  # same size: only the checksum can tell
    store.write(shard, bytes(data))

    dest = tmp_path / "dst" / "train"
    assert main(["pull", url, str(dest)]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert store.url(shard) in err and "checksum mismatch" in err and "damaged" in err
    with pytest.raises(CacheMalformedError, match=r"shards/000001\.bin"):
        _native.pull_cache(url, dest, RemoteConfig())
    assert not dest.exists()
    # Nothing but the lock file beside it: no temporary directory is left behind.
    assert [p.name for p in dest.parent.iterdir()] == [".train.lock"]


def test_pull_refuses_a_directory_that_is_not_named_after_the_cache_or_holds_another(
    store: Store, tmp_path: Path
) -> None:
    url = store.url("train")
    _native.push_cache(write_cache(tmp_path / "src"), url, RemoteConfig())
    with pytest.raises(ConfigError, match="must end in the cache's name"):
        _native.pull_cache(url, tmp_path / "dst" / "valid", RemoteConfig())
    other = write_cache(tmp_path / "other", salt="x")
    manifest = (other / "manifest.json").read_bytes()
    with pytest.raises(FileExistsError, match="holds another cache"):
        _native.pull_cache(url, other, RemoteConfig())
    assert (other / "manifest.json").read_bytes() == manifest
    # An empty directory of the cache's name is not in the way: the pull takes its place.
    empty = tmp_path / "dst" / "train"
    empty.mkdir(parents=True)
    _native.pull_cache(url, empty, RemoteConfig())
    source = tmp_path / "src" / "train"
    assert (empty / "manifest.json").read_bytes() == (source / "manifest.json").read_bytes()


def test_a_local_dir_that_cannot_be_made_is_a_config_error(tmp_path: Path) -> None:
    """Not a missing cache: the cache is published, the local directory is what is wrong."""
    url = f"file://{tmp_path}/remote"
    _native.push_cache(write_cache(tmp_path / "src"), f"{url}/train", RemoteConfig())
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with DatasetRuntime(num_workers=1) as runtime:
        for local_dir in (blocker / "below", Path("/proc/dataset-rt-nowhere")):
            with pytest.raises(ConfigError, match=r"RemoteConfig\.local_dir") as raised:
                runtime.open_caches("train", url, remote=RemoteConfig(local_dir=local_dir))
            assert str(local_dir) in str(raised.value)


def test_a_source_that_fails_at_a_url_is_named_by_the_url(tmp_path: Path) -> None:
    """Its message names where the cache would be, not the staging directory, which is gone."""

    class NoIter:
        name = "ghost"

    url = f"file://{tmp_path}/remote"
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.from_cache_sources(
            NoIter(), url, remote=RemoteConfig(local_dir=tmp_path / "n")
        )
    (failed,) = result.results
    assert failed.path == f"{url}/ghost"
    assert f"no cache at {url}/ghost" in failed.message and ".publish" not in failed.message


def test_ls_of_a_prefix_without_caches_says_so(
    store: Store, capsys: pytest.CaptureFixture[str]
) -> None:
    if isinstance(store, FileStore):
        store.root.mkdir()
    assert main(["ls", store.url("nothing")]) == EXIT_OK
    assert "no cache is published at" in capsys.readouterr().out


# --- errors ------------------------------------------------------------------------------------


def moto_auth(endpoint: str, allowed_requests: str) -> None:
    """Turns moto's credential checks on ("0": from the next request) or off ("inf")."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=allowed_requests.encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_refused_credentials_are_a_clear_error_quickly(
    s3_env: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = s3_store(s3_env)
    url = store.url("train")
    original = write_cache(tmp_path / "src")
    _native.push_cache(original, url, RemoteConfig())
    moto_auth(s3_env, "0")  # the dummy key is in no account of the server: every request fails
    try:
        for call in (
            lambda: _native.list_caches(url, RemoteConfig()),
            lambda: _native.pull_cache(url, tmp_path / "dst" / "train", RemoteConfig()),
            lambda: _native.push_cache(original, url, RemoteConfig(), True),
        ):
            started = time.monotonic()
            with pytest.raises(PermissionError) as raised:
                call()
            assert time.monotonic() - started < QUICK_SECONDS
            message = str(raised.value)
            assert url in message and "AWS_ACCESS_KEY_ID" in message, message
            assert_no_secret(message)
        assert main(["ls", url]) == EXIT_FAILED
        err = capsys.readouterr().err
        assert "403" in err and "AWS_ACCESS_KEY_ID" in err
        assert_no_secret(err)
    finally:
        moto_auth(s3_env, "inf")
    assert not (tmp_path / "dst" / "train").exists()


@pytest.mark.parametrize("how", ["environment", "flag"])
def test_an_unreachable_endpoint_is_a_clear_error_quickly(
    how: str,
    s3_env: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    url = f"s3://{BUCKET}/somewhere/train"
    flags = []
    if how == "environment":
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead)
    else:
        monkeypatch.delenv("AWS_ALLOW_HTTP")
        flags = ["--endpoint", dead, "--allow-http"]
    started = time.monotonic()
    assert main(["ls", url, *flags]) == EXIT_FAILED
    assert time.monotonic() - started < QUICK_SECONDS
    err = capsys.readouterr().err
    assert url in err and "check the endpoint" in err, err
    assert_no_secret(err)
    if how == "environment":
        started = time.monotonic()
        with pytest.raises(ConnectionRefusedError, match="check the endpoint"):
            _native.pull_cache(url, tmp_path / "train", RemoteConfig())
        assert not (tmp_path / "train").exists()
        assert time.monotonic() - started < QUICK_SECONDS


def test_ctrl_c_stops_a_command_waiting_on_a_silent_server(tmp_path: Path) -> None:
    # A server that accepts connections and never answers: each request would wait for its
    # whole timeout (30 s, tried again), and Ctrl-C must not wait for that.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY)
        command = [sys.executable, "-m", "dataset_rt", "ls", f"s3://{BUCKET}/x"]
        child = subprocess.Popen(
            [*command, "--endpoint", endpoint, "--allow-http"],
            env=env,
            cwd=Path(__file__).resolve().parent.parent,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(2)  # the import, then the request is sent and waits
            assert child.poll() is None, child.communicate()
            started = time.monotonic()
            child.send_signal(signal.SIGINT)
            _, err = child.communicate(timeout=QUICK_SECONDS)
            assert time.monotonic() - started < 5, err
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
    assert child.returncode != 0
    assert "KeyboardInterrupt" in err
    assert_no_secret(err)


def test_a_server_that_never_answers_is_an_error_after_one_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It takes the connection and sends nothing: with no answer ever heard from the endpoint,
    # the request is not tried again after the client's own retry, so the open fails in about
    # 10 s instead of three attempts' worth (30 s).
    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    with socket.socket() as silent, DatasetRuntime(num_workers=1) as runtime:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        node = RemoteConfig(
            local_dir=tmp_path / "node",
            endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}",
            allow_http=True,
        )
        started = time.monotonic()
        with pytest.raises(TimeoutError) as raised:
            runtime.open_caches("train", f"s3://{BUCKET}/prefix", remote=node)
        assert time.monotonic() - started < QUICK_SECONDS
    err = str(raised.value)
    assert f"s3://{BUCKET}/prefix/train/manifest.json" in err, err
    assert "attempt 1:" in err and "attempt 2:" not in err, err
    assert "has not answered any request yet" in err and "check the endpoint" in err, err
    assert_no_secret(err)


def test_a_missing_bucket_is_named(
    s3_env: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = "s3://no-such-bucket-dataset-rt/x"
    says = 'the bucket "no-such-bucket-dataset-rt" does not exist'
    with pytest.raises(FileNotFoundError, match=says):
        _native.list_caches(url, RemoteConfig())
    assert main(["ls", url]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "s3://no-such-bucket-dataset-rt/x" in err and says in err and "<Error>" not in err
    # Opening, inspecting and pushing say that the bucket is missing, not that no cache is
    # published (which would advise a push into that bucket).
    for command in (
        ["inspect", f"{url}/train"],
        ["push", str(write_cache(tmp_path)), f"{url}/train"],
    ):
        assert main(command) != EXIT_OK
        err = capsys.readouterr().err
        assert says in err and "publish one with" not in err, err
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.open_caches("train", url, remote=RemoteConfig(local_dir=tmp_path / "n"))
    assert says in result.results[0].message


def test_plain_http_is_refused_unless_allowed(
    s3_env: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("AWS_ALLOW_HTTP")
    url = s3_store(s3_env).url("train")
    assert main(["ls", url]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"the endpoint {s3_env} is plain http://" in err and "--allow-http" in err
    assert main(["ls", url, "--allow-http"]) == EXIT_OK
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    assert main(["ls", url]) == EXIT_OK
    assert main(["ls", url, "--no-allow-http"]) == EXIT_USAGE
    with pytest.raises(ConfigError, match=r"RemoteConfig\.allow_http"):
        _native.list_caches(url, RemoteConfig(allow_http=False))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("/data/train", "not a URL"),
        ("gs://bucket/train", "not supported yet"),
        ("s3://Bucket/train", "not a bucket name"),
        ("s3://bucket:9000/train", "endpoint"),
        ("s3://bucket/a/../train", "'..'"),
    ],
)
def test_bad_urls_are_usage_errors(
    url: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = write_cache(tmp_path / "src")
    for argv in (
        ["push", str(cache), url],
        ["pull", url, str(tmp_path / "d" / "train")],
        ["ls", url],
    ):
        assert main(argv) == EXIT_USAGE, argv
        assert says in capsys.readouterr().err
    with pytest.raises(ConfigError, match=says):
        _native.list_caches(url, RemoteConfig())


@pytest.mark.parametrize(
    ("base", "says"),
    [("file://", "names the root directory"), ("s3://", "not a bucket name")],
)
@pytest.mark.parametrize("call", ["open_caches", "from_cache_sources"])
def test_a_base_url_without_a_place_is_refused_as_given(
    base: str, says: str, call: str, tmp_path: Path
) -> None:
    runtime = DatasetRuntime(1)
    try:
        with pytest.raises(ConfigError, match=says) as info:
            what = "x" if call == "open_caches" else make_source("x", [(b"a", {})])
            getattr(runtime, call)(what, base)
    finally:
        runtime.close()
    message = str(info.value)
    assert f"{base!r}".replace("'", '"') in message, message
    assert ":/x" not in message, message


def test_credentials_in_a_url_or_an_endpoint_are_refused_and_never_shown(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ls", f"s3://{ACCESS_KEY}:{SECRET_KEY}@bucket/train"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "environment" in err
    assert_no_secret(err)
    endpoint = f"http://{ACCESS_KEY}:{SECRET_KEY}@127.0.0.1:9000"
    assert main(["ls", "s3://bucket/train", "--endpoint", endpoint]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "RemoteConfig.endpoint" in err
    assert_no_secret(err)


def test_push_names_what_is_wrong_with_the_local_cache(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = (tmp_path / "published").as_uri()
    assert main(["push", str(tmp_path / "missing" / "train"), f"{target}/train"]) == EXIT_USAGE
    assert "no DatasetRT cache at" in capsys.readouterr().err
    cache = write_cache(tmp_path / "src")
    assert main(["push", str(cache), f"{target}/valid"]) == EXIT_USAGE
    assert "push it to a URL ending in /train" in capsys.readouterr().err
    assert main(["push", str(cache), "s3://bucket"]) == EXIT_USAGE
    assert "names no cache" in capsys.readouterr().err


def test_the_commands_need_their_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["push"], ["push", "cache"], ["pull", "s3://bucket/x"], ["ls"]):
        assert main(argv) == EXIT_USAGE
    assert "required" in capsys.readouterr().err
    assert main(["push", "--help"]) == EXIT_OK
    assert "--replace" in capsys.readouterr().out


# --- RemoteConfig ------------------------------------------------------------------------------


def test_remote_config_defaults_and_shape() -> None:
    config = RemoteConfig()
    assert dataclasses.asdict(config) == {
        "local_dir": None,
        "max_local_bytes": None,
        "max_requests": 64,
        "endpoint": None,
        "region": None,
        "allow_http": None,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_requests = 2  # type: ignore[misc]
    assert not hasattr(config, "__dict__")
    with pytest.raises(TypeError):
        RemoteConfig(None)  # type: ignore[misc]
    full = RemoteConfig(
        local_dir=Path("cache"),
        max_local_bytes=1 << 30,
        max_requests=4096,
        endpoint="https://storage.example.com:9000/base",
        region="eu-west-3",
        allow_http=False,
    )
    assert full.max_requests == 4096
    RemoteConfig(local_dir="cache", max_local_bytes=64 << 20, max_requests=1)


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("local_dir", "", "empty"),
        ("local_dir", "cache\x00x", "NUL byte"),
        ("local_dir", 3, "os.PathLike"),
        ("max_local_bytes", 1000, "minimum"),
        ("max_local_bytes", -1, "at least"),
        ("max_local_bytes", True, "at least"),
        ("max_local_bytes", 1.5e9, "at least"),
        ("max_requests", 0, "1..=4096"),
        ("max_requests", 4097, "1..=4096"),
        ("max_requests", None, "from 1 to 4096"),
        ("max_requests", False, "from 1 to 4096"),
        ("max_requests", "8", "from 1 to 4096"),
        ("endpoint", "ftp://host", "http:// or https://"),
        ("endpoint", "not a url", "not a URL"),
        ("endpoint", "http://127.0.0.1:1/?x=1", "query"),
        ("endpoint", "", "not a URL"),
        ("endpoint", b"http://host", "expected a str"),
        ("region", "us east", "region name"),
        ("region", "", "region name"),
        ("region", 1, "expected a str"),
        ("allow_http", 1, "expected a bool"),
        ("allow_http", "true", "expected a bool"),
    ],
)
def test_remote_config_names_each_bad_field(field: str, value: object, says: str) -> None:
    with pytest.raises(ConfigError, match=f"RemoteConfig.{field}") as raised:
        RemoteConfig(**{field: value})  # type: ignore[arg-type]
    assert says in str(raised.value)
    assert isinstance(raised.value, ValueError) and isinstance(raised.value, DatasetRTError)


def test_remote_config_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ls", "s3://bucket/x", "--region", "no spaces"]) == EXIT_USAGE
    assert "RemoteConfig.region" in capsys.readouterr().err
    assert main(["ls", "s3://bucket/x", "--endpoint", "ftp://host"]) == EXIT_USAGE
    assert "RemoteConfig.endpoint" in capsys.readouterr().err


def test_remote_config_holds_no_credentials(s3_env: str) -> None:
    config = RemoteConfig(endpoint=s3_env, region="us-east-1", allow_http=True)
    text = repr(config) + str(config)
    assert_no_secret(text)
    assert [f.name for f in dataclasses.fields(config)] == [
        "local_dir",
        "max_local_bytes",
        "max_requests",
        "endpoint",
        "region",
        "allow_http",
    ]
    assert os.environ["AWS_SECRET_ACCESS_KEY"] == SECRET_KEY
