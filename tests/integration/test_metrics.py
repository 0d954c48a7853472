"""/metrics scraped over HTTP from the real 2-replica Serve app before, during and after a
profiled weight sync (start -> generate -> stop(pause) -> update -> start -> generate -> stop)."""

from __future__ import annotations

import httpx
import pytest
from integ_util import (
    generate_until_all_recorded,
    ok,
    poll,
    status,
    stop_if_active,
    wait_manifest,
    write_perturbed_weights,
)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

REPLICAS = 2
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(http: httpx.Client) -> Samples:
    """Every sample of /metrics, keyed by sample name and labels."""
    r = http.get("/metrics")
    assert r.status_code == 200, r.text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    """One sample's value; 0 if absent (a labelled counter has no series before its first inc)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def replica_ids(samples: Samples) -> set[str]:
    return {dict(labels)["replica_id"] for name, labels in samples if name == "rollout_profiler_replica_up"}


def states(samples: Samples) -> dict[str, str]:
    """replica_id -> the state its state set marks 1."""
    found = {}
    for (name, labels), v in samples.items():
        if name == "rollout_profiler_replica_state" and v == 1:
            found[dict(labels)["replica_id"]] = dict(labels)["state"]
    return found


def versions(samples: Samples) -> dict[str, float]:
    return {
        dict(labels)["replica_id"]: v
        for (name, labels), v in samples.items()
        if name == "rollout_profiler_replica_weight_version"
    }


def test_metrics_follow_a_profiled_weight_sync(app, http, model_dir):
    k = 31
    version = status(http)["weight_version"] + 1
    weights = write_perturbed_weights(model_dir, app.weights_dir / f"v{version}.safetensors", seed=version)
    before = scrape(http)
    ids = replica_ids(before)
    assert len(ids) == REPLICAS, before
    assert all(value(before, "rollout_profiler_replica_up", replica_id=rid) == 1 for rid in ids)
    assert value(before, "rollout_profiler_active_step") == 0
    assert set(states(before)) == ids and "profiling" not in states(before).values()
    assert set(versions(before).values()) == {version - 1}
    stops = "rollout_profiler_stop_critical_path_seconds_count"
    conflicts = {"call": "stop", "status": "409"}
    try:
        ok(http.post("/profile/start", json={"step": k}))
        generate_until_all_recorded(http, REPLICAS)
        during = scrape(http)
        assert states(during) == dict.fromkeys(ids, "profiling"), during
        assert value(during, "rollout_profiler_active_step") == k

        # A control call answered with an error status is counted by call and status.
        assert http.post("/profile/stop", json={"step": k + 100}).status_code == 409
        errors = scrape(http)
        assert value(errors, "rollout_profiler_control_call_errors_total", **conflicts) == (
            value(during, "rollout_profiler_control_call_errors_total", **conflicts) + 1
        )

        # The trainer's sync for version k: stop(k, pause) -> update(k, no resume) -> start(k+1).
        ok(http.post("/profile/stop", json={"step": k, "pause": True}))
        ok(http.post("/weights/update", json={"version": version, "path": weights.name, "resume": False}))
        updated = scrape(http)
        assert versions(updated) == dict.fromkeys(ids, version), updated
        assert value(updated, "rollout_profiler_active_step") == 0
        ok(http.post("/profile/start", json={"step": k + 1}))
        generate_until_all_recorded(http, REPLICAS)
        assert value(scrape(http), "rollout_profiler_active_step") == k + 1
        ok(http.post("/profile/stop", json={"step": k + 1}))
    finally:
        stop_if_active(http)

    after = scrape(http)
    assert value(after, "rollout_profiler_active_step") == 0
    assert "profiling" not in states(after).values()
    assert versions(after) == dict.fromkeys(ids, version)
    assert value(after, stops) == value(before, stops) + 2
    acks = "rollout_profiler_stop_ack_seconds_count"
    assert value(after, acks) == value(before, acks) + 2 * REPLICAS

    # Exports: one sample per replica per step, bytes as the manifests record them.
    manifests = [wait_manifest(http, step, ("complete", "partial")) for step in (k, k + 1)]
    assert all(m["status"] == "complete" for m in manifests), manifests
    written = sum(e["bytes"] for m in manifests for e in m["entries"] if e["role"] == "rollout")
    assert written > 0, manifests
    exports, trace_bytes = "rollout_profiler_export_seconds_count", "rollout_profiler_trace_bytes_total"

    def exports_counted() -> Samples | None:
        now = scrape(http)
        return now if value(now, exports) >= value(before, exports) + 2 * REPLICAS else None

    counted = poll(exports_counted, timeout=30, what="the controller to count both steps' exports")

    # Both steps' exports were collected: the backlog that bounds starts (429) is empty again.
    def backlog_drained() -> Samples | None:
        now = scrape(http)
        return now if value(now, "rollout_profiler_exporting_steps") == 0 else None

    poll(backlog_drained, timeout=30, what="the export backlog gauge to drain to 0")
    assert value(counted, exports) == value(before, exports) + 2 * REPLICAS
    assert value(counted, trace_bytes) == value(before, trace_bytes) + written
