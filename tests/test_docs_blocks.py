"""Every ```python block of README.md and docs/*.md runs.

A page's blocks run in order, in one namespace (a block may use what an earlier one of its page
defined), in a fresh working directory, with the stand-ins of tests/docs_standins.py defined
(`load_my_images`, `decode_image`, `Train`, ...). An HTML comment on the line before a block, which
neither a forge nor the docs site shows, says how to treat it:

- `<!-- docs-test: signature -->`: a signature or an outline, not meant to run: skipped;
- `<!-- docs-test: launched -->`: a whole script that a training framework launches in several
  processes (docs/frameworks.md): skipped here, run by tests/frameworks/test_docs_scripts.py;
- `<!-- docs-test: torch -->`: needs PyTorch; it runs where torch is installed, and otherwise the
  page's test is skipped after its other blocks (CI, which requires torch, fails on that skip).
"""

from __future__ import annotations

import gc
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import docs_standins
import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<kind>[\w-]+)\s*-->\s*$")
KINDS = {"launched", "signature", "torch"}
USES_TORCH = re.compile(r"\btorch\.|\bimport torch\b|\bdataset_rt\.torch\b|to_torch_iterable")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str
    kind: str | None  # from the marker before it
    source: str


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of `page`, each with the marker on the line before it, if any."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        assert end < len(lines), f"{page.name}:{i + 1}: a code fence that is never closed"
        marker = MARKER.match(lines[i - 1]) if i else None
        body = textwrap.dedent("\n".join(line.removeprefix(indent) for line in lines[i + 1 : end]))
        found.append(
            Block(page, i + 1, opening["info"].strip(), marker["kind"] if marker else None, body)
        )
        i = end + 1
    return found


def markers_without_a_block(page: Path) -> list[str]:
    lines = page.read_text().splitlines()
    return [
        f"{page.name}:{n + 1}: {line.strip()}"
        for n, line in enumerate(lines)
        if MARKER.match(line) and not (n + 1 < len(lines) and FENCE.match(lines[n + 1]))
    ]


def python_blocks(page: Path) -> list[Block]:
    return [b for b in blocks(page) if b.language == "python"]


def page_param(page: Path):
    needs_torch = any(b.kind == "torch" for b in python_blocks(page))
    marks = [pytest.mark.torch] if needs_torch else []
    return pytest.param(page, marks=marks, id=str(page.relative_to(ROOT)))


RUNNABLE_PAGES = [page_param(page) for page in PAGES if python_blocks(page)]


def test_there_are_blocks_to_run():
    pages = {p.values[0].name for p in RUNNABLE_PAGES}
    assert {"README.md", "python-api.md"} <= pages


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_markers_are_known_and_precede_a_python_block(page):
    bad = [
        f"{b.page.name}:{b.line}: {b.kind!r} on a {b.language or 'plain'} block"
        for b in blocks(page)
        if b.kind is not None and (b.kind not in KINDS or b.language != "python")
    ]
    assert bad + markers_without_a_block(page) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_blocks_that_use_torch_are_marked(page):
    unmarked = [
        f"{b.page.name}:{b.line}"
        for b in python_blocks(page)
        if b.kind is None and USES_TORCH.search(b.source)
    ]
    assert unmarked == [], "mark these blocks <!-- docs-test: torch -->"


def close_what_the_page_opened(namespace: dict[str, object]) -> None:
    """Closes the runtimes and loaders the page's blocks left open."""
    for value in list(namespace.values()):
        close = getattr(value, "close", None)
        if type(value).__module__.startswith("dataset_rt") and callable(close):
            close()


@pytest.mark.timeout(120)
# torch's advice when an example's worker count exceeds the cores of a small test machine.
@pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")
@pytest.mark.parametrize("page", RUNNABLE_PAGES)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    try:
        import torch  # noqa: F401

        have_torch = True
    except ImportError:
        have_torch = False
    monkeypatch.chdir(tmp_path)
    docs_standins.reset()
    namespace: dict[str, object] = {"__name__": "__docs__"}
    namespace.update({name: getattr(docs_standins, name) for name in docs_standins.__all__})
    not_run: list[str] = []
    try:
        for block in python_blocks(page):
            where = f"{page.relative_to(ROOT)}:{block.line}"
            if block.kind in ("signature", "launched"):
                continue
            if block.kind == "torch" and not have_torch:
                not_run.append(where)
                continue
            # Padded so that a traceback names the block's own lines of the page.
            code = compile("\n" * block.line + block.source, str(page), "exec")
            try:
                exec(code, namespace)
            except Exception as error:
                raise AssertionError(f"the block at {where} raised {error!r}") from error
    finally:
        close_what_the_page_opened(namespace)
        # What the blocks kept (batches, views of the loader's result memory) goes with them.
        namespace.clear()
        docs_standins.reset()
        gc.collect()
    if not_run:
        pytest.skip(f"PyTorch is not installed: blocks not run: {', '.join(not_run)}")
