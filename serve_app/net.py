"""Network helpers shared by the app, its local cluster (trainer/local_app.py), tests, benchmarks and examples."""

from __future__ import annotations

import ipaddress
import socket

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback."""
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_url(host: str, port: int) -> str:
    """The base URL of an HTTP server on (host, port), an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
