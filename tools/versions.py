"""The pinned upstream versions and the supported Pythons, read from pyproject.toml (its
`[tool.rollout-profiler.versions]` and `requires-python`, the one place each is written;
docs/operations.md#versions)."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path
from typing import Any

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _pyproject() -> dict[str, Any]:
    with PYPROJECT.open("rb") as f:
        return tomllib.load(f)


def pins() -> dict[str, str]:
    """Each pinned package's version, by its key in the table (e.g. `vllm-image`)."""
    return dict(_pyproject()["tool"]["rollout-profiler"]["versions"])


def python_range() -> tuple[tuple[int, int], tuple[int, int]]:
    """requires-python as (lowest supported, first unsupported) minor versions; only the
    `>=X.Y,<X.Z` form is used, so any other is an error here rather than misread."""
    spec = _pyproject()["project"]["requires-python"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)\s*,\s*<\s*(\d+)\.(\d+)", spec)
    if not match:
        raise ValueError(f"requires-python {spec!r} is not of the form '>=X.Y,<X.Z'")
    a, b, c, d = map(int, match.groups())
    return (a, b), (c, d)


def python_supported(version: tuple[int, int]) -> bool:
    """Whether Python `version` (major, minor) is one requires-python admits."""
    low, high = python_range()
    return low <= version < high


def pin(name: str) -> str:
    """The pinned version of `name`; KeyError naming the known keys if there is none."""
    table = pins()
    if name not in table:
        raise KeyError(f"no pin named {name!r} in {PYPROJECT.name}; known: {', '.join(sorted(table))}")
    return table[name]


if __name__ == "__main__":
    # For tools/setup.sh: `python3 tools/versions.py KEY` prints one pin; `--check-python` exits 0
    # only if the interpreter running it is a supported one.
    if sys.argv[1:] == ["--check-python"]:
        sys.exit(0 if python_supported(sys.version_info[:2]) else 1)
    print(pin(sys.argv[1]))
