"""`GET /ready`'s decision (docs/operations.md#readiness): every one of num_replicas replicas
answers on the served weight version; a sync's hold does not count against it."""

from __future__ import annotations

from serve_app.api import Readiness, ReplicaReport, StatusResponse


def _status(*replicas: ReplicaReport, version: int = 3, paused: bool = False) -> StatusResponse:
    return StatusResponse(
        state="idle",
        active_step=None,
        weight_version=version,
        paused=paused,
        replicas=list(replicas),
        control_timeout_s=10.0,
    )


def _replica(rid: str, version: int = 3, ok: bool = True, error: str | None = None) -> ReplicaReport:
    return ReplicaReport(replica_id=rid, ok=ok, weight_version=version, error=error)


def test_ready_when_every_replica_answers_on_the_served_version_even_during_a_hold():
    ready = Readiness.of(_status(_replica("a"), _replica("b"), paused=True), expected=2)
    assert ready.ready and ready.replicas_serving == 2 and ready.waiting_for == []


def test_not_ready_names_each_replica_that_does_not_serve_and_the_ones_not_running():
    readiness = Readiness.of(
        _status(_replica("a"), _replica("b", version=2), _replica("c", ok=False, error="timed out")), expected=4
    )
    assert not readiness.ready and readiness.replicas_serving == 1
    assert readiness.waiting_for == [
        "replica b is on weight version 2, not the served 3 (it is loading it)",
        "replica c does not answer: timed out",
        "1 of 4 replicas not running yet (starting, or restarting)",
    ]


def test_no_replica_yet_is_not_ready():
    readiness = Readiness.of(_status(), expected=2)
    assert not readiness.ready
    assert readiness.waiting_for == ["2 of 2 replicas not running yet (starting, or restarting)"]
