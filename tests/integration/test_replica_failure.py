"""A replica that dies mid-step (docs/design.md#fan-out, docs/design.md#status-codes): the stop
answers in bounded time and names the dead replica, the step's manifest is `partial`, the
restarted replica serves the next step, and a replica that restarts while a step is active joins
it late (`late_start` in the manifest).

Only processes this test started through Serve are killed: the pids come from the replicas' own
reports in the /profile/start answer of the app deployed here.
"""

from __future__ import annotations

import time

import pytest
from integ_util import (
    HttpOptions,
    check_entry_traces,
    complete,
    complete_concurrently,
    generate_until_all_recorded,
    kill_replica,
    ok,
    poll,
    status,
    stop_if_active,
    wait_for_fleet,
    wait_manifest,
    write_perturbed_weights,
)
from support.apps import deployed

pytestmark = pytest.mark.integration

REPLICAS = 2


@pytest.fixture(scope="module")
def failing(ray_cluster, model_dir, tmp_path_factory):
    with deployed(
        ray_cluster, model_dir, tmp_path_factory.mktemp("failure"), "failure", num_replicas=REPLICAS
    ) as served:
        yield served


HTTP = HttpOptions(app="failing", timeout=30.0, stop_at_end=True)
"""How `http` (conftest.py) reaches this module's app."""


@pytest.fixture(scope="module")
def dead() -> set[str]:
    """Replica ids killed so far in this module."""
    return set()


def test_dead_replica_is_reported_and_step_is_partial(failing, http, dead):
    step = 41
    timeout_s = failing.args["control_timeout_s"]
    try:
        started = ok(http.post("/profile/start", json={"step": step}))
        assert len(started["replicas"]) == REPLICAS and all(r["ok"] for r in started["replicas"])
        generate_until_all_recorded(http, REPLICAS)
        victim, survivor = started["replicas"]
        kill_replica(victim, {r["pid"] for r in started["replicas"]})
        dead.add(victim["replica_id"])

        t0 = time.monotonic()
        stopped = ok(http.post("/profile/stop", json={"step": step}))
        elapsed = time.monotonic() - t0
    finally:
        stop_if_active(http)
    assert elapsed < timeout_s + 8.0, f"stop took {elapsed:.1f}s with control_timeout_s={timeout_s}"
    assert stopped["stopped"] is True and stopped["step"] == step
    by_id = {r["replica_id"]: r for r in stopped["replicas"]}
    assert victim["replica_id"] in by_id, stopped
    assert by_id[victim["replica_id"]]["ok"] is False and by_id[victim["replica_id"]]["error"], stopped
    live = by_id[survivor["replica_id"]]
    assert live["ok"] and live["files"] and live["forward_steps"] > 0, stopped

    manifest = wait_manifest(http, step, ("partial", "complete"))
    assert manifest["status"] == "partial", manifest
    entries = {e["replica_id"]: e for e in manifest["entries"] if e["role"] == "rollout"}
    assert entries[victim["replica_id"]]["status"] == "error" and entries[victim["replica_id"]]["error"]
    assert not entries[victim["replica_id"]]["exporting"]
    good = entries[survivor["replica_id"]]
    assert good["status"] == "ok" and good["forward_steps"] == live["forward_steps"]
    check_entry_traces(failing.save_path / f"step_{step}", good, step)


def test_restarted_replica_serves_the_next_step(failing, http, dead):
    assert dead, "needs the replica killed by the previous test"
    fleet = wait_for_fleet(http, REPLICAS, dead)
    step = 42
    try:
        started = ok(http.post("/profile/start", json={"step": step}))
        assert len(started["replicas"]) == REPLICAS and all(r["ok"] for r in started["replicas"]), started
        generate_until_all_recorded(http, REPLICAS)
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    assert len(stopped["replicas"]) == REPLICAS and all(r["ok"] for r in stopped["replicas"]), stopped

    manifest = wait_manifest(http, step, ("complete", "partial"))
    assert manifest["status"] == "complete", manifest
    entries = [e for e in manifest["entries"] if e["role"] == "rollout"]
    assert len(entries) == REPLICAS
    ids = {e["replica_id"] for e in entries}
    assert ids == {r["replica_id"] for r in fleet} and not ids & dead
    for e in entries:
        assert e["status"] == "ok" and not e["late_start"]
        check_entry_traces(failing.save_path / f"step_{step}", e, step)


