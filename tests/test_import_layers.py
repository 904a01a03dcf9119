"""The import layers of the Python package, held by a test.

Every module of ``dataset_rt`` belongs to one layer; a module may import modules of its own layer
or of lower ones, never of a higher one, and the imports between ``dataset_rt`` modules form no
circle. Imports are read from the source with ``ast``: at module level, inside functions and
methods, and under ``try``; only those under ``if TYPE_CHECKING:`` are left out, since they never
run (an annotation may name a higher layer's type).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = "dataset_rt"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

# Lowest first. A module may import its own layer and those before it.
LAYERS: list[set[str]] = [
    # The Rust extension: everything stands on it.
    {"dataset_rt._native"},
    # Errors and checked configuration: nothing of the package but _native.
    {"dataset_rt.exceptions", "dataset_rt._config"},
    # The in-process reader: datasets, the runtime that opens and writes caches, their results.
    {"dataset_rt._results", "dataset_rt._dataset", "dataset_rt._runtime"},
    # Cache sets: the source type and the worker processes that write its parts.
    {"dataset_rt._sets"},
    # The loader's leaves. signals: stdlib only; lifetimes: the rule for reusing memory.
    {"dataset_rt._loader.signals", "dataset_rt._loader.lifetimes"},
    # The loader's parts that each do one thing (the producer's launcher, slot maps, result
    # memory, bounded stops).
    {
        "dataset_rt._loader.producer",
        "dataset_rt._loader.slots",
        "dataset_rt._loader.results",
        "dataset_rt._loader.lifecycle",
    },
    {"dataset_rt._loader.workers"},
    {"dataset_rt._loader.passes"},
    {"dataset_rt._loader.plan"},
    {"dataset_rt._loader"},
    # What is built on the reader and the loader: adapters, tools, helpers for users' tests.
    {
        "dataset_rt.torch",
        "dataset_rt.ray",
        "dataset_rt._viewer",
        "dataset_rt._demo",
        "dataset_rt.testing",
    },
    {"dataset_rt.cli"},
    # The facade and the command's entry.
    {"dataset_rt", "dataset_rt.__main__"},
]

# The producer runs ``python -I -S`` with a launcher that registers bare packages (see
# dataset_rt/_loader/producer.py): it can import these modules of the package and nothing else,
# and no module outside the standard library.
PRODUCER_IMPORTS = {"dataset_rt._native", "dataset_rt._loader.signals"}

# Imports of a higher layer that are allowed, each with why. Left out of the circle check too.
ALLOWED_UP: dict[tuple[str, str], str] = {
    # Dataset.to_torch_iterable_dataset() is the documented way to the torch adapter; the import
    # is inside the method, so `dataset_rt` never imports torch unless asked.
    ("dataset_rt._dataset", "dataset_rt.torch"): "optional adapter's entry point, lazy",
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: set[str]) -> None:
        self.module = module
        self.package = module if is_package else module.rpartition(".")[0]
        self.known = known
        self.found: list[tuple[str, int]] = []  # (imported module, line)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            for child in node.orelse:  # the else branch runs
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.found.append((alias.name, node.lineno))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            target = ".".join([*base, node.module] if node.module else base)
        else:
            target = node.module or ""
        for alias in node.names:
            # `from package import module` imports the submodule; anything else is a name of
            # `target` itself.
            sub = f"{target}.{alias.name}"
            self.found.append((sub if sub in self.known else target, node.lineno))


def package_imports(root: Path = ROOT) -> dict[str, list[tuple[str, int]]]:
    """Each module of the package under ``root``: the modules it imports, with their lines."""
    files = {module_name(path, root): path for path in sorted(root.rglob("*.py"))}
    # Extension modules (the Rust one) are known by their stubs; they import nothing of ours.
    graph: dict[str, list[tuple[str, int]]] = {
        module_name(path, root): []
        for path in root.rglob("*.pyi")
        if not path.with_suffix(".py").exists()
    }
    known = set(files) | set(graph)
    for name, path in files.items():
        visitor = _Imports(name, path.name == "__init__.py", known)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[name] = visitor.found
    return graph


def layer_of(module: str) -> int:
    for i, layer in enumerate(LAYERS):
        if module in layer:
            return i
    raise KeyError(module)


def violations(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """What breaks the layers: an import of a higher layer, a module in no layer, a producer
    import it cannot make."""
    found = []
    for module, imports in graph.items():
        try:
            own = layer_of(module)
        except KeyError:
            found.append(f"{module} is in no layer: add it to LAYERS")
            continue
        for target, line in imports:
            if module in {"dataset_rt._loader.producer", "dataset_rt._loader.signals"}:
                top = target.partition(".")[0]
                allowed = PRODUCER_IMPORTS if module.endswith("producer") else set()
                if top == PACKAGE and target not in allowed:
                    found.append(f"{module}:{line} imports {target}: the producer cannot")
                elif top != PACKAGE and top not in sys.stdlib_module_names:
                    found.append(f"{module}:{line} imports {target}, not in the standard library")
            if target.partition(".")[0] != PACKAGE or (module, target) in ALLOWED_UP:
                continue
            if target not in graph:
                found.append(f"{module}:{line} imports {target}, which is not a module")
            elif layer_of(target) > own:
                found.append(
                    f"{module}:{line} imports {target}, a higher layer ({layer_of(target)} > {own})"
                )
    return found


def cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """The import circles between modules of the package (one path through each)."""
    edges = {
        module: sorted(
            {t for t, _ in imports if t in graph and t != module and (module, t) not in ALLOWED_UP}
        )
        for module, imports in graph.items()
    }
    found: list[list[str]] = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in edges[module]:
            if state.get(target) == 1:
                found.append([*path[path.index(target) :], target])
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module)
    return found


def test_every_module_imports_only_its_own_layer_or_lower() -> None:
    graph = package_imports()
    assert "dataset_rt._loader.producer" in graph and len(graph) >= 20  # the package was read
    assert set().union(*LAYERS) <= set(graph), "LAYERS names a module that does not exist"
    assert violations(graph) == []


def test_no_import_circles() -> None:
    assert cycles(package_imports()) == []


def test_producer_imports_only_signals_and_native() -> None:
    graph = package_imports()
    ours = {t for t, _ in graph["dataset_rt._loader.producer"] if t.startswith("dataset_rt")}
    assert ours <= PRODUCER_IMPORTS
    assert not [t for t, _ in graph["dataset_rt._loader.signals"] if t.startswith("dataset_rt")]


def test_no_module_looks_up_a_higher_layer_by_name() -> None:
    # sys.modules["dataset_rt.torch"] or importlib.import_module("dataset_rt.cli") is an import
    # the graph cannot see: a string that names a module of a higher layer is refused too. (The
    # loader learns that the adapter's collate stacks from the adapter, which registers it.)
    graph = package_imports()
    found = []
    for path in ROOT.rglob("*.py"):
        module = module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and node.value in graph
                and layer_of(node.value) > layer_of(module)
            ):
                found.append(f"{module}:{node.lineno} names {node.value}")
    assert found == []


# ---- the checks catch what they are for: a copy of the package with one bad import ----


def _copy_with(tmp_path: Path, added: dict[str, str]) -> Path:
    """A copy of the package's sources with ``added[module]`` appended to each module."""
    copy = tmp_path / PACKAGE
    for path in [*ROOT.rglob("*.py"), *ROOT.rglob("*.pyi")]:
        target = copy / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    for module, text in added.items():
        path = copy.parent / (module.replace(".", "/") + ".py")
        if not path.exists():
            path = path.with_suffix("") / "__init__.py"
        path.write_text(path.read_text() + text)
    return copy


