"""Shared fixtures: a private local Ray cluster (never a stale one) and a real Serve app."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # single machine: bind 127.0.0.1
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServeApp:
    """A running app: where it answers and where it writes."""

    name: str
    base_url: str
    save_path: Path
    weights_dir: Path
    args: dict


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[int]:
    """A fresh local Ray (address='local' never dials a leftover cluster) with Serve on a free
    loopback port; shut down at the end so no process outlives the tests."""
    import ray
    from ray import serve

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    """The tiny model, built once per run in a private cache; replicas load it by path."""
    from serve_app.engines.tiny_model import ensure_tiny_model

    return ensure_tiny_model(cache_dir=tmp_path_factory.mktemp("model-cache"))


def deploy(ray_cluster: int, model_dir: Path, tmp: Path, name: str, **overrides) -> ServeApp:
    """Deploy the app under `/<name>` (or `/` for 'rollout') with test-sized args."""
    from ray import serve

    from serve_app.app import build_app

    args = {
        "num_replicas": 2,
        "replica_num_cpus": 0.25,
        "save_path": str(tmp / "traces"),
        "weights_dir": str(tmp / "weights"),
        "control_timeout_s": 10.0,
        "hold_timeout_s": 20.0,
        "min_free_disk_mb": 1,
        "model_path": str(model_dir),
    }
    args.update(overrides)
    (tmp / "weights").mkdir(parents=True, exist_ok=True)
    prefix = "/" if name == "rollout" else f"/{name}"
    serve.run(build_app(args), name=name, route_prefix=prefix)
    base = f"http://127.0.0.1:{ray_cluster}" + ("" if prefix == "/" else prefix)
    return ServeApp(name, base, Path(args["save_path"]), Path(args["weights_dir"]), args)


@pytest.fixture(scope="module")
def app(ray_cluster, model_dir, tmp_path_factory) -> Iterator[ServeApp]:
    """A 2-replica app on the embedded engine, shared by one test module."""
    from ray import serve

    served = deploy(ray_cluster, model_dir, tmp_path_factory.mktemp("app"), "rollout")
    try:
        yield served
    finally:
        serve.delete(served.name)
