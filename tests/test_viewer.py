"""``dataset-rt view``: the HTML page, its filters, escaping of untrusted metadata, the PNG
contact sheet, and the page as a headless Chromium renders it."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dataset_rt import CacheSourcesDatasetSuccess, DatasetRuntime, WriterConfig
from dataset_rt.cli import EXIT_OK, EXIT_USAGE, main
from dataset_rt.testing import make_source

Image = pytest.importorskip("PIL.Image", reason="the view extra (Pillow) is not installed")

HOSTILE = "</td><script>alert(1)</script><img src=x onerror=alert(2)>"


def png_bytes(colour: tuple[int, int, int]) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (48, 32), colour).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    """8 samples: even ones are PNG images, odd ones text; one label is hostile markup."""
    samples = []
    for i in range(8):
        data = png_bytes((30 * i, 200, 255 - 30 * i)) if i % 2 == 0 else f"text {i}".encode()
        label = HOSTILE if i == 3 else ("cat", "dog")[i % 2]
        samples.append((data, {"sample_id": i, "label": label, "good": i < 5}))
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.from_cache_sources(
            make_source("pics", samples), tmp_path, writer_config=WriterConfig(show_progress=False)
        )
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return tmp_path / "pics"


def view(cache: Path, out: Path, *extra: str) -> str:
    assert main(["view", str(cache), "--out", str(out), *extra]) == EXIT_OK
    return out.read_text(encoding="utf-8")


def shown(page: str) -> list[int]:
    return [int(i) for i in re.findall(r"<figure class='sample' data-index='(\d+)'>", page)]


def test_page_shows_thumbnails_previews_metadata_and_weight(cache: Path, tmp_path: Path) -> None:
    page = view(cache, tmp_path / "p.html")
    assert shown(page) == list(range(8))
    assert page.count("data:image/png;base64,") == 4
    assert page.count("<pre class='hex'>") == 4
    assert "74 65 78 74 20 31" in page  # "text 1" in hex
    assert "<th>weight</th><td>1.0</td>" in page
    assert "<th>label</th><td>dog</td>" in page
    assert "<script" not in page.lower() and "script-src" not in page


def test_untrusted_metadata_is_escaped(cache: Path, tmp_path: Path) -> None:
    page = view(cache, tmp_path / "p.html")
    assert HOSTILE not in page
    assert "<script" not in page and "onerror=alert(2)>" not in page
    assert "&lt;/td&gt;&lt;script&gt;alert(1)&lt;/script&gt;&lt;img" in page


def test_filters_and_limit(cache: Path, tmp_path: Path) -> None:
    assert shown(view(cache, tmp_path / "a.html", "--filter", "label=cat")) == [0, 2, 4, 6]
    assert shown(view(cache, tmp_path / "b.html", "--filter", "label!=cat")) == [1, 3, 5, 7]
    both = view(cache, tmp_path / "c.html", "--filter", "label=cat", "--filter", "good=true")
    assert shown(both) == [0, 2, 4]
    assert shown(view(cache, tmp_path / "d.html", "--filter", "sample_id=5")) == [5]
    assert shown(view(cache, tmp_path / "e.html", "--limit", "3")) == [0, 1, 2]
    assert shown(view(cache, tmp_path / "f.html", "--filter", "label=none")) == []


def test_bad_filters_are_usage_errors(
    cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "p.html"
    assert main(["view", str(cache), "--out", str(out), "--filter", "colour=red"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "unknown column 'colour'" in err and "label" in err
    assert main(["view", str(cache), "--out", str(out), "--filter", "label"]) == EXIT_USAGE
    assert "expected COLUMN=VALUE" in capsys.readouterr().err
    assert main(["view", str(cache), "--limit", "0"]) == EXIT_USAGE
    assert main(["view", str(tmp_path / "missing"), "--out", str(out)]) == EXIT_USAGE
    assert "not a readable cache" in capsys.readouterr().err
    assert not out.exists()


def test_png_contact_sheet(cache: Path, tmp_path: Path) -> None:
    sheet_path = tmp_path / "sheet.png"
    assert main(["view", str(cache), "--png", str(sheet_path), "--limit", "2"]) == EXIT_OK
    assert not (tmp_path / "view.html").exists()
    with Image.open(sheet_path) as sheet:
        sheet = sheet.convert("RGB")
        assert sheet.size == (2 * 132, 146)
        assert sheet.getpixel((2 + 10, 2 + 10)) == (0, 200, 255)  # sample 0, an image
        assert sheet.getpixel((134 + 2, 2 + 2)) == (160, 160, 160)  # sample 1, a gray tile
        assert len(sheet.getcolors(1 << 16) or []) > 3


def chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None and os.environ.get("DATASET_RT_REQUIRE_BROWSER") == "1":
        pytest.fail("DATASET_RT_REQUIRE_BROWSER=1 (CI) but chromium is not installed")
    if found is None:
        pytest.skip(
            "!!! BROWSER TEST NOT RUN: chromium is not installed; `make install` installs it "
            "(apt-get install chromium) !!!"
        )
    return found


@pytest.mark.browser
def test_page_in_headless_chromium(cache: Path, tmp_path: Path) -> None:
    browser = chromium()
    page = tmp_path / "page.html"
    view(cache, page, "--limit", "6")
    flags = ["--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1200,900"]
    flags += ["--enable-logging=stderr", "--v=0", f"--user-data-dir={tmp_path / 'profile'}"]
    url = page.as_uri()
    dom = subprocess.run(
        [browser, *flags, "--dump-dom", url], capture_output=True, text=True, timeout=90
    )
    assert dom.returncode == 0, dom.stderr
    assert len(re.findall(r'<figure class="sample"', dom.stdout)) == 6
    assert len(re.findall(r"<img src=\"data:image/png", dom.stdout)) == 3
    assert "<script" not in dom.stdout
    console = [
        line
        for line in dom.stderr.splitlines()
        if "CONSOLE" in line or "Uncaught" in line or "Content Security Policy" in line
    ]
    assert console == [], console
    shot = tmp_path / "shot.png"
    run = subprocess.run(
        [browser, *flags, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=90
    )
    assert run.returncode == 0 and shot.exists(), run.stderr
    with Image.open(shot) as image:
        assert image.size == (1200, 900)
        colours = image.convert("RGB").getcolors(1 << 20)
        assert colours is None or len(colours) > 10, "the screenshot is blank"
