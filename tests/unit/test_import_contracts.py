"""The layering of the project's packages: the import-linter contracts of pyproject.toml
(`[tool.importlinter]`), run by `lint-imports`, and the one rule they cannot state.

The contracts (every import statement counts: at module level, inside functions, under
`if TYPE_CHECKING:`):

* the packages are layered tools → trainer → serve_app → profiling (each imports only those
  below it: profiling/ none of the others, serve_app/ neither trainer nor tools);
* profiling/ imports neither Ray nor HTTP code (ray, fastapi, starlette, uvicorn, httpx, requests);
* trainer/ imports from serve_app only the wire schema and the typed errors (serve_app.api,
  serve_app.openai_api, serve_app.errors, serve_app.weights.collective_schema) and the collective wire
  protocol (serve_app.weights.collective);
  trainer/local_app.py, the private local cluster, also serve_app.app, serve_app.control_token,
  serve_app.net and serve_app.tiny_model;
* the engine packages (serve_app.engines.transformers, .vllm, .sglang) are independent of each
  other, and their engine/worker/client/server modules are imported only inside their own package;
* only the registry (serve_app.engines.registry) and each engine's own package import an engine's
  options class: no other module names which engines exist;
* no cycle joins the modules and subpackages of the packages listed in `acyclic-packages`.

import-linter's cycle contract compares a package's children as wholes, which some packages do not
meet yet, and cannot see a cycle through a package's own `__init__`; `module_cycles` checks the
plain module graph of the whole tree (a package's `__init__` is a module like any other).

Each contract is also shown to break: on a copy of the tree with one offending module per contract.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("profiling", "serve_app", "trainer", "tools")
CONTRACTS = {
    c["id"]: c["name"]
    for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
}


def lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """`lint-imports` on the tree and the pyproject.toml under root (it reads the packages there)."""
    return subprocess.run(
        [
            sys.executable,
            "-c",
            "from importlinter.cli import lint_imports_command; lint_imports_command()",
            "--no-cache",
            "--no-logo",
        ],
        cwd=root,
        env={**os.environ, "COLUMNS": "400", "NO_COLOR": "1", "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def module_cycles(graph: grimp.ImportGraph, packages: Iterable[str]) -> list[str]:
    """Each cycle of the packages' module graph as `a → b → … → a` (starting from its smallest
    module): for each import a → b, the shortest chain b → … → a that closes it."""
    modules = {m for p in packages for m in graph.find_descendants(p) | {p}}
    cycles: set[tuple[str, ...]] = set()
    for importer in sorted(modules):
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & modules):
            back = graph.find_shortest_chain(imported, importer) if imported != importer else None
            if back:
                ring = (importer, *back[:-1])
                start = ring.index(min(ring))
                cycles.add(ring[start:] + ring[:start])
    return sorted(" → ".join((*ring, ring[0])) for ring in cycles)


# -- the project's tree ------------------------------------------------------------------------


def test_the_contracts_hold():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(CONTRACTS)} kept, 0 broken." in result.stdout


def test_no_module_import_cycles():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    spec = importlib.util.find_spec("profiling")
    assert spec and spec.origin == str(ROOT / "profiling" / "__init__.py"), f"profiling found at {spec}, not in {ROOT}"
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    # A graph that missed part of the tree would pass (as would lint-imports, which reads the
    # same graph): make sure it holds every module.
    files = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
    }
    assert graph.modules == files
    cycles = module_cycles(graph, PACKAGES)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


# -- each rule shown to break ---------------------------------------------------------------------

BREAKS = {
    "layers": (
        "profiling/zz_layers.py",
        "def start():\n    from serve_app import replica\n\n    return replica\n",
        "profiling.zz_layers -> serve_app.replica (l.2)",
    ),
    "profiling-no-ray-or-http": (
        "profiling/zz_http.py",
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from starlette.requests import Request\n",
        "profiling.zz_http -> starlette (l.4)",
    ),
    "trainer-serve-app-surface": (
        "trainer/zz_surface.py",
        "from serve_app import api\nfrom serve_app import replica\n",
        "trainer.zz_surface -> serve_app.replica (l.2)",
    ),
    "engines-independent": (
        "serve_app/engines/vllm/zz_cross.py",
        "class Cross:\n    def run(self):\n        from serve_app.engines.sglang import options\n",
        "serve_app.engines.vllm.zz_cross -> serve_app.engines.sglang.options (l.3)",
    ),
    "engine-modules-private": (
        "serve_app/zz_private.py",
        "from serve_app.engines.vllm import engine\n",
        "serve_app.zz_private -> serve_app.engines.vllm.engine (l.1)",
    ),
    "engines-named-once": (
        "serve_app/zz_named.py",
        "from serve_app.engines.vllm.options import VllmOptions\n",
        "serve_app.zz_named -> serve_app.engines.vllm.options (l.1)",
    ),
    "acyclic-packages": (
        "trainer/zz_cycle_a.py",
        "from trainer import zz_cycle_b\n",
        ".zz_cycle_b -> .zz_cycle_a (1 import)",
    ),
}


def test_each_contract_breaks_on_an_offending_import(tmp_path):
    assert set(BREAKS) == set(CONTRACTS), "each contract needs an import that breaks it"
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for path, source, _ in BREAKS.values():
        (tmp_path / path).write_text(source)
    (tmp_path / "trainer/zz_cycle_b.py").write_text("def f():\n    from . import zz_cycle_a\n")

    result = lint_imports(tmp_path)
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert f"Contracts: 0 kept, {len(CONTRACTS)} broken." in out, out
    for contract, (_, _, reported) in BREAKS.items():
        assert f"{CONTRACTS[contract]} BROKEN" in out, out
        assert reported in out, f"{contract}: {reported!r} not reported:\n{out}"
    assert "zz_surface -> serve_app.api" not in out, "the allowed import was reported"


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """The files (path → source) under root, with an empty __init__.py in each directory without one."""
    for name, source in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    for directory in {p.parent for p in root.rglob("*.py")}:
        (directory / "__init__.py").touch()
    return root


def test_module_cycles_are_reported_as_chains(tmp_path, monkeypatch):
    write_tree(
        tmp_path,
        {
            # two modules, one import inside a function
            "cyc_srv/a.py": "from cyc_srv import b\n",
            "cyc_srv/b.py": "def f():\n    from .a import thing\n",
            # three modules, one through a package __init__ and a relative import
            "cyc_prof/x.py": "import cyc_prof.y\n",
            "cyc_prof/y.py": "from cyc_prof.sub import helper\n",
            "cyc_prof/sub/__init__.py": "from ..x import X\n",
            # a package __init__ and its own module (no sibling cycle: import-linter misses it)
            "cyc_tools/__init__.py": "from cyc_tools.gen import main\n",
            "cyc_tools/gen.py": "from cyc_tools import VERSION\n",
            # no cycle: a chain, and a package importing its submodule that imports a sibling
            "cyc_ok/__init__.py": "from cyc_ok import p\n",
            "cyc_ok/p.py": "from . import q\nimport json\n",
            "cyc_ok/q.py": "",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    packages = ("cyc_srv", "cyc_prof", "cyc_tools", "cyc_ok")
    graph = grimp.build_graph(*packages, cache_dir=None)
    assert module_cycles(graph, packages) == [
        "cyc_prof.sub → cyc_prof.x → cyc_prof.y → cyc_prof.sub",
        "cyc_srv.a → cyc_srv.b → cyc_srv.a",
        "cyc_tools → cyc_tools.gen → cyc_tools",
    ]
    assert module_cycles(graph, ["cyc_ok"]) == []


@pytest.mark.parametrize("contract", sorted(CONTRACTS))
def test_each_contract_is_documented(contract):
    """docs/design.md's table of the contracts names each one by id."""
    assert f"| `{contract}` |" in (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
