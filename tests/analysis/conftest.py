"""Fixtures of the analysis tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from profiling.store import TraceStore


@pytest.fixture
def store(tmp_path: Path) -> TraceStore:
    """A trace store (no background merges) under the test's temporary directory."""
    return TraceStore(tmp_path / "profile")
