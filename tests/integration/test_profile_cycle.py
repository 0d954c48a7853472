"""A full profile cycle over HTTP against the real 2-replica Serve app
(docs/design.md#step-semantics, docs/design.md#http-api, docs/design.md#traces-on-disk):
start -> generate -> stop -> manifest + traces on disk, and stop -> update -> start across a
weight update with exact version attribution in the traces."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hta.trace_analysis import TraceAnalysis
from integ_util import (
    check_entry_traces,
    complete,
    complete_concurrently,
    generate_until_all_recorded,
    ok,
    poll,
    status,
    stop_if_active,
    trace_events,
    wait_manifest,
    write_perturbed_weights,
)

from profiling.analysis.tool_view import VIEW_DIR, VIEW_RECORD
from profiling.markers import format_weight_update, parse_forward_step

pytestmark = pytest.mark.integration

REPLICAS = 2


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

    # The app merges the settled step into one timeline in the background (merge_on_complete).
    merge = poll(
        lambda: json.loads((step_dir / "manifest.json").read_text()).get("merge"),
        timeout=60,
        what=f"the background merge of step {step}",
    )
    assert merge["status"] == "ok" and (step_dir / "merged.trace.json.gz").is_file(), merge
    assert {a["key"] for a in merge["processes"]} == {f"rollout/{e['replica_id']}" for e in rollout}

    # ... and writes the step's ranks view with it: HTA loads the step as the app left it, one rank
    # per trace, replicas by id, no `python -m profiling ranks` run (docs/analysis.md#trace-tools).
    view_dir = step_dir / VIEW_DIR
    poll(lambda: (view_dir / VIEW_RECORD).is_file(), timeout=60, what=f"the background ranks view of step {step}")
    expected = [
        f"-rollout-{e['replica_id'].replace('.', '_')}" + (f"-{n}" if n else "") + ".pt.trace.json.gz"
        for e in sorted(rollout, key=lambda e: e["replica_id"])
        for n, _ in enumerate(e["files"])
    ]
    expected = [f"rank{r}{name}" for r, name in enumerate(expected)]
    analyzer = TraceAnalysis(trace_dir=str(view_dir))
    assert sorted(analyzer.t.traces) == list(range(len(expected))), analyzer.t.trace_files
    assert [Path(analyzer.t.trace_files[r]).name for r in range(len(expected))] == expected


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
        # A request that arrives in the gap is held: no engine step runs unprofiled, and none
        # runs with the old weights after step k stopped.
        with ThreadPoolExecutor(1) as pool:
            stopped = ok(http.post("/profile/stop", json={"step": k, "pause": True}))
            assert stopped["stopped"] and all(r["ok"] and r["paused"] for r in stopped["replicas"]), stopped
            held = pool.submit(complete, http, "Red green blue", max_tokens=3)
            time.sleep(1.0)
            assert not held.done(), "a request ran while admission was held after stop(pause)"
            updated = ok(http.post("/weights/update", json={"version": version, "path": str(weights), "resume": False}))
            assert updated["version"] == version and len(updated["replicas"]) == REPLICAS
            assert all(r["ok"] and r["weight_version"] == version for r in updated["replicas"]), updated
            assert status(http)["paused"] is True
            time.sleep(0.5)
            assert not held.done(), "a request ran after update(resume=false), before start(k+1)"
            started = ok(http.post("/profile/start", json={"step": k + 1}))
            assert all(r["ok"] and r["weight_version"] == version and not r["paused"] for r in started["replicas"])
            gap = held.result(timeout=30)
        assert gap["weight_version"] == version
        assert [s["version"] for s in gap["choices"][0]["weight_versions"]] == [version]

        after = generate_until_all_recorded(http, REPLICAS)
        for r in after:
            assert r["weight_version"] == version
            assert all(
                ch["weight_version"] == version and [s["version"] for s in ch["weight_versions"]] == [version]
                for ch in r["choices"]
            )
        probe_after = complete(http, **probe)["choices"][0]
        assert probe_after["weight_version"] == version
        # The weights really changed: the same greedy prompt scores differently.
        assert probe_after["logprobs"]["token_logprobs"] != probe_before["logprobs"]["token_logprobs"]
        assert status(http)["weight_version"] == version

        last = ok(http.post("/profile/stop", json={"step": k + 1}))
    finally:
        stop_if_active(http)
    # Exact attribution: every forward pass any replica ran with version 1 so far (the held
    # request's included) was recorded in step k+1.
    for r in last["replicas"]:
        assert r["forward_steps_by_version"].get(str(version), 0) == r["forward_steps"] > 0, r

    for step, expected_version in ((k, 0), (k + 1, version)):
        manifest = wait_manifest(http, step, ("complete", "partial"))
        assert manifest["status"] == "complete", manifest
        entries = [e for e in manifest["entries"] if e["role"] == "rollout"]
        assert len(entries) == REPLICAS
        for e in entries:
            assert e["weight_version"] == expected_version and e["weight_versions"] == [expected_version], e
            markers = check_entry_traces(app.save_path / f"step_{step}", e, step)
            assert markers and {v for _, _, v in markers} == {expected_version}


def test_continuous_window_marks_the_weight_update(app, http, model_dir):
    """A window of steps [51, 52] spans the update to version 2: one trace per replica, labelled
    step 51, whose forward steps switch from version 1 to 2 at a `weight_update` range."""
    step, version = 51, 2
    weights = write_perturbed_weights(model_dir, app.weights_dir / f"v{version}.safetensors", seed=version)
    try:
        started = ok(http.post("/profile/start", json={"step": step, "steps": [step, step + 1], "tag": "window-51"}))
        assert started["steps"] == [step, step + 1]
        assert status(http)["steps"] == [step, step + 1]
        generate_until_all_recorded(http, REPLICAS)
        updated = ok(http.post("/weights/update", json={"version": version, "path": weights.name}))
        assert all(r["ok"] and r["weight_version"] == version for r in updated["replicas"]), updated
        for batch in (complete_concurrently(http, n=6, max_tokens=4), complete_concurrently(http, n=6, max_tokens=4)):
            assert all(r["weight_version"] == version for r in batch)
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    v2_passes = {r["replica_id"]: r["forward_steps_by_version"].get(str(version), 0) for r in stopped["replicas"]}

    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete" and manifest["steps"] == [step, step + 1], manifest
    assert manifest["tag"] == "window-51"
    assert {"step": step, "steps": [step, step + 1], "status": "complete"} in ok(http.get("/profile/steps"))["steps"]
    step_dir = app.save_path / f"step_{step}"
    seen_versions: set[int] = set()
    for e in manifest["entries"]:
        assert e["weight_version"] == version - 1 and e["weight_versions"][0] == version - 1, e
        markers = check_entry_traces(step_dir, e, step, versions={version - 1, version})
        marker_versions = [v for _, _, v in markers]
        assert marker_versions == sorted(marker_versions), "a forward step ran with older weights after the update"
        assert set(marker_versions) == set(e["weight_versions"]), e
        seen_versions |= set(marker_versions)
        # Every pass with version 2 so far ran inside this window, so each one is in the trace.
        assert marker_versions.count(version) == v2_passes[e["replica_id"]], (v2_passes, e)
        events = trace_events(step_dir, e)
        updates = [ev for ev in events if ev.get("name") == format_weight_update(version) and ev.get("ph") == "X"]
        assert len(updates) == 1, f"{e['replica_id']}: {len(updates)} weight_update ranges"
        forward = {
            m.index: ev for ev in events if ev.get("ph") == "X" and (m := parse_forward_step(str(ev.get("name", ""))))
        }
        update_ts = updates[0]["ts"]
        for i, _, v in markers:
            before = forward[i]["ts"] + forward[i]["dur"] <= update_ts
            assert before == (v == version - 1), (i, v, forward[i]["ts"], update_ts)
    assert seen_versions == {version - 1, version}


def test_max_forward_steps_caps_the_recording(app, http):
    step, cap = 61, 3
    try:
        ok(http.post("/profile/start", json={"step": step, "max_forward_steps": cap, "tag": "capped"}))

        def capped() -> bool:
            complete_concurrently(http, n=4, max_tokens=4)
            return all(r["state"] == "capped" for r in status(http)["replicas"])

        for _ in range(30):
            if capped():
                break
        st = status(http)
        assert st["active_step"] == step  # a capped step stays active until stopped
        assert all(r["state"] == "capped" and r["forward_steps"] == cap for r in st["replicas"]), st
        complete_concurrently(http, n=4, max_tokens=4)  # run after the cap: counted, not recorded
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    assert all(r["ok"] and r["forward_steps"] == cap for r in stopped["replicas"]), stopped

    def counted() -> dict | None:  # the stop adds the steps run since the cap, after its answer
        m = wait_manifest(http, step, ("complete", "partial"))
        return m if all(e["forward_steps_in_window"] is not None for e in m["entries"]) else None

    manifest = poll(counted, timeout=30, what=f"step {step}'s entries to count the steps run after the cap")
    assert manifest["status"] == "complete" and manifest["tag"] == "capped"
    assert manifest["options"]["max_forward_steps"] == cap
    for e in manifest["entries"]:
        assert e["forward_steps"] == cap and e["auto_stopped"] == "max_forward_steps", e
        ran = e["forward_steps_in_window"]
        assert ran > cap and e["kept"] == (
            f"kept {cap} of {ran:,} forward steps: max_forward_steps stopped the recording; "
            "raise max_forward_steps (null: no limit) to keep them all"
        ), e
        check_entry_traces(app.save_path / f"step_{step}", e, step)


def test_max_duration_s_stops_a_forgotten_step(app, http):
    step, limit = 62, 1.0
    try:
        ok(http.post("/profile/start", json={"step": step, "max_duration_s": limit}))
        complete_concurrently(http, n=4, max_tokens=4)
        t0 = time.monotonic()
        poll(lambda: status(http)["state"] == "idle", timeout=30, what="the max_duration_s watchdog to stop the step")
        assert time.monotonic() - t0 < limit + 10
    finally:
        stop_if_active(http)
    # The trainer's late stop finds nothing active.
    assert ok(http.post("/profile/stop", json={"step": step}))["stopped"] is False
    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete", manifest
    for e in manifest["entries"]:
        assert e["auto_stopped"] == "max_duration_s", e
        assert e["stopped_at"] - e["started_at"] < limit + 1.0, e
        check_entry_traces(app.save_path / f"step_{step}", e, step)
