"""docs/examples/byo_sglang_transfer.py, run as a user runs it (a second Ray driver in the app's
cluster), against a 2-replica app with engine sglang, each replica driving its own FAKE SGLang
server (tests/fakes/fake_sglang_server.py: NOT SGLang, which needs CUDA): a trainer moving weights
itself by SGLang's update_weights_from_distributed, with the profiled steps around it.

The example's run publishes versions 1 and 2 (steps 1 and 2 profiled); the failing variant then
continues from version 2 and never sets SGLang's weight_version.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from integ_util import complete_one, process_log, run_example_in_cluster, wait_complete_manifest
from safetensors.torch import load_file
from support.apps import deployed
from support.fake_sglang import fake_servers, fake_sglang_options, served_weights

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = REPO_ROOT / "docs" / "examples" / "byo_sglang_transfer.py"
REPLICAS = 2


@pytest.fixture(scope="module")
def sglang_app(ray_cluster, model_dir, tmp_path_factory):
    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("byosglang"),
        "byosglang",
        engine="sglang",
        num_replicas=REPLICAS,
        control_timeout_s=90.0,
        sglang=fake_sglang_options(),
    ) as served:
        yield served


def test_the_trainers_own_transfer_by_sglangs_distributed_update_is_profiled_and_served(
    sglang_app, model_dir, tmp_path
):
    sent = tmp_path / "sent.safetensors"
    proc = run_example_in_cluster(EXAMPLE, sglang_app, model_dir, "--save-weights", str(sent))
    assert proc.returncode == 0, process_log(proc)
    assert "v1: " in proc.stdout and "v2: " in proc.stdout, process_log(proc)
    for k in (1, 2):
        m = wait_complete_manifest(sglang_app.save_path, k, timeout=180.0)
        assert m["status"] == "complete", m
        rollout = [e for e in m["entries"] if e["role"] == "rollout"]
        assert len(rollout) == REPLICAS and all(
            e["status"] == "ok" and e["weight_version"] == k - 1 for e in rollout
        ), m
        (trainer,) = [e for e in m["entries"] if e["role"] == "trainer"]
        assert trainer["sync"]["transfer"] == "external", trainer["sync"]
    status = httpx.get(f"{sglang_app.base_url}/profile/status", timeout=30.0).json()
    assert status["weight_version"] == 2 and not status["paused"], status
    assert [r["weight_version"] for r in status["replicas"]] == [2] * REPLICAS, status
    assert complete_one(sglang_app)["choices"][0].get("weight_version") == 2
    # Every fake SGLang holds exactly the tensors the trainer broadcast.
    state = load_file(str(sent))
    names = sorted(state)
    urls = list(fake_servers(model_dir).values())
    assert len(urls) == REPLICAS, urls
    for url in urls:
        got = served_weights(url, names, {n: state[n].numel() for n in names})
        for name in names:
            assert torch.equal(got[name], state[name].float().flatten()), (url, name)


def test_a_transfer_that_leaves_sglangs_version_unset_fails_the_sync_naming_the_replica(sglang_app, model_dir):
    proc = run_example_in_cluster(EXAMPLE, sglang_app, model_dir, "--versions", "1", "--skip-version-update")
    assert proc.returncode != 0, process_log(proc)
    err = proc.stderr
    assert "the engine reports weight version 2, not 3" in err, process_log(proc)
    replicas = httpx.get(f"{sglang_app.base_url}/profile/status", timeout=30.0).json()["replicas"]
    assert any(r["replica_id"] in err for r in replicas), process_log(proc)
    status = httpx.get(f"{sglang_app.base_url}/profile/status", timeout=30.0).json()
    assert status["weight_version"] == 2, "the app keeps the version every replica reported"
