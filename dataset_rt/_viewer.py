"""``dataset-rt view``: a self-contained HTML page (or a PNG contact sheet) of a cache's samples.

The cache is opened read-only through :meth:`DatasetRuntime.open_caches`; reading and checking
the records happens in Rust. This module only filters rows, decodes thumbnails with Pillow (an
optional dependency, the ``view`` extra) and writes the page.

Everything taken from the cache (metadata, ids, payload text) is untrusted: it is HTML-escaped,
and the page carries a Content-Security-Policy that allows no script at all.
"""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dataset_rt._config import RemoteConfig

__all__ = ["FilterError", "ViewSample", "parse_filters", "read_samples", "render_html"]

THUMBNAIL_SIZE = 128
PREVIEW_BYTES = 64


class FilterError(ValueError):
    """A ``--filter`` expression that is malformed or names an unknown column."""


@dataclass(frozen=True, slots=True)
class Filter:
    column: str
    value: str
    negate: bool


@dataclass(frozen=True, slots=True)
class ViewSample:
    index: int
    row: dict[str, Any]
    data: bytes


def _pillow() -> ModuleType:
    try:
        import PIL.Image
    except ImportError:
        raise ImportError(
            "dataset-rt view needs Pillow to decode images; install it with "
            "`pip install 'dataset-rt[view]'` (or `pip install pillow`)"
        ) from None
    return PIL.Image


def parse_filters(expressions: Sequence[str]) -> list[Filter]:
    """Parses ``column=value`` and ``column!=value`` (no evaluation: the text is split at the
    first ``!=`` or ``=``)."""
    filters = []
    for expr in expressions:
        at = expr.find("=")
        negate = at > 0 and expr[at - 1] == "!"
        column, value = expr[: at - 1 if negate else at].strip(), expr[at + 1 :]
        if at < 0 or not column:
            raise FilterError(
                f"--filter {expr!r}: expected COLUMN=VALUE or COLUMN!=VALUE, e.g. label=cat"
            )
        filters.append(Filter(column, value, negate))
    return filters


def read_samples(
    cache: str | Path,
    filters: Sequence[Filter],
    limit: int,
    *,
    remote: RemoteConfig | None = None,
) -> list[ViewSample]:
    """The first ``limit`` samples of ``cache`` in storage order whose metadata matches every
    filter, with their full ``samples_metadata`` row (weight included) and payload.

    ``cache`` is a local cache directory (base/name) or the URL of a published cache
    (``s3://bucket/prefix/NAME``, ``file:///dir/NAME``), read in place through the local cache
    that ``remote`` configures (``None``: the defaults and the environment); ``remote`` is
    unused for a local directory."""
    import polars as pl

    from dataset_rt._config import ReaderConfig, is_url
    from dataset_rt._native import CacheMalformedError, ConfigError
    from dataset_rt._results import (
        CacheMalformed,
        CacheSourcesDatasetError,
        CacheSourcesDatasetSuccess,
    )
    from dataset_rt._runtime import DatasetRuntime

    reader_config = ReaderConfig(shuffle=False)
    with DatasetRuntime(num_workers=2) as runtime:
        result: CacheSourcesDatasetSuccess | CacheSourcesDatasetError
        if isinstance(cache, str) and is_url(cache):
            base_url, _, name = cache.rstrip("/").rpartition("/")
            if not name or not is_url(base_url):
                raise ConfigError(
                    f"{cache}: expected the URL of a cache, s3://BUCKET/PREFIX/NAME or "
                    "file:///DIR/NAME"
                )
            result = runtime.open_caches(name, base_url, reader_config=reader_config, remote=remote)
        else:
            path = Path(cache)
            result = runtime.open_caches(path.name, path.parent, reader_config=reader_config)
        if not isinstance(result, CacheSourcesDatasetSuccess) or not result.dataset.num_samples:
            messages = [getattr(r, "message", "") for r in result.results]
            refusal = (
                f"{cache}: not a readable cache: " + "; ".join(m for m in messages if m)
                if any(messages)
                else f"{cache}: not a readable cache"
            )
            # A cache that fails validation is a failed operation, as for `verify`; a path
            # that holds no cache is a usage error.
            if any(isinstance(r, CacheMalformed) for r in result.results):
                raise CacheMalformedError(refusal)
            raise ConfigError(refusal)
        dataset = result.dataset
        table = dataset.samples_metadata().with_row_index("__index")
        for f in filters:
            if f.column not in table.columns or f.column == "__index":
                known = ", ".join(c for c in table.columns if c != "__index")
                raise FilterError(f"--filter: unknown column {f.column!r}; columns are {known}")
            text = pl.col(f.column).cast(pl.String)
            table = table.filter(text != f.value if f.negate else text == f.value)
        table = table.head(limit)
        wanted = {
            int(i): row
            for i, row in zip(table["__index"], table.iter_rows(named=True), strict=True)
        }
        found: list[ViewSample] = []
        if wanted:
            for batch in dataset.iter_batches(256):
                for index, data in zip(batch.indices, batch.data, strict=True):
                    row = wanted.get(int(index))
                    if row is not None:
                        row.pop("__index")
                        found.append(ViewSample(int(index), row, bytes(data)))
                if len(found) == len(wanted):
                    break
    return found