@pytest.mark.parametrize(
    ("module", "line", "expected"),
    [
        # At module level.
        ("dataset_rt._config", "from dataset_rt._dataset import Dataset\n", "higher layer"),
        # Inside a function, relative.
        (
            "dataset_rt._loader.results",
            "def f():\n    from . import passes\n",
            "imports dataset_rt._loader.passes, a higher layer",
        ),
        # A name of the facade is an import of the facade.
        (
            "dataset_rt._loader.plan",
            "def f():\n    from dataset_rt import DataLoader\n",
            "imports dataset_rt, a higher layer",
        ),
        # The producer: nothing of the package but signals and _native, nothing outside stdlib.
        (
            "dataset_rt._loader.producer",
            "from dataset_rt._loader import slots\n",
            "the producer cannot",
        ),
        ("dataset_rt._loader.producer", "import numpy\n", "not in the standard library"),
    ],
)
def test_a_violating_import_is_caught(
    tmp_path: Path, module: str, line: str, expected: str
) -> None:
    copy = _copy_with(tmp_path, {module: line})
    found = violations(package_imports(copy))
    assert len(found) == 1 and expected in found[0], found


def test_a_circle_is_caught(tmp_path: Path) -> None:
    # One layer, both ways, inside functions: the layers allow it, the circle check does not.
    slots, results = "dataset_rt._loader.slots", "dataset_rt._loader.results"
    copy = _copy_with(
        tmp_path,
        {
            slots: "def f():\n    from dataset_rt._loader import results\n",
            results: "def g():\n    import dataset_rt._loader.slots\n",
        },
    )
    graph = package_imports(copy)
    assert violations(graph) == []
    found = cycles(graph)
    assert len(found) == 1 and set(found[0]) == {slots, results}, found


def test_type_checking_imports_are_left_out(tmp_path: Path) -> None:
    line = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from dataset_rt import torch\n"
    copy = _copy_with(tmp_path, {"dataset_rt._config": line})
    assert violations(package_imports(copy)) == []
