"""Multi-node (docs/design.md#trace-collection: one save_path): a 2-node Ray cluster on one machine,
one replica per node, each node recording into its own directory. After each stop every trace is
under the one save_path the manifest names (shipped through Ray), none is left on a node, and weight
versions reach both nodes through the object store from a trainer in the cluster, with no shared
path.

The scenario runs in its own process (multi_node_scenario.py): it needs its own Ray cluster.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration
SCENARIO = Path(__file__).with_name("multi_node_scenario.py")


@pytest.fixture(scope="module")
def report(model_dir, tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("multinode")
    proc = subprocess.run(
        [sys.executable, str(SCENARIO), str(work), str(model_dir)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, (
        f"scenario failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(lines[-1].removeprefix("REPORT "))


def test_replicas_run_on_both_nodes(report):
    assert len(report["nodes"]) == 2
    nodes = {r["node_id"] for r in report["final_status"]["replicas"]}
    assert nodes == set(report["nodes"]), "max_replicas_per_node=1 must put one replica on each node"


def test_every_trace_is_collected_under_save_path_and_none_is_stranded(report):
    for step in (1, 2):
        m = report["manifests"][str(step)]
        assert m["status"] == "complete", m
        rollout = [e for e in m["entries"] if e["role"] == "rollout"]
        assert {e["node_id"] for e in rollout} == set(report["nodes"]), "an entry from each node"
        for e in rollout:
            assert e["files"] and e["bytes"] > 0 and e["forward_steps"] > 0, e
            for f in e["files"]:
                assert f"step_{step}/{f}" in report["save_path_files"], f"{f} missing under save_path"
    traces = [f for f in report["node_dir_files"] if "/traces/" in f and not f.endswith("/")]
    assert traces == [], f"trace files stranded on nodes: {traces}"


def test_weights_reach_both_nodes_through_the_object_store(report):
    assert report["completion_versions"] == [1]
    assert report["restarted"]["versions"] == [1, 1], "a restarted replica must fetch version 1 itself"
    assert {r["weight_version"] for r in report["final_status"]["replicas"]} == {1}
    assert report["final_status"]["weight_version"] == 1
    # Each node received its own copy from the object store; no shared weights path was used.
    received = sorted(f for f in report["node_dir_files"] if f.endswith("weights/v1.safetensors"))
    assert len(received) == 2, report["node_dir_files"]
    # Refusals cross the handle as the app's status and message; version 1 keeps serving.
    bad, older = report["refused"]["bad_tensors"], report["refused"]["older_version"]
    assert bad is not None and bad["status"] == 422 and "version 1 keeps serving" in bad["detail"], bad
    assert older is not None and older["status"] == 409 and "older than the served version 1" in older["detail"], older
    # Step 2 ran on the new weights on both nodes, step 1 on the old ones.
    for step, version in ((1, 0), (2, 1)):
        rollout = [e for e in report["manifests"][str(step)]["entries"] if e["role"] == "rollout"]
        assert {e["weight_version"] for e in rollout} == {version}
