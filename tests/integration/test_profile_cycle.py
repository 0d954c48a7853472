"""A full profile cycle over HTTP against the real 2-replica Serve app (DESIGN §2, §4, §5):
start -> generate -> stop -> manifest + traces on disk, and stop -> update -> start across a
weight update with exact version attribution in the traces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from integ_util import (
    check_entry_traces,
    client,
    complete,
    complete_concurrently,
    generate_until_all_recorded,
    ok,
    status,
    stop_if_active,
    wait_manifest,
)

pytestmark = pytest.mark.integration

REPLICAS = 2


@pytest.fixture(scope="module")
def http(app):
    with client(app.base_url) as c:
        yield c


def write_perturbed_weights(model_dir: Path, out: Path, seed: int) -> Path:
    """The tiny model's full state dict with every tensor perturbed, as one safetensors file."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
        state[name] = (t + 0.05 * noise).contiguous()
    save_file(state, str(out))
    return out


def test_profile_cycle_writes_complete_manifest_and_traces(app, http):
    step = 11
    try:
        started = ok(http.post("/profile/start", json={"step": step}))
        assert started["step"] == step and started["state"] == "profiling"
        assert len(started["replicas"]) == REPLICAS
        assert all(r["ok"] and r["state"] == "profiling" for r in started["replicas"]), started
        assert len({r["replica_id"] for r in started["replicas"]}) == REPLICAS

        results = complete_concurrently(http, n=6, max_tokens=8)
        assert all(len(r["choices"]) == 1 and len(r["choices"][0]["token_ids"]) <= 8 for r in results)
        generate_until_all_recorded(http, REPLICAS)

        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    assert stopped["stopped"] is True and stopped["step"] == step
    assert len(stopped["replicas"]) == REPLICAS
    for r in stopped["replicas"]:
        assert r["ok"] and r["files"] and r["forward_steps"] > 0, r
    step_dir = app.save_path / f"step_{step}"
    assert Path(stopped["manifest"]) == step_dir / "manifest.json"

    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete", manifest
    on_disk = json.loads((step_dir / "manifest.json").read_text())
    assert on_disk["status"] == "complete" and on_disk["step"] == step
    rollout = [e for e in on_disk["entries"] if e["role"] == "rollout"]
    assert len(rollout) == REPLICAS
    assert {e["replica_id"] for e in rollout} == {r["replica_id"] for r in stopped["replicas"]}
    reported = {r["replica_id"]: r for r in stopped["replicas"]}
    for e in rollout:
        assert e["status"] == "ok" and not e["exporting"] and e["error"] is None, e
        assert e["weight_version"] == 0
        assert e["forward_steps"] == reported[e["replica_id"]]["forward_steps"] > 0
        assert e["started_at"] <= e["stopped_at"]
        check_entry_traces(step_dir, e, step)

    listed = ok(http.get("/profile/steps"))
    assert Path(listed["save_path"]) == app.save_path
    assert {"step": step, "steps": [step], "status": "complete"} in listed["steps"]


def test_weight_update_between_profiled_steps_is_attributed_exactly(app, http, model_dir):
    k, version = 21, 1
    weights = write_perturbed_weights(model_dir, app.weights_dir / f"v{version}.safetensors", seed=version)
    probe = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "logprobs": 1}
    try:
        ok(http.post("/profile/start", json={"step": k}))
        before = generate_until_all_recorded(http, REPLICAS)
        assert all(r["weight_version"] == 0 for r in before)
        probe_before = complete(http, **probe)["choices"][0]

        # The trainer's sync for version k: stop(k, pause) -> update(k, no resume) -> start(k+1).
        stopped = ok(http.post("/profile/stop", json={"step": k, "pause": True}))
        assert stopped["stopped"] and all(r["ok"] and r["paused"] for r in stopped["replicas"]), stopped
        updated = ok(http.post("/weights/update", json={"version": version, "path": str(weights), "resume": False}))
        assert updated["version"] == version and len(updated["replicas"]) == REPLICAS
        assert all(r["ok"] and r["weight_version"] == version for r in updated["replicas"]), updated
        started = ok(http.post("/profile/start", json={"step": k + 1}))
        assert all(r["ok"] and r["weight_version"] == version and not r["paused"] for r in started["replicas"])

        after = generate_until_all_recorded(http, REPLICAS)
        for r in after:
            assert r["weight_version"] == version
            assert all(ch["weight_version"] == version and ch["weight_versions"] == [version] for ch in r["choices"])
        probe_after = complete(http, **probe)["choices"][0]
        assert probe_after["weight_version"] == version
        # The weights really changed: the same greedy prompt scores differently.
        assert probe_after["logprobs"]["token_logprobs"] != probe_before["logprobs"]["token_logprobs"]
        assert status(http)["weight_version"] == version

        ok(http.post("/profile/stop", json={"step": k + 1}))
    finally:
        stop_if_active(http)

    for step, expected_version in ((k, 0), (k + 1, version)):
        manifest = wait_manifest(http, step, ("complete", "partial"))
        assert manifest["status"] == "complete", manifest
        entries = [e for e in manifest["entries"] if e["role"] == "rollout"]
        assert len(entries) == REPLICAS
        for e in entries:
            assert e["weight_version"] == expected_version and e["weight_versions"] == [expected_version], e
            markers = check_entry_traces(app.save_path / f"step_{step}", e, step)
            assert markers and {v for _, _, v in markers} == {expected_version}
