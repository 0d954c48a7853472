"""Fixtures shared by the unit tests of profiling/."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from profiling.store import TraceStore


@pytest.fixture
def store(tmp_path: Path) -> TraceStore:
    """A trace store under the test's temporary directory."""
    return TraceStore(tmp_path / "profile")


@pytest.fixture
def exporter():
    """The single export thread a ProfileSession writes traces on."""
    ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export")
    yield ex
    ex.shutdown(wait=True)
