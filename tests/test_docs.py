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


# --- the README's comparison against the benchmarks page ---------------------------------------

NUMBER = r"\d[\d,]*(?:\.\d+)?"
# A figure of the README: a range of ratios ("2.1-2.8x", with a hyphen or an en dash), a ratio
# ("14.7x", or with the multiplication sign; not the "3x" of "3x224x224"), a rate ("3.7 million",
# "432 thousand", "3.7 M", "1,143,909 samples/s"), a percentage or a time in ms. Sizes, worker
# counts, batch sizes and dates are not figures.
RATIO_RANGE = re.compile(rf"(?<![\w.,])({NUMBER})\s*[\u2013-]\s*({NUMBER})\s*[x\u00d7](?![\w])")
RATIO = re.compile(rf"(?<![\w.,\u2013-])({NUMBER})\s*[x\u00d7](?![\w])")
SCALED = re.compile(rf"(?<![\w.,])({NUMBER})\s*(million|thousand|M|k)\b")
PLAIN = re.compile(rf"(?<![\w.,])({NUMBER})\s*(?:samples/s|%|ms\b)")
SCALES = {"million": 1e6, "M": 1e6, "thousand": 1e3, "k": 1e3}


def readme_figures(text: str) -> list[tuple[str, str, float, int]]:
    """`(as written, kind, value, decimals)` of each figure in `text`; kind "ratio" or "plain"."""
    figures: list[tuple[str, str, float, int]] = []

    def add(token: str, kind: str, scale: float = 1.0) -> None:
        decimals = len(token.split(".")[1]) if "." in token else 0
        figures.append((token, kind, float(token.replace(",", "")) * scale, decimals))

    for match in RATIO_RANGE.finditer(text):
        add(match[1], "ratio")
        add(match[2], "ratio")
    text = RATIO_RANGE.sub(" ", text)
    for match in RATIO.finditer(text):
        add(match[1], "ratio")
    for match in SCALED.finditer(text):
        add(match[1], "plain", SCALES[match[2]])
    for match in PLAIN.finditer(text):
        add(match[1], "plain")
    return figures


def page_figures(text: str) -> dict[str, list[float]]:
    """Every number of `text`, as "ratio" (followed by x or the multiplication sign) or "plain"."""
    found: dict[str, list[float]] = {"ratio": [], "plain": []}
    for match in re.finditer(rf"(?<![\w.])({NUMBER})(\s*[x\u00d7](?!\d))?", text):
        kind = "ratio" if match[2] else "plain"
        found[kind].append(float(match[1].replace(",", "")))
    return found


def missing_figures(readme_text: str, results_text: str) -> list[str]:
    """The README figures that no number of the results states. A figure matches a number of
    its kind that, in the figure's unit and rounded to its decimals, is the figure: "3.7 million"
    matches 3,662,792, "2.8x" matches 2.79x, "14.8x" matches nothing but a 14.8x (or 14.75x)."""
    page = page_figures(results_text)
    missing = []
    for token, kind, value, decimals in readme_figures(readme_text):
        scale = value / float(token.replace(",", ""))
        if not any(
            round(number / scale, decimals) == round(value / scale, decimals)
            for number in page[kind]
        ):
            missing.append(token + ("x" if kind == "ratio" else ""))
    return missing


def section(text: str, heading: str) -> str:
    """The section of `text` under the line `heading` up to the next heading of its level."""
    level = heading.split(" ", 1)[0]
    assert f"\n{heading}\n" in text, f"no heading {heading!r}"
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(rf"\n{level} ", body, maxsplit=1)[0]


def test_the_readme_comparison_quotes_the_current_benchmark_results():
    comparison = section((ROOT / "README.md").read_text(), "## How it compares")
    results = section((DOCS / "benchmarks.md").read_text(), "## Results")
    assert "(docs/benchmarks.md#results)" in comparison, "the comparison links the results"
    assert len(readme_figures(comparison)) >= 10, "the comparison's figures were not found"
    assert missing_figures(comparison, results) == []
    # The commands the README names are the ones the results section gives, with arguments.
    scripts = set(re.findall(r"python (bench/\w+\.py)", comparison))
    assert scripts, "the comparison names the commands that made its figures"
    for script in scripts:
        assert re.search(rf"python {script} --", results), f"no {script} command in the results"


@pytest.mark.parametrize(
    ("readme", "results", "missing"),
    [
        ("about 3.7 million samples/s", "| 3,662,792 |", []),
        ("3.7 M samples/s, 14.7\u00d7 LitData", "3,662,792 ... (DatasetRT 14.7x it)", []),
        ("about 3.8 million samples/s", "| 3,662,792 |", ["3.8"]),
        ("432 thousand samples/s", "| 3,662,792 |", ["432"]),
        ("14.8x LitData", "(DatasetRT 14.7x it)", ["14.8x"]),
        ("12.2x torch", "12.2 ms", ["12.2x"]),
        ("2.1\u20132.8\u00d7 torch", "tensors 2.14x ..., `np.stack` 2.79x", []),
        ("2.1-2.9x torch", "tensors 2.14x ..., `np.stack` 2.79x", ["2.9x"]),
        ("1,143,909 samples/s", "12.2x (1,143,909)", []),
        ("1,143,910 samples/s", "12.2x (1,143,909)", ["1,143,910"]),
        ("101% of a pool", "101% (Pool 2,683)", []),
        ("3x224x224 arrays, batch 64, 2 workers, 4 KiB, 2026-12-02", "", []),
    ],
)
def test_the_comparison_check_finds_what_the_results_do_not_say(readme, results, missing):
    assert missing_figures(readme, results) == missing


def test_the_benchmarks_page_stays_a_page_a_user_reads():
    """The results page holds the current figures, not a notebook of every past run: those
    go to CHANGELOG.md or away (git keeps them)."""
    lines = (DOCS / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= 400, f"docs/benchmarks.md has {len(lines)} lines"
    dated = [line for line in lines if re.match(r"#+ .*\(\d{4}-\d{2}-\d{2}\)", line)]
    assert len(dated) <= 8, f"{len(dated)} dated sections: one per workload"
