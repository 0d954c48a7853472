"""Run the app on a private single-machine Ray cluster (main job, tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_cluster(num_cpus: int | None = None) -> Iterator[int]:
    """A fresh local Ray with Serve's HTTP proxy on a free loopback port (yielded). Uses
    address='local', so a stale cluster left by a killed head is never dialled; shuts both
    down on exit so no process outlives the caller."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1
    import ray
    from ray import serve

    ray.init(
        address="local",
        num_cpus=num_cpus or max(4, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def run_app(port: int, name: str, args: dict[str, Any], route_prefix: str = "/") -> str:
    """Deploy the app with `args` under `route_prefix`; returns its base URL."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix)
    return f"http://127.0.0.1:{port}" + ("" if route_prefix == "/" else route_prefix)
