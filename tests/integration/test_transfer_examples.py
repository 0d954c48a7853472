"""docs/examples/transfer_modes.py, run as a user runs it against a real 2-replica app with
weight_transfer: collective: in file mode and in collective mode every version reaches both
replicas, and the profiled steps 1 and 2 come out complete on the right weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from integ_util import status, wait_manifest
from support.apps import deployed

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "docs" / "examples" / "transfer_modes.py"


@pytest.fixture(scope="module")
def served(ray_cluster, model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("transfer-examples")
    with deployed(ray_cluster, model_dir, tmp, "transfers", weight_transfer="collective") as app:
        yield app


def _run(app, model_dir: Path, mode: str) -> str:
    proc = subprocess.run(
        [
            sys.executable, str(EXAMPLE),
            "--url", app.base_url,
            "--mode", mode,
            "--model-path", str(model_dir),
            "--weights-dir", str(app.weights_dir),
            "--versions", "3",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"--- stdout ---\n{proc.stdout[-3000:]}\n--- stderr ---\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.parametrize(("mode", "published"), [("path", [1, 2, 3]), ("collective", [4, 5, 6])])
def test_each_mode_publishes_every_version_and_profiles_two_steps(served, model_dir, mode, published):
    """Run in order: the collective run continues from the version the path run left served."""
    out = _run(served, model_dir, mode)
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("v")] == [f"v{v}" for v in published]
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        assert [r["weight_version"] for r in status(c)["replicas"]] == [published[-1]] * 2
        manifests = [wait_manifest(c, k, ("complete",), timeout=120.0) for k in published[1:]]
    for k, m in zip(published[1:], manifests, strict=True):
        rollout = [e for e in m["entries"] if e["role"] == "rollout"]
        assert len(rollout) == 2 and {e["weight_version"] for e in rollout} == {k - 1}, m["entries"]
