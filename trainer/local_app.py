"""Start a private local Ray + the rollout app of a Serve config file, for the main job."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel


class LocalApp(BaseModel):
    name: str
    base_url: str
    model_dir: str
    args: dict[str, Any]


@contextlib.contextmanager
def local_rollout_app(serve_config: str | Path, overrides: dict[str, Any]) -> Iterator[LocalApp]:
    """Run the first application of `serve_config` with `overrides` applied to its args, on a
    private local cluster bound to loopback. `replica_env` in `overrides` adds to the config's."""
    from serve_app.app import parse_args
    from serve_app.engines.tiny_model import ensure_tiny_model
    from serve_app.local import local_cluster, run_app

    try:
        spec = yaml.safe_load(Path(serve_config).read_text())["applications"][0]
    except (OSError, KeyError, IndexError, TypeError) as e:
        raise ValueError(f"{serve_config} is not a Serve config with an application: {e}") from e
    config_args = spec.get("args", {})
    args = {**config_args, **overrides}
    if "replica_env" in overrides:
        args["replica_env"] = {**config_args.get("replica_env", {}), **overrides["replica_env"]}
    parsed = parse_args(args)
    model_dir = parsed.model_path or str(ensure_tiny_model(parsed.tiny_model))
    args["model_path"] = model_dir
    name = spec.get("name", "rollout")
    with local_cluster() as port:
        base_url = run_app(port, name, args)
        yield LocalApp(name=name, base_url=base_url, model_dir=model_dir, args=args)
