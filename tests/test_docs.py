"""The documentation as a whole: it speaks of this repository alone, its links resolve, the
docs site lists every page, and the documented re-exports are `dataset_rt.__all__`.

The Python blocks themselves run in tests/test_docs_blocks.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dataset_rt
import dataset_rt.exceptions

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

# Paths of the machine something ran on (a checkout, a scratch file, a home): meaningless to a
# reader. System paths the project itself uses, such as /dev/shm or /proc, are fine.
MACHINE_PATH = re.compile(
    r"(?<![\w.$~-])(?:/(?:work|home|root|Users|mnt|scratch)\b|/tmp/)|\bcd /tmp\b"
)
# References to a tracker or to documents the repository does not contain.
ISSUE_REFERENCE = re.compile(r"(?i)\bissues?\s+#?\d+|\bissues show\b|(?<![\w&/\]])#\d+\b")
OUTSIDE_DOCUMENT = re.compile(r"(?i)DESIGN\.md|design document|seed/")


def offenders(pattern: re.Pattern[str]) -> list[str]:
    return [
        f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
        for page in PAGES
        for number, line in enumerate(page.read_text().splitlines(), 1)
        if pattern.search(line)
    ]


@pytest.mark.parametrize(
    ("pattern", "what"),
    [
        (MACHINE_PATH, "absolute paths of a particular machine"),
        (ISSUE_REFERENCE, "issue numbers"),
        (OUTSIDE_DOCUMENT, "documents that are not in the repository"),
    ],
    ids=["machine-paths", "issue-numbers", "outside-documents"],
)
def test_docs_speak_of_the_repository_alone(pattern, what):
    assert offenders(pattern) == [], f"the docs mention {what}"


@pytest.mark.parametrize(
    ("line", "pattern"),
    [
        ("cd /tmp && python bench/run_all.py", MACHINE_PATH),
        ("`PYTHONPATH=/tmp/bench_site`", MACHINE_PATH),
        ("on ext4, the same filesystem as `/work`", MACHINE_PATH),
        ("see /home/me/notes", MACHINE_PATH),
        ("writes to (issue 2) and", ISSUE_REFERENCE),
        ("fixed in #123.", ISSUE_REFERENCE),
        ("the issues show that", ISSUE_REFERENCE),
        ("targets of the design document (DESIGN.md)", OUTSIDE_DOCUMENT),
    ],
)
def test_the_hygiene_patterns_catch_what_they_are_for(line, pattern):
    assert pattern.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "segments live in `/dev/shm`",
        "could pull any file (`/proc/self/environ`, a private key)",
        "the sticky bit `/tmp` has",
        "[iterator state](runtime-model.md#iterator-state)",
        "writes `shards/000001.bin`",
    ],
)
def test_the_hygiene_patterns_allow_the_projects_own_paths(line):
    assert not any(p.search(line) for p in (MACHINE_PATH, ISSUE_REFERENCE, OUTSIDE_DOCUMENT))


def documented_names(page: Path, heading: str) -> list[str]:
    """The `names` of the paragraph under `heading` (a whole line of `page`)."""
    text = page.read_text()
    assert f"\n{heading}\n" in text, f"{page.name} has no heading {heading!r}"
    paragraph = text.split(f"\n{heading}\n", 1)[1].strip().split("\n\n", 1)[0]
    return re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", paragraph)


def test_the_documented_re_exports_are_all():
    names = documented_names(DOCS / "python-api.md", "### Re-exported names")
    assert sorted(names) == sorted(dataset_rt.__all__)
    assert len(set(dataset_rt.__all__)) == len(dataset_rt.__all__)


@pytest.mark.parametrize("module", [dataset_rt, dataset_rt.exceptions], ids=lambda m: m.__name__)
def test_every_name_in_all_exists(module):
    missing = [name for name in module.__all__ if not hasattr(module, name)]
    assert missing == []


def test_the_exceptions_are_re_exported_and_documented():
    assert set(dataset_rt.exceptions.__all__) <= set(dataset_rt.__all__)
    for name in dataset_rt.exceptions.__all__:
        assert getattr(dataset_rt, name) is getattr(dataset_rt.exceptions, name)
    table = (DOCS / "python-api.md").read_text().split("\n## Exceptions\n", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \|", table.split("\n## ", 1)[0], re.MULTILINE)
    assert sorted(rows) == sorted(dataset_rt.exceptions.__all__)


LINK = re.compile(r"\]\(([^)\s]+)\)")


def relative_links(page: Path) -> list[str]:
    """`page`'s link targets that are not web addresses or anchors of the page itself."""
    return [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:|#", t)]


def test_the_docs_site_lists_every_page_once():
    nav = re.findall(r"^  - [^:\n]+: (\S+\.md)$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE)
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md"))


def test_the_readme_links_every_page_by_its_repository_path():
    links = {t.split("#")[0] for t in relative_links(ROOT / "README.md")}
    pages = {f"docs/{p.name}" for p in DOCS.glob("*.md")} - {"docs/index.md"}
    assert pages <= links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_files(page):
    # mkdocs checks the anchors of docs/ too (`make docs`); this check also covers README.md and
    # runs with the tests. A link out of docs/ works on a forge but not on the docs site.
    broken = [t for t in relative_links(page) if not (page.parent / t.split("#")[0]).exists()]
    assert broken == []
    if page.parent == DOCS:
        outside = [
            t for t in relative_links(page) if not (page.parent / t).resolve().is_relative_to(DOCS)
        ]
        assert outside == [], "docs/ pages link only within docs/ (the site holds nothing else)"


def test_make_docs_installs_the_docs_extra():
    makefile = (ROOT / "Makefile").read_text()
    extra = re.search(r'^docs = \["([^"]+)"\]$', (ROOT / "pyproject.toml").read_text(), re.M)
    assert extra, "pyproject.toml has no docs extra of one requirement"
    assert f"DOCS_REQUIREMENT := {extra[1]}\n" in makefile
    ci = makefile.split("\nci:\n", 1)[1].split("\n\n", 1)[0]
    assert ci.index("$(MAKE) lint") < ci.index("$(MAKE) docs") < ci.index("$(MAKE) test")
