"""A private single-machine Ray cluster and the rollout app on it: the main job's local app,
and the harness of the tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from trainer.client import AppAddress


class LocalApp(BaseModel):
    name: str
    base_url: str
    model_dir: str
    args: dict[str, Any]
    control_token: str | None
    """The app's control token, read as its ingress reads it (None: the app has none)."""
    control_url: str | None = None
    """The app's control listener (None: its args set none)."""
    ray_address: str
    """The private cluster's GCS address, for a trainer process that joins it (object-store weights)."""

    @property
    def address(self) -> AppAddress:
        """Where a trainer reaches this app: generation at Serve's port, control at the control
        listener if it has one. Not the replica listener: it balances by connection, and a
        trainer's few keep-alive connections can leave a replica without a request for a whole
        profiled step; Serve's router balances each request."""
        return AppAddress(url=self.base_url, control_url=self.control_url, control_token=self.control_token)


@contextlib.contextmanager
def local_cluster(num_cpus: int | None = None, num_gpus: int | None = None) -> Iterator[int]:
    """A fresh local Ray with Serve's HTTP proxy on a free loopback port (yielded). Uses
    address='local', so a stale cluster left by a killed head is never dialled; shuts both
    down on exit so no process outlives the caller. `num_gpus`: logical GPUs to declare (a
    framework's resource pools reserve them; none is touched), None: those Ray finds.

    Ray's processes (the replicas among them) inherit the environment of `ray.init`: it carries
    QUIET_KINETO_ENV's defaults, so the replicas' profilers print no Kineto probe lines."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # bind 127.0.0.1
    import ray
    from ray import serve
    from ray.serve.context import _set_global_client

    from profiling.backends.torch_profiler import quiet_kineto_env
    from serve_app.net import free_port

    quiet_kineto_env()
    ray.init(
        address="local",
        num_cpus=num_cpus or max(4, os.cpu_count() or 1),
        num_gpus=num_gpus,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        try:
            _delete_apps()
        finally:
            ray.shutdown()  # Serve's controller and proxy go down with the private cluster
            _set_global_client(None)  # and the handle to the controller, as serve.shutdown() drops it


def _delete_apps() -> None:
    """Delete every Serve application (each replica shuts down gracefully: engine, exports) and
    leave Serve's controller and proxy to `ray.shutdown()`. Not `serve.shutdown()`: its
    `graceful_shutdown` call returns only by failing when the controller kills itself, and as that
    actor retries its tasks forever, Ray prints `Task ServeController.graceful_shutdown failed ...
    will be retried` at every exit."""
    from ray import serve

    for name in serve.status().applications:  # none if Serve never started
        serve.delete(name)


def run_app(port: int, name: str, args: dict[str, Any], route_prefix: str = "/") -> str:
    """Deploy the app with `args` under `route_prefix` on the local cluster serving HTTP on
    `port`; returns its base URL."""
    from ray import serve

    from serve_app.app import build_app

    serve.run(build_app(args), name=name, route_prefix=route_prefix)
    return f"http://127.0.0.1:{port}" + ("" if route_prefix == "/" else route_prefix)


@contextlib.contextmanager
def local_rollout_app(serve_config: str | Path, overrides: dict[str, Any]) -> Iterator[LocalApp]:
    """Run the first application of `serve_config` with `overrides` applied to its args, on a
    private local cluster bound to loopback. `replica_env` in `overrides` adds to the config's."""
    import ray

    from serve_app.app import parse_args
    from serve_app.control_token import read_control_token
    from serve_app.net import free_port, http_url
    from serve_app.tiny_model import ensure_tiny_model

    try:
        spec = yaml.safe_load(Path(serve_config).read_text())["applications"][0]
    except (OSError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{serve_config} is not a Serve config with an application: {e}") from e
    config_args = spec.get("args", {})
    args = {**config_args, **overrides}
    for key in ("control_listener", "replica_listener"):  # private like the HTTP port: loopback, a free port
        if isinstance(args.get(key), dict):
            args[key] = {**args[key], "host": "127.0.0.1", "port": free_port()}
    if "replica_env" in overrides:
        args["replica_env"] = {**config_args.get("replica_env", {}), **overrides["replica_env"]}
    parsed = parse_args(args)
    model_dir = parsed.model_path or str(ensure_tiny_model(parsed.tiny_model))
    args["model_path"] = model_dir
    name = spec.get("name", "rollout")
    with local_cluster() as port:
        base_url = run_app(port, name, args)
        control = parsed.control_listener
        yield LocalApp(
            name=name,
            ray_address=ray.get_runtime_context().gcs_address,
            base_url=base_url,
            model_dir=model_dir,
            args=args,
            control_token=read_control_token(parsed),
            control_url=None if control is None else http_url(control.host, control.port),
        )
