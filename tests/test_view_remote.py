"""``dataset-rt view`` on the URL of a published cache (``file://`` and moto's S3 server, the
fixtures of ``test_remote_publish``): the page shows the samples, with the same filters, that the
same command shows for the local cache; a URL holding no cache is a clear error. Every byte
downloaded goes to a local cache directory inside ``tmp_path`` (``DATASET_RT_REMOTE_DIR``)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from test_remote_publish import (  # noqa: F401 (fixtures, used by name)
    ACCESS_KEY,
    OTHER_AWS_VARIABLES,
    SECRET_KEY,
    s3_endpoint,
    s3_store,
)

from dataset_rt import CacheSourcesDatasetSuccess, DatasetRuntime, WriterConfig
from dataset_rt.cli import EXIT_OK, EXIT_USAGE, main
from dataset_rt.testing import make_source

Image = pytest.importorskip("PIL.Image", reason="the view extra (Pillow) is not installed")


def png_bytes(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (24, 16), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """10 samples over several shards: even ones PNG images, odd ones text. The node's local
    cache of downloads is set inside ``tmp_path`` for the whole test."""
    monkeypatch.setenv("DATASET_RT_REMOTE_DIR", str(tmp_path / "node"))
    samples = []
    for i in range(10):
        data = png_bytes((20 * i, 100, 255 - 20 * i)) if i % 2 == 0 else f"text {i}".encode()
        samples.append((data, {"sample_id": i, "label": ("cat", "dog", "eel")[i % 3]}))
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            make_source("pics", samples),
            tmp_path / "src",
            writer_config=WriterConfig(show_progress=False, shard_size_bytes=512),
        )
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return tmp_path / "src" / "pics"


def view(cache: Path | str, out: Path, *extra: str) -> str:
    assert main(["view", str(cache), "--out", str(out), *extra]) == EXIT_OK
    return out.read_text(encoding="utf-8")


def shown(page: str) -> list[int]:
    return [int(i) for i in re.findall(r"<figure class='sample' data-index='(\d+)'>", page)]


def samples_part(page: str) -> str:
    """The page from its first sample on (the header names the cache, local path or URL)."""
    return page[page.index("<figure class='sample'") :]


def test_view_of_a_file_url_shows_what_the_local_cache_shows(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"{(tmp_path / 'published').as_uri()}/pics"
    assert main(["push", str(cache), url]) == EXIT_OK
    for extra in ([], ["--filter", "label=cat"], ["--filter", "label!=dog", "--limit", "3"]):
        local = view(cache, tmp_path / "local.html", *extra)
        remote = view(url, tmp_path / "remote.html", *extra)
        assert shown(remote) == shown(local) and shown(remote), extra
        assert samples_part(remote) == samples_part(local), extra
        assert url in remote
    assert shown(view(url, tmp_path / "cat.html", "--filter", "label=cat")) == [0, 3, 6, 9]
    # The URL's bytes were read through the local cache inside tmp_path.
    assert any((tmp_path / "node").rglob("*"))
    capsys.readouterr()
    # A trailing slash names the same cache.
    assert shown(view(f"{url}/", tmp_path / "slash.html")) == list(range(10))


@pytest.mark.parametrize("where", ["empty", "no-cache"])
def test_view_of_a_url_without_a_cache_is_a_clear_error(
    where: str, cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "published"
    if where == "no-cache":  # another cache is published beside it
        assert main(["push", str(cache), f"{store.as_uri()}/pics"]) == EXIT_OK
    else:
        store.mkdir()
    capsys.readouterr()
    url = f"{store.as_uri()}/missing"
    out = tmp_path / "missing.html"
    assert main(["view", url, "--out", str(out)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert url in err and "not a readable cache" in err, err
    assert not out.exists()


def test_view_of_a_url_that_names_no_cache_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["view", "s3://", "--out", str(tmp_path / "x.html")]) == EXIT_USAGE
    assert "expected the URL of a cache" in capsys.readouterr().err


def test_view_of_an_s3_url_takes_the_remote_flags(
    s3_endpoint: str,  # noqa: F811
    cache: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Credentials from the environment; the endpoint, region and plain HTTP from the flags only.
    for name in (*OTHER_AWS_VARIABLES, "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_ALLOW_HTTP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    flags = ["--endpoint", s3_endpoint, "--region", "us-east-1", "--allow-http"]
    url = s3_store(s3_endpoint).url("pics")
    assert main(["push", str(cache), url, *flags]) == EXIT_OK
    local = view(cache, tmp_path / "local.html", "--filter", "label=eel")
    remote = view(url, tmp_path / "remote.html", "--filter", "label=eel", *flags)
    assert shown(remote) == shown(local) == [2, 5, 8]
    assert samples_part(remote) == samples_part(local)


def test_a_cache_set_at_a_url_is_summarised_under_its_url(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `inspect URL` on a cache set prints the URL as given (a path would fold s3:// into s3:/).
    from dataset_rt.cli import _print_set

    manifest = {
        "name": "s",
        "format": "dataset-rt-cache-set",
        "format_version": 1,
        "writer_version": "dataset-rt 0",
        "num_samples": 5,
        "fingerprint": "f" * 32,
        "parts": [{"name": "s.part-000000", "num_samples": 5, "fingerprint": "0" * 32}],
    }
    for url in ("s3://bucket/prefix/s", "file:///data/published/s"):
        assert _print_set(url, manifest) == EXIT_OK
        assert f"cache set:   {url}\n" in capsys.readouterr().out