def thumbnail_png(data: bytes) -> bytes | None:
    """A small PNG of ``data`` when Pillow can decode it as an image, else ``None``."""
    image_module: Any = _pillow()
    try:
        with image_module.open(io.BytesIO(data)) as image:
            image.thumbnail((THUMBNAIL_SIZE, THUMBNAIL_SIZE))
            out = io.BytesIO()
            image.convert("RGBA").save(out, format="PNG")
    except Exception:  # Pillow raises many kinds for data that is not an image
        return None
    return out.getvalue()


def _text_preview(data: bytes) -> str:
    return "".join(chr(b) if 32 <= b < 127 else "." for b in data[:PREVIEW_BYTES])


_STYLE = """
body { font-family: sans-serif; margin: 1em; background: #fafafa; color: #222; }
.grid { display: flex; flex-wrap: wrap; gap: 12px; }
.sample { background: #fff; border: 1px solid #ccc; padding: 8px; width: 260px; margin: 0; }
.sample img { display: block; margin: 0 auto 6px; image-rendering: pixelated; }
.sample pre { font-size: 11px; white-space: pre-wrap; word-break: break-all; background: #eee;
  padding: 4px; margin: 4px 0; }
.sample table { font-size: 12px; border-collapse: collapse; }
.sample th { text-align: left; padding-right: 6px; color: #555; }
"""


def render_html(cache: str, samples: Sequence[ViewSample], filters: Sequence[str]) -> str:
    """One self-contained page: inline style, thumbnails as ``data:`` URIs, no script."""
    e = html.escape
    parts = [
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>",
        "<meta http-equiv='Content-Security-Policy' content=\"default-src 'none'; "
        "img-src data:; style-src 'unsafe-inline'\">",
        f"<title>dataset-rt view: {e(cache)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{e(cache)}</h1>",
        f"<p id='summary'>{len(samples)} sample(s)"
        + (f", filter: {e(' AND '.join(filters))}" if filters else "")
        + "</p><div class='grid'>",
    ]
    for sample in samples:
        parts.append(f"<figure class='sample' data-index='{sample.index}'>")
        png = thumbnail_png(sample.data)
        if png is not None:
            uri = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
            parts.append(f"<img src='{uri}' alt='sample {sample.index}'>")
        else:
            more = "…" if len(sample.data) > PREVIEW_BYTES else ""
            parts.append(f"<pre class='hex'>{sample.data[:PREVIEW_BYTES].hex(' ')}{more}</pre>")
            parts.append(f"<pre class='text'>{e(_text_preview(sample.data))}{more}</pre>")
        parts.append(f"<figcaption><table><tr><th>index</th><td>{sample.index}</td></tr>")
        parts.append(f"<tr><th>bytes</th><td>{len(sample.data)}</td></tr>")
        for key, value in sample.row.items():
            parts.append(f"<tr><th>{e(str(key))}</th><td>{e(str(value))}</td></tr>")
        parts.append("</table></figcaption></figure>")
    parts.append("</div></body></html>\n")
    return "".join(parts)


def render_png(samples: Sequence[ViewSample], columns: int = 8) -> bytes:
    """A grid contact sheet; a payload that is not an image is a gray tile with its id."""
    image_module: Any = _pillow()
    from PIL import ImageDraw

    tile, label = THUMBNAIL_SIZE, 14
    cols = max(1, min(columns, len(samples)))
    rows = max(1, -(-len(samples) // cols))
    sheet = image_module.new("RGB", (cols * (tile + 4), rows * (tile + label + 4)), "white")
    draw = ImageDraw.Draw(sheet)
    for n, sample in enumerate(samples):
        x, y = (n % cols) * (tile + 4) + 2, (n // cols) * (tile + label + 4) + 2
        name = str(sample.row.get("sample_id", sample.index))[:20]
        png = thumbnail_png(sample.data)
        if png is None:
            draw.rectangle((x, y, x + tile - 1, y + tile - 1), fill=(160, 160, 160))
            draw.text((x + 4, y + tile // 2 - 6), name, fill=(0, 0, 0))
        else:
            with image_module.open(io.BytesIO(png)) as thumb:
                sheet.paste(thumb.convert("RGB"), (x, y))
        draw.text((x, y + tile + 1), name, fill=(0, 0, 0))
    out = io.BytesIO()
    sheet.save(out, format="PNG")
    return out.getvalue()
