"""Fixtures shared by the unit tests of profiling/ (`store` and `spec` are in tests/conftest.py)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest


@pytest.fixture
def exporter():
    """The single export thread a ProfileSession writes traces on."""
    ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export")
    yield ex
    ex.shutdown(wait=True)
