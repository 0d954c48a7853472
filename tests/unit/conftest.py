"""Fixtures shared by the unit tests (`store` and `spec` are in tests/conftest.py)."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest


@pytest.fixture
def exporter():
    """The single export thread a ProfileSession writes traces on."""
    ex = ThreadPoolExecutor(max_workers=1, thread_name_prefix="export")
    yield ex
    ex.shutdown(wait=True)


@pytest.fixture
def non_loopback_address() -> str:
    """An IPv4 address of this machine that is not loopback (skips when it has none)."""
    candidates = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # a UDP connect sends nothing: it only picks the interface a route would leave by
            s.connect(("192.0.2.1", 9))
            candidates.append(s.getsockname()[0])
        except OSError:
            pass
    with contextlib.suppress(OSError):
        candidates += socket.gethostbyname_ex(socket.gethostname())[2]
    for address in candidates:
        if not ipaddress.ip_address(address).is_loopback and not ipaddress.ip_address(address).is_unspecified:
            return address
    pytest.skip("this machine has no non-loopback IPv4 address to try a loopback-bound store on")
