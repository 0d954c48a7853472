"""serve_app/metrics.py: exports counted once however they are reported, fleet gauges follow the
fleet (replicas that left disappear, replicas that did not answer are down)."""

from __future__ import annotations

import time

from prometheus_client import REGISTRY

from profiling.config import ProfileOptions
from profiling.manifest import ManifestEntry, SessionRecord, StepManifest
from profiling.store import TraceStore
from serve_app import metrics
from serve_app.api import ReplicaReport, StatusResponse


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def rollout(rid: str, *, exporting: bool = False, size: int = 100) -> ManifestEntry:
    if exporting:
        return ManifestEntry(role="rollout", replica_id=rid, exporting=True)
    return ManifestEntry(role="rollout", replica_id=rid, export_s=0.5, bytes=size)


def test_exports_are_counted_once_even_when_reported_before_they_finish(store: TraceStore):
    step = 901
    store.write_session(
        step, SessionRecord(step=step, steps=[step], tool="torch", options=ProfileOptions(),
                            started_at=time.time(), stopped_at=time.time())
    )
    store.write_entry(step, rollout("a", size=100))
    store.write_entry(step, rollout("b", exporting=True))
    store.write_entry(step, ManifestEntry(role="trainer", rank=0, export_s=1.0, bytes=10_000))
    count, written = sample("rollout_profiler_export_seconds_count"), sample("rollout_profiler_trace_bytes_total")

    # The controller's collection sees b still exporting: a is counted, the step stays pending.
    metrics.observe_exports(store.refresh_manifest(step))
    assert sample("rollout_profiler_export_seconds_count") == count + 1
    assert sample("rollout_profiler_trace_bytes_total") == written + 100
    metrics.refresh_exports(store)  # nothing new on disk: nothing counted twice
    assert sample("rollout_profiler_export_seconds_count") == count + 1

    store.write_entry(step, rollout("b", size=50))
    assert store.refresh_manifest(step).status == "complete"
    metrics.refresh_exports(store)
    metrics.refresh_exports(store)  # settled: forgotten, never read or counted again
    assert sample("rollout_profiler_export_seconds_count") == count + 2
    assert sample("rollout_profiler_trace_bytes_total") == written + 150  # trainer traces excluded


def test_settled_manifest_is_counted_at_once():
    step = 902
    count = sample("rollout_profiler_export_seconds_count")
    manifest = StepManifest(step=step, steps=[step], tool="torch", status="complete", entries=[rollout("a")])
    metrics.observe_exports(manifest)
    assert sample("rollout_profiler_export_seconds_count") == count + 1


def status(*replicas: ReplicaReport, active_step: int | None = None) -> StatusResponse:
    return StatusResponse(
        state="profiling" if active_step else "idle", active_step=active_step, weight_version=3,
        paused=False, replicas=list(replicas), control_timeout_s=30.0,
    )


def test_fleet_gauges_follow_the_status_broadcast():
    metrics.refresh_fleet(status(
        ReplicaReport(replica_id="r1", state="profiling", weight_version=3),
        ReplicaReport(replica_id="r2", ok=False, error="no answer within 3.0s"),
        ReplicaReport(replica_id="unknown", ok=False, error="no answer"),
        active_step=7,
    ))
    assert sample("rollout_profiler_active_step") == 7
    assert sample("rollout_profiler_replica_up", replica_id="r1") == 1
    assert sample("rollout_profiler_replica_state", replica_id="r1", state="profiling") == 1
    assert sample("rollout_profiler_replica_state", replica_id="r1", state="idle") == 0
    assert sample("rollout_profiler_replica_weight_version", replica_id="r1") == 3
    # A replica that did not answer is down, with no state or version (unknown, not zero).
    assert REGISTRY.get_sample_value("rollout_profiler_replica_up", {"replica_id": "r2"}) == 0
    assert REGISTRY.get_sample_value("rollout_profiler_replica_weight_version", {"replica_id": "r2"}) is None
    assert REGISTRY.get_sample_value("rollout_profiler_replica_up", {"replica_id": "unknown"}) is None

    metrics.refresh_fleet(status(ReplicaReport(replica_id="r3", state="idle", weight_version=4)))
    assert sample("rollout_profiler_active_step") == 0
    for gone in ("r1", "r2"):  # replicas that left the fleet leave the metrics
        assert REGISTRY.get_sample_value("rollout_profiler_replica_up", {"replica_id": gone}) is None
        assert REGISTRY.get_sample_value(
            "rollout_profiler_replica_state", {"replica_id": gone, "state": "idle"}
        ) is None
    assert sample("rollout_profiler_replica_state", replica_id="r3", state="idle") == 1

    metrics.refresh_fleet(None)  # the broadcast itself failed: no replica is known
    assert REGISTRY.get_sample_value("rollout_profiler_replica_up", {"replica_id": "r3"}) is None
