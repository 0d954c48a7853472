"""A real Serve app for a test: deployed on the session's local cluster (tests/conftest.py's
`ray_cluster`) with test-sized args, and deleted on the way out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass
class ServeApp:
    """A running app: where it answers and where it writes."""

    name: str
    base_url: str
    save_path: Path
    weights_dir: Path
    args: dict


def deploy(ray_cluster: int, model_dir: Path, tmp: Path, name: str, **overrides) -> ServeApp:
    """Deploy the app under `/<name>` (or `/` for 'rollout') with test-sized args."""
    from trainer.local_app import run_app

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
    base = run_app(ray_cluster, name, args, "/" if name == "rollout" else f"/{name}")
    return ServeApp(name, base, Path(args["save_path"]), Path(args["weights_dir"]), args)


@contextlib.contextmanager
def deployed(ray_cluster: int, model_dir: Path, tmp: Path, name: str, **overrides) -> Iterator[ServeApp]:
    """`deploy`, and delete the app on the way out."""
    from ray import serve

    served = deploy(ray_cluster, model_dir, tmp, name, **overrides)
    try:
        yield served
    finally:
        serve.delete(served.name)
