"""A bad app config is refused when it is read (docs/configuration.md): `serve run` with a config
file that breaks a cross-field rule fails the application's build, naming the keys, and no
replica ever starts. Real `serve run` CLI, against the test session's Ray cluster."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import yaml
from integ_util import poll

BAD_ARGS = {
    # engine vllm cannot record with tool npu; the sglang block would do nothing with engine vllm.
    "engine": "vllm",
    "num_replicas": 1,
    "replica_num_cpus": 0.25,
    "profiler": {"tool": "npu"},
    "sglang": {"url": "http://127.0.0.1:9"},
}


def _serve_config(path: Path, name: str, args: dict) -> Path:
    config = {
        "applications": [
            {"name": name, "route_prefix": f"/{name}", "import_path": "serve_app.app:build_app", "args": args}
        ]
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_serve_run_refuses_a_bad_cross_field_config_naming_the_keys(ray_cluster, tmp_path):
    import ray
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    name = "badconfig"
    config = _serve_config(tmp_path / "serve.yaml", name, {**BAD_ARGS, "save_path": str(tmp_path / "traces")})
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    cli = Path(sys.executable).with_name("serve")
    t0 = time.monotonic()
    subprocess.run(
        [str(cli), "run", "--non-blocking", "--address", ray.get_runtime_context().gcs_address, str(config)],
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    try:
        app = poll(
            lambda: (a := serve.status().applications.get(name)) is not None
            and a.status == ApplicationStatus.DEPLOY_FAILED
            and a,
            timeout=120,
            what="the app's build to fail",
        )
        message = app.message
        for key in ("args.profiler", "tool 'npu'", "engine 'vllm'", "args.sglang"):
            assert key in message, message
        assert "Traceback" not in message.splitlines()[-1], message
        assert not app.deployments, f"deployments were created: {list(app.deployments)}"
        assert time.monotonic() - t0 < 120
    finally:
        serve.delete(name)
