"""The app's logs as a user reads them (serve_app/serve_logs.py): after a profiled step and
requests the app refuses (a prompt over the context, a start while another step records), the
replica's and the controller's Serve logs and the replica process's stderr hold no ERROR line,
and each refusal is one WARNING line without a traceback. Kineto's thread check at a replica's
first profiler start (`External init callback must run in same thread as registerClient`) is one
of the lines that must not show (profiling/backends/torch_profiler.py, init_kineto).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from integ_util import HttpOptions, complete, ok, status, wait_manifest
from support.apps import deployed

pytestmark = pytest.mark.integration

APP = "logs"


@pytest.fixture(scope="module")
def logs_app(ray_cluster, model_dir, tmp_path_factory):
    with deployed(ray_cluster, model_dir, tmp_path_factory.mktemp("logs"), APP, num_replicas=1) as served:
        yield served


HTTP = HttpOptions(app="logs_app", timeout=60.0)
"""How `http` (conftest.py) reaches this module's app."""


def _logs_dir() -> Path:
    import ray

    return Path(ray._private.worker._global_node.get_logs_dir_path())


def _app_logs(pids: set[int]) -> dict[str, str]:
    """This app's deployment logs (Serve's, per replica) and its replicas' stderr (Ray's, by pid)."""
    logs = _logs_dir()
    files = list((logs / "serve").glob(f"replica_{APP}_*.log"))
    files += [p for pid in pids for p in logs.glob(f"worker-*-{pid}.err")]
    return {p.name: p.read_text(errors="replace") for p in files}


def test_a_profiled_step_and_refused_requests_log_no_error_line(logs_app, http):
    ok(http.post("/profile/start", json={"step": 1}))
    assert complete(http, "Red green blue", max_tokens=4)["choices"]
    another = http.post("/profile/start", json={"step": 5})
    assert another.status_code == 409, another.text
    ok(http.post("/profile/stop", json={"step": 1}))
    wait_manifest(http, 1, ("complete",), timeout=120)

    over = http.post("/v1/completions", json={"prompt": "red " * 3000, "max_tokens": 4})
    assert over.status_code == 422, over.text

    pids = {r["pid"] for r in status(http)["replicas"]}
    logs = _app_logs(pids)
    assert any(name.startswith(f"replica_{APP}_RolloutReplica") for name in logs), sorted(logs)
    assert any(name.endswith(".err") for name in logs), sorted(logs)
    errors = [
        f"{name}: {line}"
        for name, text in logs.items()
        for line in text.splitlines()
        if (re.search(r"\bERROR\b", line) or "Traceback" in line or "USDT" in line)
    ]
    assert not errors, "\n".join(errors)
    refused = [line for text in logs.values() for line in text.splitlines() if "Request refused" in line]
    assert any("WARNING" in line for line in refused), "the refusals are not in the logs read here: " + str(refused)
    assert any(re.search(r"CALL \w+ REFUSED", line) for text in logs.values() for line in text.splitlines())
