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
            lambda: (
                (a := serve.status().applications.get(name)) is not None
                and a.status == ApplicationStatus.DEPLOY_FAILED
                and a
            ),
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


EXPOSED = """
import json, os, sys, time
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray
from ray import serve
from ray.serve._private import api as serve_api
from ray.serve.config import ProxyLocation
from ray.serve.schema import ApplicationStatus, ServeDeploySchema

config = json.loads(sys.argv[1])
ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
try:
    # What `serve run config.yaml` does with a config file: start Serve with its HTTP options,
    # then deploy the config; the controller builds the app. No proxy runs (Disabled): nothing
    # listens on 0.0.0.0, but Serve's HTTP host is 0.0.0.0.
    client = serve_api.serve_start(http_options=config["http_options"], proxy_location=ProxyLocation.Disabled)
    client.deploy_apps(ServeDeploySchema.model_validate(config), _blocking=False)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        app = serve.status().applications.get("exposed")
        if app is not None and app.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.RUNNING):
            print(json.dumps({"status": str(app.status), "message": app.message, "deployments": list(app.deployments)}))
            break
        time.sleep(0.5)
finally:
    serve.shutdown()
    ray.shutdown()
"""


def test_a_port_beyond_loopback_without_a_token_fails_the_build(tmp_path):
    """Serve's HTTP host 0.0.0.0 and no control token: the build fails naming the fix, before any
    replica starts. A private cluster of its own (the session's Serve is bound to loopback)."""
    import json

    config = {
        "http_options": {"host": "0.0.0.0", "port": 8000},
        "applications": [
            {
                "name": "exposed",
                "route_prefix": "/",
                "import_path": "serve_app.app:build_app",
                "args": {"num_replicas": 1, "replica_num_cpus": 0.25, "save_path": str(tmp_path / "traces")},
            }
        ],
    }
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    run = subprocess.run(
        [sys.executable, "-c", EXPOSED, json.dumps(config)], env=env, capture_output=True, text=True, timeout=300
    )
    lines = [line for line in run.stdout.splitlines() if line.startswith("{")]
    assert run.returncode == 0 and lines, run.stderr[-3000:]
    app = json.loads(lines[-1])
    assert app["status"].endswith("DEPLOY_FAILED"), app
    for text in ("0.0.0.0", "control_token_env", "127.0.0.1"):
        assert text in app["message"], app["message"]
    assert not app["deployments"], app
