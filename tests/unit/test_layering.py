"""The layering of the project's packages, checked on their import graph.

`import_graph` reads every module of profiling/, serve_app/, trainer/ and tools/ with `ast` (no
module is imported) and records every import statement: at module level, inside functions and
methods, under `if TYPE_CHECKING:` or in `try:`. Relative imports are resolved against the
importing module's package, and `from pkg import name` names the module `pkg.name` when that is
one of the project's modules (else `pkg`). On that graph:

* profiling/ (the engine-agnostic core) imports neither Ray nor HTTP code (ray, fastapi,
  starlette, uvicorn, httpx, requests) nor the outer packages (serve_app, trainer, tools);
* serve_app/ imports neither trainer nor tools;
* trainer/ imports from serve_app only the wire schema and the typed errors (serve_app.api,
  serve_app.openai_api, serve_app.errors) and the collective wire protocol (serve_app.weight_wire);
  trainer/local_app.py, the private local cluster that starts the app for the main job, may also import serve_app.app, serve_app.net and serve_app.tiny_model;
* no import cycle joins the project's modules (a package's `__init__` is a module like any
  other), each one reported as a chain `a → b → … → a`.

The checker is also run on small packages written under tmp_path, so that each kind of
violation is shown to be reported.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("profiling", "serve_app", "trainer", "tools")

RAY_AND_HTTP = ("ray", "fastapi", "starlette", "uvicorn", "httpx", "requests")
FORBIDDEN: Mapping[str, tuple[str, ...]] = {
    "profiling": (*RAY_AND_HTTP, "serve_app", "trainer", "tools"),
    "serve_app": ("trainer", "tools"),
}
"""Top-level names each package may not import."""

TRAINER_MAY_IMPORT = ("serve_app.api", "serve_app.openai_api", "serve_app.errors", "serve_app.weight_wire")
LOCAL_APP_MAY_ALSO_IMPORT = ("serve_app.app", "serve_app.net", "serve_app.tiny_model")
LOCAL_APP = "trainer.local_app"

MAX_CYCLES = 50
"""Cycles listed at most (the graph of a tangled tree can hold very many)."""


@dataclass(frozen=True)
class Import:
    """One imported name of one import statement: who imports what, where."""

    importer: str  # module name, e.g. "profiling.session"
    target: str  # the imported module, resolved (a project module when it is one)
    path: Path
    line: int
    statement: str

    def where(self) -> str:
        return f"{self.path}:{self.line}: `{self.statement}`"


def module_files(root: Path, packages: Iterable[str] = PACKAGES) -> dict[str, Path]:
    """Module name → file, for every .py file of the packages under root."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: Mapping[str, Path]) -> str:
    """The longest known module that `name` is or lies in; `name` itself when none is."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return name


def _imports_of(module: str, path: Path, modules: Mapping[str, Path], root: Path) -> list[Import]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    shown = path.relative_to(root)
    found: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            statement = ast.unparse(node)
            for alias in node.names:
                found.append(Import(module, _resolve(alias.name, modules), shown, node.lineno, statement))
        elif isinstance(node, ast.ImportFrom):
            statement = ast.unparse(node)
            if node.level:
                anchor = package.split(".") if package else []
                if node.level - 1 >= len(anchor):
                    raise ValueError(f"{shown}:{node.lineno}: `{statement}` reaches above the top-level package")
                base = ".".join(anchor[: len(anchor) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                target = submodule if submodule in modules else _resolve(base, modules)
                found.append(Import(module, target, shown, node.lineno, statement))
    return found


def import_graph(root: Path, packages: Iterable[str] = PACKAGES) -> list[Import]:
    """Every import of every module of the packages under root (once per statement and target),
    in file and line order."""
    modules = module_files(root, packages)
    graph: set[Import] = set()
    for module, path in modules.items():
        graph.update(_imports_of(module, path, modules, root))
    return sorted(graph, key=lambda i: (str(i.path), i.line, i.target))


def _top(name: str) -> str:
    return name.partition(".")[0]


def layering_violations(graph: Iterable[Import]) -> list[str]:
    """The imports that break the layering rules, one line each (file, line, statement, why)."""
    problems: list[str] = []
    for imp in graph:
        own = _top(imp.importer)
        target = _top(imp.target)
        if target in FORBIDDEN.get(own, ()):
            problems.append(f"{imp.where()}: {own}/ must not import {target}")
        elif own == "trainer" and target == "serve_app":
            allowed = TRAINER_MAY_IMPORT
            if imp.importer == LOCAL_APP:
                allowed += LOCAL_APP_MAY_ALSO_IMPORT
            if imp.target not in allowed:
                problems.append(
                    f"{imp.where()}: {imp.importer} imports {imp.target}; "
                    f"trainer/ may import from serve_app only {', '.join(allowed)}"
                )
    return problems


def _strongly_connected(nodes: Iterable[str], edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Tarjan's components, iteratively (no recursion limit on a deep graph)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[list[str]] = []
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(edges.get(succ, ())))))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
    return components


def import_cycles(graph: Iterable[Import], limit: int = MAX_CYCLES) -> list[str]:
    """Each elementary cycle among the project's modules as `a → b → … → a`, with the line of
    each import on it; at most `limit` of them, then a line saying how many components remain."""
    graph = list(graph)
    project = {imp.importer for imp in graph}
    edges: dict[str, set[str]] = {}
    first_line: dict[tuple[str, str], Import] = {}
    for imp in graph:
        if imp.target in project and imp.target != imp.importer:
            edges.setdefault(imp.importer, set()).add(imp.target)
            first_line.setdefault((imp.importer, imp.target), imp)

    cycles: list[str] = []
    for component in _strongly_connected(project, edges):
        if len(component) < 2:
            continue
        members = set(component)
        # Each elementary cycle once: from its smallest module, through larger ones only.
        for start in component:
            path = [start]
            work = [iter(sorted(edges[start] & members))]
            while work:
                for succ in work[-1]:
                    if succ == start:
                        chain = [*path, start]
                        lines = ", ".join(
                            f"{first_line[a, b].path}:{first_line[a, b].line}" for a, b in pairwise(chain)
                        )
                        cycles.append(f"{' → '.join(chain)} ({lines})")
                        if len(cycles) >= limit:
                            return [*sorted(cycles), "… more cycles not listed"]
                    elif succ > start and succ not in path:
                        path.append(succ)
                        work.append(iter(sorted(edges.get(succ, set()) & members)))
                        break
                else:
                    work.pop()
                    path.pop()
    return sorted(cycles)


# -- the project's tree ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tree_graph() -> list[Import]:
    return import_graph(ROOT)


def test_the_checker_reads_the_whole_tree(tree_graph):
    """A graph that missed the packages would pass every rule: make sure it holds them."""
    importers = {imp.importer for imp in tree_graph}
    for module in ("profiling.session", "profiling.store", "serve_app.app", "trainer.client", "trainer.local_app"):
        assert module in importers, f"{module} not read"
    assert {_top(m) for m in importers} == set(PACKAGES)
    assert any(imp.importer == "trainer.client" and _top(imp.target) == "serve_app" for imp in tree_graph)


def test_packages_keep_their_layers(tree_graph):
    problems = layering_violations(tree_graph)
    assert not problems, "layering violations:\n" + "\n".join(problems)


def test_no_import_cycles(tree_graph):
    cycles = import_cycles(tree_graph)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# -- the checker on synthetic packages -----------------------------------------------------------


def write_tree(root: Path, files: Mapping[str, str]) -> Path:
    """Write the files (path → source) and an empty __init__.py in every package directory."""
    for package in PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for directory in [root / p for p in PACKAGES] + [p.parent for p in root.rglob("*.py")]:
        (directory / "__init__.py").touch()
    return root


def test_a_forbidden_import_inside_a_function_is_reported(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "profiling/core.py": "import os\n\n\ndef start():\n    import ray\n\n    return ray\n",
            "profiling/typed.py": (
                "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from starlette.requests import Request\n"
            ),
            "serve_app/handler.py": "class H:\n    def run(self):\n        import tools.gen\n",
            "tools/gen.py": "",
        },
    )
    assert layering_violations(import_graph(root)) == [
        "profiling/core.py:5: `import ray`: profiling/ must not import ray",
        "profiling/typed.py:4: `from starlette.requests import Request`: profiling/ must not import starlette",
        "serve_app/handler.py:3: `import tools.gen`: serve_app/ must not import tools",
    ]


def test_a_forbidden_from_import_is_reported(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "profiling/store.py": "from fastapi import FastAPI\nfrom serve_app import replica\n",
            "serve_app/replica.py": "from trainer.client import Client\n",
            "serve_app/api.py": "",
            "serve_app/app.py": "",
            "trainer/client.py": (
                "from serve_app import api\nfrom serve_app.api import Wire\nfrom serve_app import replica\n"
                "from serve_app.app import build\n\nClient = object\n"
            ),
            "trainer/local_app.py": "from serve_app.app import build\nfrom serve_app.replica import Replica\n",
        },
    )
    assert layering_violations(import_graph(root)) == [
        "profiling/store.py:1: `from fastapi import FastAPI`: profiling/ must not import fastapi",
        "profiling/store.py:2: `from serve_app import replica`: profiling/ must not import serve_app",
        "serve_app/replica.py:1: `from trainer.client import Client`: serve_app/ must not import trainer",
        "trainer/client.py:3: `from serve_app import replica`: trainer.client imports serve_app.replica; "
        "trainer/ may import from serve_app only serve_app.api, serve_app.openai_api, serve_app.errors, "
            "serve_app.weight_wire",
        "trainer/client.py:4: `from serve_app.app import build`: trainer.client imports serve_app.app; "
        "trainer/ may import from serve_app only serve_app.api, serve_app.openai_api, serve_app.errors, "
            "serve_app.weight_wire",
        "trainer/local_app.py:2: `from serve_app.replica import Replica`: trainer.local_app imports "
        "serve_app.replica; trainer/ may import from serve_app only serve_app.api, serve_app.openai_api, serve_app.errors, "
            "serve_app.weight_wire, "
        "serve_app.app, serve_app.net, serve_app.tiny_model",
    ]


def test_two_and_three_module_cycles_are_reported_as_chains(tmp_path):
    root = write_tree(
        tmp_path,
        {
            # two modules, one import inside a function
            "serve_app/a.py": "from serve_app import b\n",
            "serve_app/b.py": "def f():\n    from .a import thing\n",
            # three modules, one through a package __init__ and a relative import
            "profiling/x.py": "import profiling.y\n",
            "profiling/y.py": "from profiling.sub import helper\n",
            "profiling/sub/__init__.py": "from ..x import X\n",
            # no cycle: a chain, and a package importing its submodule that imports a sibling
            "trainer/__init__.py": "from trainer import p\n",
            "trainer/p.py": "from . import q\n",
            "trainer/q.py": "",
        },
    )
    assert import_cycles(import_graph(root)) == [
        "profiling.sub → profiling.x → profiling.y → profiling.sub "
        "(profiling/sub/__init__.py:1, profiling/x.py:1, profiling/y.py:1)",
        "serve_app.a → serve_app.b → serve_app.a (serve_app/a.py:1, serve_app/b.py:2)",
    ]


def test_a_package_init_is_a_module_of_a_cycle(tmp_path):
    root = write_tree(
        tmp_path,
        {"tools/__init__.py": "from tools.gen import main\n", "tools/gen.py": "from tools import VERSION\n"},
    )
    assert import_cycles(import_graph(root)) == ["tools → tools.gen → tools (tools/__init__.py:1, tools/gen.py:1)"]


def test_a_clean_tree_reports_nothing(tmp_path):
    root = write_tree(
        tmp_path,
        {
            "profiling/session.py": "import json\nfrom profiling import store\nfrom .store import TraceStore\n",
            "profiling/store.py": "import os\n",
            "serve_app/api.py": "from profiling.session import Session\n",
            "serve_app/errors.py": "",
            "serve_app/app.py": "import ray\nfrom fastapi import FastAPI\nfrom serve_app import api\n",
            "serve_app/net.py": "",
            "trainer/client.py": "import httpx\nfrom serve_app.api import Wire\nfrom serve_app.errors import Boom\n",
            "trainer/local_app.py": "from serve_app import app, net\nfrom serve_app.api import Wire\n",
            "tools/doc.py": "from serve_app.app import build\nfrom trainer.client import Client\n",
        },
    )
    graph = import_graph(root)
    assert len(graph) == 16
    assert layering_violations(graph) == [] and import_cycles(graph) == []