def test_replica_restarted_mid_step_joins_it_late(failing, http, dead, model_dir):
    """Also: the restarted replica loads the fleet's current weights (version 1) before serving."""
    wait_for_fleet(http, REPLICAS, dead)
    step, version = 43, 1
    weights = write_perturbed_weights(model_dir, failing.weights_dir / "v1.safetensors", seed=7)
    ok(http.post("/weights/update", json={"version": version, "path": weights.name}))
    greedy = {"prompt": "Every replica keeps its own trace", "max_tokens": 6, "temperature": 0}
    reference = complete(http, **greedy)["choices"][0]["token_ids"]
    try:
        started = ok(http.post("/profile/start", json={"step": step}))
        original = {r["replica_id"] for r in started["replicas"]}
        assert len(original) == REPLICAS and all(r["ok"] for r in started["replicas"])
        complete_concurrently(http, n=4, max_tokens=4)
        victim, survivor = started["replicas"]
        kill_replica(victim, {r["pid"] for r in started["replicas"]})
        dead.add(victim["replica_id"])

        fleet = wait_for_fleet(http, REPLICAS, dead)
        newcomer = next(r for r in fleet if r["replica_id"] not in original)
        # It converged to the desired state on start: the active step, recording.
        assert newcomer["active_step"] == step and newcomer["state"] == "profiling", newcomer
        assert newcomer["weight_version"] == version
        assert status(http)["active_step"] == step
        generate_until_all_recorded(http, REPLICAS)
        # Whichever replica answers, greedy decoding sees the same (perturbed) weights.
        for _ in range(4):
            again = complete(http, **greedy)["choices"][0]
            assert again["token_ids"] == reference and again["weight_version"] == version
        stopped = ok(http.post("/profile/stop", json={"step": step}))
    finally:
        stop_if_active(http)
    by_id = {r["replica_id"]: r for r in stopped["replicas"]}
    assert by_id[newcomer["replica_id"]]["ok"] and by_id[newcomer["replica_id"]]["forward_steps"] > 0, stopped
    assert by_id[survivor["replica_id"]]["ok"], stopped

    manifest = wait_manifest(http, step, ("partial", "complete"))
    entries = {e["replica_id"]: e for e in manifest["entries"] if e["role"] == "rollout"}
    assert set(entries) == {victim["replica_id"], survivor["replica_id"], newcomer["replica_id"]}, manifest
    late = entries[newcomer["replica_id"]]
    assert late["late_start"] is True and late["status"] == "ok", late
    assert late["weight_version"] == version
    assert late["started_at"] > entries[survivor["replica_id"]]["started_at"]
    check_entry_traces(failing.save_path / f"step_{step}", late, step)
    assert entries[survivor["replica_id"]]["late_start"] is False
    assert entries[victim["replica_id"]]["status"] == "error"
    assert manifest["status"] == "partial"


def test_a_replica_that_restarts_after_the_checkpoint_was_deleted_copies_it_from_a_peer(failing, http, dead, model_dir):
    """A framework that deletes each checkpoint once it is loaded (AReaL does): a replica that
    starts later loads the served version from a peer replica instead of failing on the path."""
    fleet = wait_for_fleet(http, REPLICAS, dead)
    version = status(http)["weight_version"] + 1
    weights = write_perturbed_weights(model_dir, failing.weights_dir / f"v{version}.safetensors", seed=11)
    ok(http.post("/weights/update", json={"version": version, "path": weights.name}))
    weights.unlink()
    greedy = {"prompt": "A deleted checkpoint", "max_tokens": 6, "temperature": 0}
    reference = complete(http, **greedy)["choices"][0]["token_ids"]
    victim = fleet[0]
    kill_replica(victim, {r["pid"] for r in fleet})
    dead.add(victim["replica_id"])
    newcomer = next(
        r for r in wait_for_fleet(http, REPLICAS, dead) if r["replica_id"] not in {f["replica_id"] for f in fleet}
    )
    assert newcomer["weight_version"] == version, newcomer
    for _ in range(4):
        again = complete(http, **greedy)["choices"][0]
        assert again["token_ids"] == reference and again["weight_version"] == version


def test_ready_answers_503_until_every_replica_serves_again(failing, http, dead):
    """The image's health check (docs/operations.md#readiness): a replica down is a 503 naming
    why, until Serve's replacement serves the served version."""
    fleet = wait_for_fleet(http, REPLICAS, dead)
    ready = http.get("/ready")
    served = status(http)["weight_version"]
    assert ready.status_code == 200 and ready.json() == {
        "ready": True,
        "weight_version": served,
        "replicas_expected": REPLICAS,
        "replicas_serving": REPLICAS,
        "waiting_for": [],
    }, ready.text
    victim = fleet[0]
    kill_replica(victim, {r["pid"] for r in fleet})
    dead.add(victim["replica_id"])
    down = poll(
        lambda: (r := http.get("/ready")).status_code == 503 and r.json(), timeout=60, what="/ready to answer 503"
    )
    assert down["ready"] is False and down["replicas_serving"] < REPLICAS and down["waiting_for"], down
    back = poll(
        lambda: (r := http.get("/ready")).status_code == 200 and r.json(), timeout=180, what="/ready to answer 200"
    )
    assert back["replicas_serving"] == REPLICAS and back["weight_version"] == served, back
    assert {r["replica_id"] for r in wait_for_fleet(http, REPLICAS, dead)}.isdisjoint(dead)
