"""Start a private local Ray + the rollout app of a Serve config file, for the main job."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel


class LocalApp(BaseModel):
    base_url: str
    model_dir: str
    args: dict[str, Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def local_rollout_app(serve_config: str | Path, overrides: dict[str, Any]) -> Iterator[LocalApp]:
    """Run the first application of `serve_config` with `overrides` applied to its args, on a
    fresh local cluster (address='local': never a stale one) bound to loopback."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray
    from ray import serve

    from serve_app.app import build_app, parse_args
    from serve_app.engines.tiny_model import ensure_tiny_model

    try:
        spec = yaml.safe_load(Path(serve_config).read_text())["applications"][0]
    except (OSError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{serve_config} is not a Serve config with an application: {e}") from e
    args = {**spec.get("args", {}), **overrides}
    parsed = parse_args(args)
    model_dir = parsed.model_path or str(ensure_tiny_model(parsed.tiny_model))
    args["model_path"] = model_dir
    port = _free_port()
    ray.init(address="local", num_cpus=max(4, os.cpu_count() or 1), include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name=spec.get("name", "rollout"), route_prefix="/")
        yield LocalApp(base_url=f"http://127.0.0.1:{port}", model_dir=model_dir, args=args)
    finally:
        serve.shutdown()
        ray.shutdown()
